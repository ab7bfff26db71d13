#!/usr/bin/env bash
# A local PostgreSQL for development and tests, from Debian's packages (installed if missing).
#
#   scripts/postgres.sh start     # idempotent: reuses a running cluster, or DATABASE_URL if set
#   scripts/postgres.sh stop | restart | status
#   scripts/postgres.sh prime-wal  # recycled WAL segments up to min_wal_size, as after a checkpoint cycle at load
#   scripts/postgres.sh url        # prints the owner's DATABASE_URL
#   scripts/postgres.sh worker-url # prints the least-privileged worker's DATABASE_URL
#   scripts/postgres.sh verify-full-url # the worker's URL with sslmode=verify-full and the local CA as sslrootcert
#
# TLS: the server presents a certificate for 127.0.0.1 issued by the local CA of scripts/ca.sh (shared with
# scripts/kafka.sh), applied with a reload on every start (ssl settings need no restart); re-issued only if the
# CA changed.
#
# Roles created (idempotent):
#   stock_ledger         owner of database stock_ledger; runs migrations; CREATEDB/CREATEROLE for tests
#   stock_ledger_app     NOLOGIN group role; migrations grant it exactly what the worker needs
#   stock_ledger_worker  LOGIN, member of stock_ledger_app: what `stock-ledger run` connects as
set -euo pipefail

PGPORT="${PGPORT:-5432}"
OWNER_PASSWORD="${STOCK_LEDGER_DB_PASSWORD:-stock_ledger}"
WORKER_PASSWORD="${STOCK_LEDGER_WORKER_PASSWORD:-stock_ledger_worker}"
state="${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}/postgres"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/ca.sh
source "$here/ca.sh"

log() { printf '[postgres] %s\n' "$*" >&2; }

owner_url() { echo "postgresql://stock_ledger:$OWNER_PASSWORD@127.0.0.1:$PGPORT/stock_ledger"; }
worker_url() { echo "postgresql://stock_ledger_worker:$WORKER_PASSWORD@127.0.0.1:$PGPORT/stock_ledger"; }
verify_full_url() { echo "$(worker_url)?sslmode=verify-full&sslrootcert=$ca_dir/ca.crt"; }

pg_bin() {
  local v
  v="$(ls /usr/lib/postgresql 2>/dev/null | sort -V | tail -n 1)"
  [[ -n "$v" ]] && echo "/usr/lib/postgresql/$v/bin"
}

ensure_installed() {
  if [[ -n "$(pg_bin)" ]]; then return; fi
  if [[ "$(id -u)" != 0 ]]; then
    log "PostgreSQL is not installed and this is not root: run 'sudo apt-get install -y postgresql' or set DATABASE_URL"
    exit 1
  fi
  log "installing Debian's postgresql package (first run only)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq postgresql >/dev/null
}

# As root we use a Debian-managed cluster (run as the postgres user); as anyone else, a private cluster in $state.
as_root() { [[ "$(id -u)" == 0 ]]; }

psql_admin() {
  if as_root; then
    runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -p "$PGPORT" -d postgres "$@"
  else
    psql -X -q -v ON_ERROR_STOP=1 -h "$state/run" -p "$PGPORT" -d postgres "$@"
  fi
}

ready() {
  if as_root; then runuser -u postgres -- "$(pg_bin)/pg_isready" -q -p "$PGPORT" 2>/dev/null
  else "$(pg_bin)/pg_isready" -q -h "$state/run" -p "$PGPORT" 2>/dev/null; fi
}

# Sized for a ledger that grows (README, "As the ledger grows"): the unique indexes of tens of millions of movements
# stay in shared_buffers, and checkpoints are rare enough that a random movement_id leaf is not re-imaged in the WAL
# after every one. WAL segments are recycled, not created, under load: a new 16 MiB segment is zero-filled and
# synced by the backend that needs it, a 50-100 ms stall of that batch (README, "30-minute soak"); min_wal_size keeps
# a checkpoint cycle's worth (plus the cycle a spread checkpoint overlaps) for reuse, and max_wal_size is above it so
# checkpoints stay timed. fsync stays on: durability is what we test. Needs a restart to take effect.
SIZING=$'shared_buffers = 2GB\nmin_wal_size = 8GB\nmax_wal_size = 16GB\ncheckpoint_timeout = 15min\nwal_compression = lz4\n'

start_cluster() {
  if as_root; then
    local ver; ver="$(basename "$(dirname "$(pg_bin)")")"
    if ! pg_lsclusters -h 2>/dev/null | awk '{print $2}' | grep -qx stockledger; then
      log "creating Debian cluster $ver/stockledger on port $PGPORT"
      pg_createcluster "$ver" stockledger --port "$PGPORT" -- --auth-local=peer --auth-host=scram-sha-256 >/dev/null
      # Enough connections for several workers plus tests.
      printf "max_connections = 300\nlisten_addresses = '127.0.0.1'\n" \
        >"/etc/postgresql/$ver/stockledger/conf.d/stock-ledger.conf"
    fi
    printf '%s' "$SIZING" >"/etc/postgresql/$ver/stockledger/conf.d/stock-ledger-sizing.conf"
    log "starting cluster $ver/stockledger"
    pg_ctlcluster "$ver" stockledger start
  else
    if [[ ! -f "$state/data/PG_VERSION" ]]; then
      log "initialising a private cluster in $state/data"
      mkdir -p "$state/run"
      "$(pg_bin)/initdb" -D "$state/data" -A trust -U "$(id -un)" >/dev/null
    fi
    log "starting private cluster on 127.0.0.1:$PGPORT"
    "$(pg_bin)/pg_ctl" -D "$state/data" -l "$state/postgres.log" -w \
      -o "-p $PGPORT -k $state/run -c listen_addresses=127.0.0.1 -c max_connections=300 $(sizing_options)" \
      start >/dev/null
  fi
  for _ in $(seq 1 60); do ready && return; sleep 0.5; done
  log "PostgreSQL did not become ready within 30 s"; exit 1
}

sizing_options() { sed -E 's/^([a-z_]+) = (.*)$/-c \1=\2/' <<<"$SIZING" | tr '\n' ' '; }

# A cluster started before the sizing existed keeps running as it is (others may be using it): say how to apply it.
check_sizing() {
  local want now
  want="$(sed -nE 's/^(shared_buffers|min_wal_size) = (.*)$/\2/p' <<<"$SIZING" | paste -sd ' ')"
  now="$(psql_admin -tAc "SELECT current_setting('shared_buffers') || ' ' || current_setting('min_wal_size')" \
    2>/dev/null || true)"
  if [[ -n "$now" && "$now" != "$want" ]]; then
    log "note: running with shared_buffers and min_wal_size $now, not the scripts' sizing ($want);" \
      "'scripts/postgres.sh restart' applies it"
  fi
}

# A cluster that has run a checkpoint cycle at load holds min_wal_size of recycled WAL segments; a new or restarted
# one creates (zero-fills, syncs) a segment every few seconds until its first checkpoints end. A soak measures the
# steady state, so it starts here: switch through min_wal_size of segments (no data written), then a checkpoint
# recycles them for reuse. Idempotent; about 50 s for 8 GB (514 segments) from a near-empty pool on this machine kind.
prime_wal() {
  if [[ -n "${DATABASE_URL:-}" ]]; then
    log "DATABASE_URL is set: its server is not ours to prime; run this where scripts/postgres.sh started PostgreSQL"
    exit 2
  fi
  ready || { log "PostgreSQL is not running: 'scripts/postgres.sh start' first"; exit 1; }
  local want seg have
  read -r want seg < <(psql_admin -tAc "SELECT pg_size_bytes(current_setting('min_wal_size')) || ' ' ||
    pg_size_bytes(current_setting('wal_segment_size'))")
  have="$(wal_pool_bytes)"
  if (( have + 2 * seg < want )); then
    local n=$(( want / seg + 2 )) i
    log "priming the WAL pool: $((have >> 20)) of $((want >> 20)) MiB recycled; switching through $n segments"
    for (( i = 1; i <= n; i++ )); do
      echo "SELECT pg_logical_emit_message(false, 'stock-ledger-prime-wal', ''); SELECT pg_switch_wal();"
      if (( i % 64 == 0 )); then echo "\\warn '[postgres] $i of $n segments'"; fi
    done | psql_admin -tA >/dev/null
    psql_admin -c CHECKPOINT
    have="$(wal_pool_bytes)"
  fi
  log "WAL pool primed: $((have >> 20)) MiB of recycled segments (min_wal_size $((want >> 20)) MiB)"
}

# Bytes of the WAL segments after the one being written: recycled, waiting for reuse.
wal_pool_bytes() {
  psql_admin -tAc "SELECT coalesce(sum(size), 0) FROM pg_ls_waldir()
    WHERE name ~ '^[0-9A-F]{24}$' AND name > pg_walfile_name(pg_current_wal_lsn())"
}

ensure_roles() {
  psql_admin <<SQL
SET client_min_messages = warning;
DO \$\$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'stock_ledger') THEN
    CREATE ROLE stock_ledger LOGIN CREATEDB CREATEROLE;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'stock_ledger_app') THEN
    CREATE ROLE stock_ledger_app NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'stock_ledger_worker') THEN
    CREATE ROLE stock_ledger_worker LOGIN;
  END IF;
END
\$\$;
ALTER ROLE stock_ledger PASSWORD '$OWNER_PASSWORD';
ALTER ROLE stock_ledger_worker PASSWORD '$WORKER_PASSWORD';
GRANT stock_ledger_app TO stock_ledger_worker;
GRANT stock_ledger_app TO stock_ledger WITH ADMIN OPTION;
-- Tests terminate worker sessions (pg_terminate_backend) to prove the retry path.
GRANT pg_signal_backend TO stock_ledger;
-- Tests read pg_stat_ssl of worker sessions to prove they run over TLS.
GRANT pg_read_all_stats TO stock_ledger;
SQL
  if ! psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = 'stock_ledger'" | grep -q 1; then
    psql_admin -c "CREATE DATABASE stock_ledger OWNER stock_ledger"
  fi
}

# The server certificate from the local CA. As root the Debian cluster reads it from /etc/postgresql (the postgres
# user cannot read root's state dir) through a conf.d file; a private cluster gets it with ALTER SYSTEM. Either
# way a reload applies it: the running cluster is never restarted.
ensure_tls() {
  ca_issue "$state/tls" server "IP:127.0.0.1"
  if as_root; then
    local ver; ver="$(basename "$(dirname "$(pg_bin)")")"
    local etc="/etc/postgresql/$ver/stockledger"
    if cmp -s "$state/tls/server.crt" "$etc/tls/server.crt" && [[ -f "$etc/conf.d/stock-ledger-tls.conf" ]]; then
      return
    fi
    install -d -o postgres -g postgres -m 700 "$etc/tls"
    install -o postgres -g postgres -m 600 "$state/tls/server.key" "$etc/tls/server.key"
    install -o postgres -g postgres -m 644 "$state/tls/server.crt" "$etc/tls/server.crt"
    printf "ssl = on\nssl_cert_file = '%s'\nssl_key_file = '%s'\nssl_min_protocol_version = 'TLSv1.2'\n" \
      "$etc/tls/server.crt" "$etc/tls/server.key" >"$etc/conf.d/stock-ledger-tls.conf"
    pg_ctlcluster "$ver" stockledger reload
  else
    psql_admin <<SQL
ALTER SYSTEM SET ssl = on;
ALTER SYSTEM SET ssl_cert_file = '$state/tls/server.crt';
ALTER SYSTEM SET ssl_key_file = '$state/tls/server.key';
SELECT pg_reload_conf();
SQL
  fi
  log "TLS on with a certificate for 127.0.0.1 from $ca_dir/ca.crt"
}

start() {
  if [[ -n "${DATABASE_URL:-}" ]]; then
    log "DATABASE_URL is set: using it, not starting a local PostgreSQL"
    return
  fi
  ensure_installed
  if ready; then log "already running on port $PGPORT"; check_sizing; else start_cluster; fi
  ensure_roles
  ensure_tls
  log "ready: $(owner_url | sed 's/:[^:@]*@/:***@/')"
}

stop() {
  if as_root; then
    local ver; ver="$(basename "$(dirname "$(pg_bin)")")"
    pg_ctlcluster "$ver" stockledger stop -m fast 2>/dev/null || log "not running"
  else
    "$(pg_bin)/pg_ctl" -D "$state/data" -m fast stop >/dev/null 2>&1 || log "not running"
  fi
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  prime-wal) prime_wal ;;
  status) if ready; then echo running; else echo stopped; exit 1; fi ;;
  url) owner_url ;;
  worker-url) worker_url ;;
  verify-full-url) verify_full_url ;;
  *) echo "usage: $0 start|stop|restart|status|url|worker-url|verify-full-url" >&2; exit 2 ;;
esac
