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
#   scripts/kafka.sh cluster ...  # a separate 3-node cluster (below); never touches the single broker
#
# Two client listeners: PLAINTEXT on 127.0.0.1:$KAFKA_PORT and SASL_SSL (SCRAM-SHA-512 over TLS) on
# 127.0.0.1:$KAFKA_SECURE_PORT, with a broker certificate from the local CA of scripts/ca.sh and a SCRAM user
# (KAFKA_SCRAM_USER, password generated on first start into <state>/kafka/tls/scram-password, never printed).
#
# Environment: KAFKA_VERSION (pinned default below), KAFKA_PORT (9092), KAFKA_CONTROLLER_PORT (9093),
# KAFKA_SECURE_PORT (9094), KAFKA_SCRAM_USER (stock-ledger), STOCK_LEDGER_CACHE (downloaded jars),
# STOCK_LEDGER_STATE (data, logs, CA), STOCK_LEDGER_CA_DIR (default <state>/ca).
#
# A replicated cluster beside it, from the same jars (docs/kafka-cluster.md):
#   scripts/kafka.sh cluster start [NODE]    # all three nodes (or one); formats fresh storage once; idempotent
#   scripts/kafka.sh cluster stop [NODE]     # SIGTERM: a controlled shutdown (leadership moves first)
#   scripts/kafka.sh cluster kill NODE       # SIGKILL: a crash
#   scripts/kafka.sh cluster restart NODE    # stop, then start
#   scripts/kafka.sh cluster status          # one line per node; exit 1 unless all three run
#   scripts/kafka.sh cluster bootstrap       # 127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
#   scripts/kafka.sh cluster leader TOPIC PARTITION   # the node id leading that partition, and its ISR
#   scripts/kafka.sh cluster controller      # the node id of the active controller (the KRaft quorum's leader)
#   scripts/kafka.sh cluster pid NODE        # the node's JVM pid
#   scripts/kafka.sh cluster wipe            # stop all, delete the cluster's storage (the next start formats anew)
# Nodes 1-3 are combined broker+controller KRaft nodes on 127.0.0.1: PLAINTEXT client listeners on
# KAFKA_CLUSTER_PORT+0..2 (default 19092-19094), controllers on KAFKA_CLUSTER_PORT+100..102, a dynamic quorum of
# the three voters (formatted with --initial-controllers), replication factor 3 and min.insync.replicas 2 for new
# topics and the internal ones, KAFKA_CLUSTER_HEAP (384m) per node, state in <state>/kafka-cluster. PLAINTEXT
# only: the TLS and SASL listeners are proven on the single broker.
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
  write_log4j2 "$state"
}

# The broker's log4j2 configuration (a .properties file: no YAML parser on the classpath), logging to DIR/logs.
write_log4j2() {
  cat >"$1/log4j2.properties" <<EOF
status = error
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = $1/logs/server.log
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
  # A cluster node sets java_heap, java_xms, java_gc, java_log4j and java_logs (bash's dynamic scope) for its JVM.
  $run java -Xms"${java_xms:-256m}" -Xmx"${java_heap:-${KAFKA_HEAP:-768m}}" "${java_gc:--XX:+UseG1GC}" \
    -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="${java_log4j:-$state/log4j2.properties}" -Dkafka.logs.dir="${java_logs:-$state/logs}" \
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

# ------------------------------------------------------------------------------------------ the 3-node cluster

KAFKA_CLUSTER_PORT="${KAFKA_CLUSTER_PORT:-19092}"
cluster_state="${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}/kafka-cluster"
nodes=(1 2 3)

broker_port() { echo $((KAFKA_CLUSTER_PORT + $1 - 1)); }
controller_port() { echo $((KAFKA_CLUSTER_PORT + 99 + $1)); }
node_dir() { echo "$cluster_state/node-$1"; }
node_pidfile() { echo "$(node_dir "$1")/kafka.pid"; }
node_running() { local f; f="$(node_pidfile "$1")"; [[ -f "$f" ]] && kill -0 "$(cat "$f")" 2>/dev/null; }

cluster_bootstrap() {
  local n out=()
  for n in "${nodes[@]}"; do out+=("127.0.0.1:$(broker_port "$n")"); done
  (IFS=,; echo "${out[*]}")
}

check_node() {
  [[ "${1:-}" =~ ^[123]$ ]] || { log "cluster: NODE must be 1, 2 or 3 (got '${1:-}')"; exit 2; }
}

# A Kafka Uuid (16 random bytes, URL-safe base64 without padding) without a JVM start; like Kafka's own generator
# it avoids a leading '-', which a command line would read as an option.
kafka_uuid() {
  local id
  while :; do
    id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
    if [[ "$id" != -* ]]; then echo "$id"; return; fi
  done
}

cluster_config() {
  local n="$1" dir voters="" m
  dir="$(node_dir "$n")"
  for m in "${nodes[@]}"; do voters+="${voters:+,}127.0.0.1:$(controller_port "$m")"; done
  mkdir -p "$dir/data" "$dir/logs"
  cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=$n
controller.quorum.bootstrap.servers=$voters
listeners=PLAINTEXT://127.0.0.1:$(broker_port "$n"),CONTROLLER://127.0.0.1:$(controller_port "$n")
advertised.listeners=PLAINTEXT://127.0.0.1:$(broker_port "$n"),CONTROLLER://127.0.0.1:$(controller_port "$n")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=3
min.insync.replicas=2
auto.create.topics.enable=false
offsets.topic.replication.factor=3
offsets.topic.num.partitions=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
transaction.state.log.num.partitions=3
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
num.network.threads=2
num.io.threads=4
background.threads=4
log.segment.bytes=67108864
log.retention.hours=24
EOF
  write_log4j2 "$dir"
}

# Every node's storage is formatted once, with one cluster id and the same three initial voters
# (node@host:port:directory-id), so the quorum exists from the first start: no standalone node to grow from.
cluster_format() {
  local n voters="" cid pids=()
  if [[ -f "$(node_dir 1)/data/meta.properties" && -f "$(node_dir 2)/data/meta.properties" \
        && -f "$(node_dir 3)/data/meta.properties" ]]; then return; fi
  rm -rf "$cluster_state"
  cid="$(kafka_uuid)"
  for n in "${nodes[@]}"; do voters+="${voters:+,}$n@127.0.0.1:$(controller_port "$n"):$(kafka_uuid)"; done
  log "cluster: formatting three nodes (cluster id $cid) in $cluster_state"
  for n in "${nodes[@]}"; do
    cluster_config "$n"
    (
      java_log4j="$(node_dir "$n")/log4j2.properties" java_logs="$(node_dir "$n")/logs" java_heap=256m java_xms=64m
      java_cmd kafka.tools.StorageTool format -t "$cid" -c "$(node_dir "$n")/server.properties" \
        --initial-controllers "$voters" >"$(node_dir "$n")/logs/format.log" 2>&1
    ) &
    pids+=($!)
  done
  for n in "${!pids[@]}"; do
    if ! wait "${pids[$n]}"; then
      log "cluster: formatting node $((n + 1)) failed:"; cat "$(node_dir $((n + 1)))/logs/format.log" >&2; exit 1
    fi
  done
}

cluster_spawn() {
  local n="$1" dir
  dir="$(node_dir "$n")"
  if node_running "$n"; then return; fi
  if port_open "$(broker_port "$n")" || port_open "$(controller_port "$n")"; then
    log "cluster: 127.0.0.1:$(broker_port "$n") or :$(controller_port "$n") is taken by another process (set KAFKA_CLUSTER_PORT)"
    exit 1
  fi
  cluster_config "$n"
  (
    java_log4j="$dir/log4j2.properties" java_logs="$dir/logs" java_heap="${KAFKA_CLUSTER_HEAP:-384m}" java_xms=128m
    # Three JVMs on a small machine: the client JIT only and the serial collector take less CPU to start and run
    # a node (what a test cluster needs); failover timings are Kafka's timeouts, not JIT-bound.
    java_gc="-XX:+UseSerialGC"
    java_cmd --exec -XX:TieredStopAtLevel=1 kafka.Kafka "$dir/server.properties" >"$dir/logs/stdout.log" 2>&1 </dev/null
  ) &
  echo $! >"$(node_pidfile "$n")"
}

cluster_wait() {
  local n="$1"
  for _ in $(seq 1 180); do
    if port_open "$(broker_port "$n")"; then return; fi
    if ! node_running "$n"; then
      log "cluster: node $n exited during start; last lines of its log:"
      tail -n 30 "$(node_dir "$n")/logs/stdout.log" "$(node_dir "$n")/logs/server.log" >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  log "cluster: node $n did not open 127.0.0.1:$(broker_port "$n") within 90 s; see $(node_dir "$n")/logs"; exit 1
}

# Without NODE: every node (a fresh cluster is formatted first). A node opens its client port once it has caught up
# with the metadata log; it may still be fenced for a moment, which clients wait out.
cluster_start() {
  local n todo=("${nodes[@]}")
  if [[ -n "${1:-}" ]]; then check_node "$1"; todo=("$1"); fi
  fetch_jars
  cluster_format
  for n in "${todo[@]}"; do cluster_spawn "$n"; done
  for n in "${todo[@]}"; do cluster_wait "$n"; done
  log "cluster: node(s) ${todo[*]} up ($(cluster_bootstrap))"
}

cluster_signal() {
  local n="$1" sig="$2" pid
  check_node "$n"
  if ! node_running "$n"; then log "cluster: node $n is not running"; return; fi
  pid="$(cat "$(node_pidfile "$n")")"
  kill -"$sig" "$pid" 2>/dev/null || true
  for _ in $(seq 1 120); do
    if ! kill -0 "$pid" 2>/dev/null; then rm -f "$(node_pidfile "$n")"; return; fi
    sleep 0.25
  done
  log "cluster: node $n ignored SIG$sig for 30 s: SIGKILL"; kill -9 "$pid" 2>/dev/null || true
  rm -f "$(node_pidfile "$n")"
}

cluster_stop() {
  local n todo=("${nodes[@]}")
  if [[ -n "${1:-}" ]]; then check_node "$1"; todo=("$1"); fi
  for n in "${todo[@]}"; do cluster_signal "$n" TERM; done
}

cluster_status() {
  local n all=0
  for n in "${nodes[@]}"; do
    if node_running "$n"; then
      echo "node $n running pid $(cat "$(node_pidfile "$n")")" \
        "broker 127.0.0.1:$(broker_port "$n") controller 127.0.0.1:$(controller_port "$n")"
    else
      echo "node $n stopped"; all=1
    fi
  done
  return "$all"
}

# One question to the cluster through the Java Admin client (scripts/ClusterAdmin.java, a single-file source).
cluster_admin() {
  fetch_jars
  mkdir -p "$cluster_state"
  printf 'status = error\nrootLogger.level = OFF\n' >"$cluster_state/admin-log4j2.properties"
  java_log4j="$cluster_state/admin-log4j2.properties" java_logs="$cluster_state" java_heap=256m java_xms=64m \
    java_cmd "$here/ClusterAdmin.java" "$(cluster_bootstrap)" "$@"
}

cluster() {
  local action="${1:-status}"
  shift || true
  case "$action" in
    start) cluster_start "${1:-}" ;;
    stop) cluster_stop "${1:-}" ;;
    kill) check_node "${1:-}"; cluster_signal "$1" KILL ;;
    restart) check_node "${1:-}"; cluster_signal "$1" TERM; cluster_start "$1" ;;
    status) cluster_status ;;
    bootstrap) cluster_bootstrap ;;
    pid) check_node "${1:-}"; node_running "$1" && cat "$(node_pidfile "$1")" ;;
    leader)
      if [[ $# -ne 2 ]]; then log "usage: cluster leader TOPIC PARTITION"; exit 2; fi
      cluster_admin leader "$1" "$2" ;;
    controller) cluster_admin controller ;;
    wipe) cluster_stop; rm -rf "$cluster_state"; log "cluster: storage deleted" ;;
    *) echo "usage: $0 cluster start [NODE]|stop [NODE]|kill NODE|restart NODE|status|bootstrap|" \
         "leader TOPIC PARTITION|controller|pid NODE|wipe" >&2
       exit 2 ;;
  esac
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  libs) fetch_jars; echo "$cache/libs" ;;
  jars) fetch_jars ;;
  status) if running || port_open "$KAFKA_PORT"; then echo "running"; else echo "stopped"; exit 1; fi ;;
  secure-env) secure_env ;;
  cluster) shift; cluster "$@" ;;
  *) echo "usage: $0 start|stop|restart|status|libs|jars|secure-env|cluster ..." >&2; exit 2 ;;
esac
