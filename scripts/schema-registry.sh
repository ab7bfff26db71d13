#!/usr/bin/env bash
# A local Schema Registry: Apicurio Registry (Apache-2.0) from Maven Central, for the declared formats' tests and
# benchmarks (docs/formats.md). No Docker: Maven fetches the release's runnable layout, then we run it with Java.
#
#   scripts/schema-registry.sh start    # idempotent: reuses a running registry, or SCHEMA_REGISTRY_URL if set
#   scripts/schema-registry.sh stop     # SIGTERM
#   scripts/schema-registry.sh kill     # SIGKILL (the tests' "registry dies mid-drain")
#   scripts/schema-registry.sh status   # exit 1 unless it answers
#   scripts/schema-registry.sh url      # the Confluent-compatible API's base URL, e.g. http://127.0.0.1:18081/apis/ccompat/v7
#
# Apicurio 3.3.3 needs Java 21 or later: the script uses the first Java 21+ it finds (APICURIO_JAVA, `java` on the
# PATH, /usr/lib/jvm/*); with only Java 17 (what the Kafka broker needs) it runs 2.6.13.Final instead, which serves the
# same /apis/ccompat/v7. Schemas are kept in an H2 database file under the state directory, so a killed registry
# comes back with every schema id it had, as a production registry does.
#
# Environment: APICURIO_VERSION (chosen by Java, above), APICURIO_JAVA, REGISTRY_PORT (18081), REGISTRY_MANAGEMENT_PORT
# (18082), STOCK_LEDGER_CACHE (the download, ~160 MB, never committed), STOCK_LEDGER_STATE (data, logs).
set -euo pipefail

REGISTRY_PORT="${REGISTRY_PORT:-18081}"
REGISTRY_MANAGEMENT_PORT="${REGISTRY_MANAGEMENT_PORT:-18082}"
cache_root="${STOCK_LEDGER_CACHE:-$HOME/.cache/stock-ledger}"
state="${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}/registry"
pidfile="$state/registry.pid"
api="http://127.0.0.1:$REGISTRY_PORT/apis/ccompat/v7"

log() { printf '[registry] %s\n' "$*" >&2; }

running() { [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

answers() { curl -sf -m 2 "$api/schemas/types" >/dev/null 2>&1; }

java_major() { "$1" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1; }

# The first Java 21+ (for Apicurio 3), else the `java` on the PATH (17, for Apicurio 2).
find_java() {
  local candidate
  for candidate in "${APICURIO_JAVA:-}" "$(command -v java || true)" /usr/lib/jvm/*/bin/java; do
    [[ -n "$candidate" && -x "$candidate" ]] || continue
    if (( $(java_major "$candidate" || echo 0) >= 21 )); then echo "$candidate"; return; fi
  done
  command -v java || { log "java not found: install a JDK 17+ (apt-get install -y openjdk-17-jre-headless)"; exit 1; }
}

choose_version() {
  java="$(find_java)"
  if [[ -z "${APICURIO_VERSION:-}" ]]; then
    if (( $(java_major "$java") >= 21 )); then APICURIO_VERSION=3.3.3; else APICURIO_VERSION=2.6.13.Final; fi
  fi
  cache="$cache_root/apicurio-$APICURIO_VERSION"
}

fetch() {
  if [[ -f "$cache/.complete" ]]; then return; fi
  command -v mvn >/dev/null || { log "mvn not found: install Maven (apt-get install -y maven)"; exit 1; }
  log "fetching Apicurio Registry $APICURIO_VERSION from Maven Central into $cache (first run only, ~160 MB)"
  rm -rf "$cache" && mkdir -p "$cache"
  mvn -B -q -Dstyle.color=never dependency:copy \
    -Dartifact="io.apicurio:apicurio-registry-app:$APICURIO_VERSION:tar.gz:all" -DoutputDirectory="$cache"
  tar -xzf "$cache/apicurio-registry-app-$APICURIO_VERSION-all.tar.gz" -C "$cache"
  rm -f "$cache/apicurio-registry-app-$APICURIO_VERSION-all.tar.gz"
  touch "$cache/.complete"
}

start() {
  if [[ -n "${SCHEMA_REGISTRY_URL:-}" ]]; then
    log "SCHEMA_REGISTRY_URL=$SCHEMA_REGISTRY_URL is set: using it, not starting a local registry"; return
  fi
  if running && answers; then log "already running (pid $(cat "$pidfile")) at $api"; return; fi
  if ! running && answers; then log "something already answers at $api: reusing it"; return; fi
  choose_version
  fetch
  mkdir -p "$state/logs"
  local jar datasource
  jar="$(find "$cache" -maxdepth 3 \( -name quarkus-run.jar -o -name '*-runner.jar' \) | head -n1)"
  [[ -n "$jar" ]] || { log "no runnable jar in $cache: remove it and start again"; exit 1; }
  if [[ "$APICURIO_VERSION" == 2.* ]]; then datasource=registry.datasource.url; else datasource=apicurio.datasource.url; fi
  if ! running; then
    log "starting Apicurio Registry $APICURIO_VERSION ($java) at $api (logs: $state/logs)"
    # -XX:TieredStopAtLevel=1 and a small heap: a test registry on a shared 2-core machine starts faster so.
    (cd "$(dirname "$jar")" && exec "$java" -Xms64m -Xmx384m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
      -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$REGISTRY_PORT" \
      -Dquarkus.management.port="$REGISTRY_MANAGEMENT_PORT" -Dquarkus.management.host=127.0.0.1 \
      -D"$datasource"="jdbc:h2:file:$state/data/registry;DB_CLOSE_ON_EXIT=FALSE" \
      -Dquarkus.log.level=WARN -jar "$jar" >"$state/logs/registry.log" 2>&1 </dev/null) &
    echo $! >"$pidfile"
  fi
  for i in $(seq 1 240); do
    if answers; then log "ready after ${i}x0.5s"; return; fi
    if ! running; then log "the registry exited during start; last lines of its log:"; tail -n 30 "$state/logs/registry.log" >&2 || true; exit 1; fi
    sleep 0.5
  done
  log "the registry did not answer at $api within 120 s; see $state/logs/registry.log"; exit 1
}

signal_stop() {
  local sig="$1" pid
  if ! running; then log "not running"; rm -f "$pidfile"; return; fi
  pid="$(cat "$pidfile")"
  kill -"$sig" "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return; }; sleep 0.5; done
  log "the registry ignored SIG$sig for 30 s: SIGKILL"; kill -9 "$pid" 2>/dev/null || true; rm -f "$pidfile"
}

case "${1:-}" in
  start) start ;;
  stop) signal_stop TERM ;;
  kill) signal_stop KILL ;;
  status) if answers; then log "answers at $api"; else log "not answering at $api"; exit 1; fi ;;
  url) echo "${SCHEMA_REGISTRY_URL:-$api}" ;;
  *) echo "usage: $0 start|stop|kill|status|url" >&2; exit 2 ;;
esac
