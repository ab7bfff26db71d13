#!/usr/bin/env bash
# A local single-node Apache Kafka broker (KRaft, combined broker+controller) built from the official jars on
# Maven Central. No tarball, no Docker: Maven resolves the broker's classpath, then we run kafka.Kafka directly.
#
#   scripts/kafka.sh start    # idempotent: reuses a running broker, or KAFKA_BOOTSTRAP_SERVERS if set
#   scripts/kafka.sh stop
#   scripts/kafka.sh restart
#   scripts/kafka.sh status
#
# Environment: KAFKA_VERSION (pinned default below), KAFKA_PORT (9092), KAFKA_CONTROLLER_PORT (9093),
# STOCK_LEDGER_CACHE (downloaded jars), STOCK_LEDGER_STATE (data and logs).
set -euo pipefail

KAFKA_VERSION="${KAFKA_VERSION:-4.1.1}"
KAFKA_PORT="${KAFKA_PORT:-9092}"
KAFKA_CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-9093}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${STOCK_LEDGER_CACHE:-$HOME/.cache/stock-ledger}/kafka-$KAFKA_VERSION"
state="${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}/kafka"
pidfile="$state/kafka.pid"

log() { printf '[kafka] %s\n' "$*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

running() { [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

fetch_jars() {
  if [[ -f "$cache/.complete" ]]; then return; fi
  command -v java >/dev/null || { log "java not found: install a JDK 17+ (apt-get install -y openjdk-17-jre-headless)"; exit 1; }
  command -v mvn >/dev/null || { log "mvn not found: install Maven (apt-get install -y maven)"; exit 1; }
  log "resolving Apache Kafka $KAFKA_VERSION from Maven Central into $cache (first run only)"
  mkdir -p "$cache/libs"
  mvn -B -q -Dstyle.color=never -f "$here/kafka-pom.xml" -Dkafka.version="$KAFKA_VERSION" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$cache/libs"
  touch "$cache/.complete"
}

write_config() {
  mkdir -p "$state/data" "$state/logs"
  cat >"$state/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$state/data
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
log.retention.hours=168
log.segment.bytes=268435456
EOF
  cat >"$state/log4j2.properties" <<EOF
status = error
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = $state/logs/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = INFO
EOF
}

java_cmd() {
  java -Xms256m -Xmx"${KAFKA_HEAP:-768m}" -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$state/log4j2.properties" -Dkafka.logs.dir="$state/logs" \
    -cp "$cache/libs/*" "$@"
}

start() {
  if [[ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ]]; then
    log "KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS is set: using it, not starting a local broker"
    return
  fi
  if running; then log "already running (pid $(cat "$pidfile")) on 127.0.0.1:$KAFKA_PORT"; return; fi
  if port_open "$KAFKA_PORT"; then
    log "something already listens on 127.0.0.1:$KAFKA_PORT: reusing it as the broker"
    return
  fi
  fetch_jars
  write_config
  if [[ ! -f "$state/data/meta.properties" ]]; then
    log "formatting KRaft storage in $state/data"
    java_cmd kafka.tools.StorageTool format --standalone --ignore-formatted \
      -t "$(java_cmd kafka.tools.StorageTool random-uuid)" -c "$state/server.properties" >/dev/null
  fi
  log "starting broker $KAFKA_VERSION on 127.0.0.1:$KAFKA_PORT (logs: $state/logs)"
  java_cmd kafka.Kafka "$state/server.properties" >"$state/logs/stdout.log" 2>&1 </dev/null &
  echo $! >"$pidfile"
  for i in $(seq 1 120); do
    if port_open "$KAFKA_PORT"; then log "ready after ${i}x0.5s"; return; fi
    if ! running; then log "broker exited during start; last lines of its log:"; tail -n 30 "$state/logs/stdout.log" "$state/logs/server.log" >&2 || true; exit 1; fi
    sleep 0.5
  done
  log "broker did not open 127.0.0.1:$KAFKA_PORT within 60 s; see $state/logs"; exit 1
}

stop() {
  if ! running; then log "not running"; return; fi
  local pid; pid="$(cat "$pidfile")"
  log "stopping pid $pid"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return; }; sleep 0.5; done
  log "broker ignored SIGTERM for 30 s: SIGKILL"; kill -9 "$pid" 2>/dev/null || true; rm -f "$pidfile"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  jars) fetch_jars ;;
  status) if running || port_open "$KAFKA_PORT"; then echo "running"; else echo "stopped"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|restart|status|jars" >&2; exit 2 ;;
esac
