#!/usr/bin/env bash
# A local single-node Apache Kafka broker (KRaft, combined broker+controller) built from the official jars on
# Maven Central. No tarball, no Docker: Maven resolves the broker's classpath, then we run kafka.Kafka directly.
#
#   scripts/kafka.sh start    # idempotent: reuses a running broker, or KAFKA_BOOTSTRAP_SERVERS if set
#   scripts/kafka.sh stop
#   scripts/kafka.sh restart
#   scripts/kafka.sh status
#   scripts/kafka.sh libs     # fetches the jars if needed and prints their directory (for the Java test producer)
#   scripts/kafka.sh secure-env   # the `export KAFKA_...` lines a client needs for the SASL_SSL listener
#
# Two client listeners: PLAINTEXT on 127.0.0.1:$KAFKA_PORT and SASL_SSL (SCRAM-SHA-512 over TLS) on
# 127.0.0.1:$KAFKA_SECURE_PORT, with a broker certificate from the local CA of scripts/ca.sh and a SCRAM user
# (KAFKA_SCRAM_USER, password generated on first start into <state>/kafka/tls/scram-password, never printed).
#
# Environment: KAFKA_VERSION (pinned default below), KAFKA_PORT (9092), KAFKA_CONTROLLER_PORT (9093),
# KAFKA_SECURE_PORT (9094), KAFKA_SCRAM_USER (stock-ledger), STOCK_LEDGER_CACHE (downloaded jars),
# STOCK_LEDGER_STATE (data, logs, CA), STOCK_LEDGER_CA_DIR (default <state>/ca).
set -euo pipefail

KAFKA_VERSION="${KAFKA_VERSION:-4.1.1}"
KAFKA_PORT="${KAFKA_PORT:-9092}"
KAFKA_CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-9093}"
KAFKA_SECURE_PORT="${KAFKA_SECURE_PORT:-9094}"
KAFKA_SCRAM_USER="${KAFKA_SCRAM_USER:-stock-ledger}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/ca.sh
source "$here/ca.sh"
cache="${STOCK_LEDGER_CACHE:-$HOME/.cache/stock-ledger}/kafka-$KAFKA_VERSION"
state="${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}/kafka"
pidfile="$state/kafka.pid"
tls="$state/tls"

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

# The broker's TLS material and the SCRAM user's password, generated once; the keystore is PKCS12 (what every
# Java 17 reads) with a random password kept beside it.
ensure_tls() {
  mkdir -p "$tls"
  chmod 700 "$tls"
  ca_issue "$tls" broker "IP:127.0.0.1"
  if [[ ! -f "$tls/keystore-password" ]]; then
    openssl rand -hex 24 >"$tls/keystore-password"
    chmod 600 "$tls/keystore-password"
    rm -f "$tls/broker.p12"
  fi
  if [[ ! -f "$tls/broker.p12" || "$tls/broker.crt" -nt "$tls/broker.p12" ]]; then
    openssl pkcs12 -export -name broker -in "$tls/broker.crt" -inkey "$tls/broker.key" -certfile "$ca_dir/ca.crt" \
      -passout "file:$tls/keystore-password" -out "$tls/broker.p12"
    chmod 600 "$tls/broker.p12"
  fi
  if [[ ! -f "$tls/scram-password" ]]; then
    openssl rand -hex 24 >"$tls/scram-password"
    chmod 600 "$tls/scram-password"
  fi
}

# SCRAM credentials live in the cluster metadata. `StorageTool format --add-scram` only helps fresh storage, so
# the user is created (or its password reset: an upsert) through the admin API once the broker runs; a marker in
# the data dir makes that once per storage and password.
ensure_scram_user() {
  local marker="$state/data/.scram-user-$KAFKA_SCRAM_USER"
  if [[ -f "$marker" && "$marker" -nt "$tls/scram-password" ]]; then return; fi
  log "creating SCRAM-SHA-512 user $KAFKA_SCRAM_USER"
  # A local development secret: it is on this command line for the few seconds the tool runs (its
  # --add-config-file mangles the SCRAM key and echoes the password on error). Output is discarded for the same
  # reason.
  for _ in 1 2 3 4 5; do
    if java_cmd kafka.admin.ConfigCommand --bootstrap-server "127.0.0.1:$KAFKA_PORT" --alter --entity-type users \
      --entity-name "$KAFKA_SCRAM_USER" \
      --add-config "SCRAM-SHA-512=[iterations=8192,password=$(cat "$tls/scram-password")]" >/dev/null 2>&1; then
      touch "$marker"
      return
    fi
    sleep 2
  done
  log "could not create the SCRAM user $KAFKA_SCRAM_USER through 127.0.0.1:$KAFKA_PORT; see $state/logs/server.log"
  exit 1
}

write_config() {
  mkdir -p "$state/data" "$state/logs"
  cat >"$state/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT,SASL_SSL://127.0.0.1:$KAFKA_SECURE_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,SASL_SSL://127.0.0.1:$KAFKA_SECURE_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location=$tls/broker.p12
listener.name.sasl_ssl.ssl.keystore.password=$(cat "$tls/keystore-password")
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

# `java_cmd --exec ...` replaces the (sub)shell with the JVM, so that `$!` of a background start is the broker's
# own pid and `stop` signals the broker, not a wrapper shell that would leave it running.
java_cmd() {
  local run=""
  if [[ "${1:-}" == --exec ]]; then run="exec"; shift; fi
  $run java -Xms256m -Xmx"${KAFKA_HEAP:-768m}" -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$state/log4j2.properties" -Dkafka.logs.dir="$state/logs" \
    -cp "$cache/libs/*" "$@"
}

start() {
  if [[ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ]]; then
    log "KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS is set: using it, not starting a local broker"
    return
  fi
  if running; then
    log "already running (pid $(cat "$pidfile")) on 127.0.0.1:$KAFKA_PORT"
    if port_open "$KAFKA_SECURE_PORT"; then
      ensure_scram_user
    else
      log "warning: this broker was started without the SASL_SSL listener on 127.0.0.1:$KAFKA_SECURE_PORT" \
        "(by an older scripts/kafka.sh): 'scripts/kafka.sh restart' adds it"
    fi
    return
  fi
  if port_open "$KAFKA_PORT"; then
    log "something already listens on 127.0.0.1:$KAFKA_PORT: reusing it as the broker"
    return
  fi
  fetch_jars
  ensure_tls
  write_config
  if [[ ! -f "$state/data/meta.properties" ]]; then
    log "formatting KRaft storage in $state/data"
    java_cmd kafka.tools.StorageTool format --standalone --ignore-formatted \
      -t "$(java_cmd kafka.tools.StorageTool random-uuid)" -c "$state/server.properties" >/dev/null
  fi
  log "starting broker $KAFKA_VERSION on 127.0.0.1:$KAFKA_PORT (logs: $state/logs)"
  java_cmd --exec kafka.Kafka "$state/server.properties" >"$state/logs/stdout.log" 2>&1 </dev/null &
  echo $! >"$pidfile"
  for i in $(seq 1 120); do
    if port_open "$KAFKA_PORT" && port_open "$KAFKA_SECURE_PORT"; then
      log "ready after ${i}x0.5s (PLAINTEXT :$KAFKA_PORT, SASL_SSL :$KAFKA_SECURE_PORT)"
      ensure_scram_user
      return
    fi
    if ! running; then log "broker exited during start; last lines of its log:"; tail -n 30 "$state/logs/stdout.log" "$state/logs/server.log" >&2 || true; exit 1; fi
    sleep 0.5
  done
  log "broker did not open 127.0.0.1:$KAFKA_PORT within 60 s; see $state/logs"; exit 1
}

stop() {
  if ! running; then log "not running"; return; fi
  local pid; pid="$(cat "$pidfile")"
  log "stopping pid $pid"
  # A pid file written by an older version of this script names the wrapper shell: signal its JVM child too.
  pkill -TERM -P "$pid" java 2>/dev/null || true
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return; }; sleep 0.5; done
  log "broker ignored SIGTERM for 30 s: SIGKILL"; kill -9 "$pid" 2>/dev/null || true; rm -f "$pidfile"
}

secure_env() {
  [[ -f "$tls/scram-password" ]] || { log "no secure listener set up in $state yet: run 'scripts/kafka.sh start'"; exit 1; }
  cat <<EOF
export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$KAFKA_SECURE_PORT
export KAFKA_SECURITY_PROTOCOL=SASL_SSL
export KAFKA_SASL_MECHANISM=SCRAM-SHA-512
export KAFKA_SASL_USERNAME=$KAFKA_SCRAM_USER
export KAFKA_SASL_PASSWORD_FILE=$tls/scram-password
export KAFKA_SSL_CA_FILE=$ca_dir/ca.crt
EOF
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  libs) fetch_jars; echo "$cache/libs" ;;
  jars) fetch_jars ;;
  status) if running || port_open "$KAFKA_PORT"; then echo "running"; else echo "stopped"; exit 1; fi ;;
  secure-env) secure_env ;;
  *) echo "usage: $0 start|stop|restart|status|libs|jars|secure-env" >&2; exit 2 ;;
esac
