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
#
# HA: an asynchronous streaming pair of its own (issue 30), beside the cluster above and on its own ports
# (STOCK_LEDGER_HA_PORTS, default 5441,5442), for the database-fault tests and for trying a failover by hand. Nodes
# `a` and `b` keep their ports; which one is the primary changes. Same roles, same TLS; the standby is made with
# `pg_basebackup -R` and replicates asynchronously as stock_ledger_replicator. DATABASE_URL does not apply here.
#
#   scripts/postgres.sh ha start       # idempotent: a primary and a standby streaming from it, both running; heals
#                                      # what a failover left (the lost node is re-made as a standby of the primary)
#   scripts/postgres.sh ha stop        # both nodes, fast shutdown
#   scripts/postgres.sh ha status      # one line per node (role, timeline, replication), then `pair: healthy`
#                                      # (exit 0) or `pair: degraded: <why>` (exit 1)
#   scripts/postgres.sh ha url | worker-url  # multi-host URLs: ...@127.0.0.1:5441,127.0.0.1:5442/stock_ledger
#                                      # ?target_session_attrs=read-write
#   scripts/postgres.sh ha switchover  # planned: stop the primary cleanly, wait until the standby has replayed its
#                                      # shutdown checkpoint, promote it, re-attach the old primary as its standby
#   scripts/postgres.sh ha cut         # the standby stops receiving WAL (its walreceiver points at port 1); the
#                                      # primary keeps committing what the standby will never see
#   scripts/postgres.sh ha failover --lossy [--hold SECONDS]  # cut, keep the primary running SECONDS (default 4)
#                                      # under whatever load runs, kill -9 it, promote the standby; the old primary
#                                      # is left stopped and marked diverged (`ha start` re-makes it as a standby)
#   scripts/postgres.sh ha rebuild     # drop both nodes, start a fresh pair
#
# switchover and failover print `primary=<node> port=<port>` on stdout (failover adds `lost_wal_bytes=<n>`, WAL the
# old primary wrote that the new one never received: at least that much, as commits continued until the kill).
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
    psql -X -q -v ON_ERROR_STOP=1 -h "${pg_socket_dir:-$state/run}" -p "$PGPORT" -d postgres "$@"
  fi
}

ready() {
  if as_root; then runuser -u postgres -- "$(pg_bin)/pg_isready" -q -p "$PGPORT" 2>/dev/null
  else "$(pg_bin)/pg_isready" -q -h "${pg_socket_dir:-$state/run}" -p "$PGPORT" 2>/dev/null; fi
}

# Sized for a ledger that grows (docs/performance.md): the unique indexes of tens of millions of movements
# stay in shared_buffers, and checkpoints are rare enough that a random movement_id leaf is not re-imaged in the WAL
# after every one. WAL segments are recycled, not created, under load: a new 16 MiB segment is zero-filled and
# synced by the backend that needs it, a 50-100 ms stall of that batch (docs/performance.md); min_wal_size keeps
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
    local cluster="${pg_cluster:-stockledger}"
    local etc="/etc/postgresql/$ver/$cluster"
    if cmp -s "$state/tls/server.crt" "$etc/tls/server.crt" && [[ -f "$etc/conf.d/stock-ledger-tls.conf" ]]; then
      return
    fi
    install -d -o postgres -g postgres -m 700 "$etc/tls"
    install -o postgres -g postgres -m 600 "$state/tls/server.key" "$etc/tls/server.key"
    install -o postgres -g postgres -m 644 "$state/tls/server.crt" "$etc/tls/server.crt"
    printf "ssl = on\nssl_cert_file = '%s'\nssl_key_file = '%s'\nssl_min_protocol_version = 'TLSv1.2'\n" \
      "$etc/tls/server.crt" "$etc/tls/server.key" >"$etc/conf.d/stock-ledger-tls.conf"
    pg_ctlcluster "$ver" "$cluster" reload
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

# ------------------------------------------------------------------------------------------ HA pair (issue 30)

IFS=, read -r HA_PORT_A HA_PORT_B <<<"${STOCK_LEDGER_HA_PORTS:-5441,5442}"
REPLICATOR=stock_ledger_replicator
REPLICATION_PASSWORD="${STOCK_LEDGER_REPLICATION_PASSWORD:-stock_ledger_replicator}"
ha_state="$state/ha"
# Small, fast nodes: tests create a database each and write a few thousand movements. wal_keep_size keeps enough WAL
# for a standby that was stopped or re-attached to catch up without a replication slot (a slot left behind by a
# dead standby would pin WAL forever).
HA_CONF=$'listen_addresses = \'127.0.0.1\'\nmax_connections = 200\nwal_level = replica\nmax_wal_senders = 10\nwal_keep_size = 512MB\nhot_standby = on\n'

pg_version() { basename "$(dirname "$(pg_bin)")"; }
ha_port() { if [[ "$1" == a ]]; then echo "$HA_PORT_A"; else echo "$HA_PORT_B"; fi; }
ha_other() { if [[ "$1" == a ]]; then echo b; else echo a; fi; }
ha_cluster() { echo "stockledger_ha_$1"; }
ha_datadir() {
  if as_root; then echo "/var/lib/postgresql/$(pg_version)/$(ha_cluster "$1")"; else echo "$ha_state/$1/data"; fi
}
ha_exists() { [[ -f "$(ha_datadir "$1")/PG_VERSION" ]]; }
ha_marker() { echo "$ha_state/$1.diverged"; }
ha_hosts() { echo "127.0.0.1:$HA_PORT_A,127.0.0.1:$HA_PORT_B"; }
ha_owner_url() {
  echo "postgresql://stock_ledger:$OWNER_PASSWORD@$(ha_hosts)/stock_ledger?target_session_attrs=read-write"
}
ha_worker_url() {
  echo "postgresql://stock_ledger_worker:$WORKER_PASSWORD@$(ha_hosts)/stock_ledger?target_session_attrs=read-write"
}

# Runs "$@" with the existing helpers (psql_admin, ready, ensure_roles, ensure_tls) pointed at one node.
on_node() {
  local node="$1"; shift
  local PGPORT pg_cluster pg_socket_dir
  PGPORT="$(ha_port "$node")"; pg_cluster="$(ha_cluster "$node")"; pg_socket_dir="$ha_state/$node/run"
  "$@"
}
ha_sql() { local node="$1"; shift; on_node "$node" psql_admin -tA "$@"; }
as_pg() { if as_root; then runuser -u postgres -- "$@"; else "$@"; fi; }

# primary | standby | stopped | diverged (killed in a lossy failover) | absent
ha_role() {
  if ! ha_exists "$1"; then echo absent; return; fi
  if ! on_node "$1" ready; then
    if [[ -f "$(ha_marker "$1")" ]]; then echo diverged; else echo stopped; fi
    return
  fi
  case "$(ha_sql "$1" -c 'SELECT pg_is_in_recovery()' 2>/dev/null)" in
    t) echo standby ;; f) echo primary ;; *) echo stopped ;;
  esac
}

# The running primary, or nothing.
ha_primary() {
  local n
  for n in a b; do if [[ "$(ha_role "$n")" == primary ]]; then echo "$n"; return; fi; done
}

ha_options() {
  local n="$1"
  printf -- '-p %s -k %s -c cluster_name=%s -c ssl=on -c ssl_cert_file=%s -c ssl_key_file=%s %s' \
    "$(ha_port "$n")" "$ha_state/$n/run" "$(ha_cluster "$n")" "$state/tls/server.crt" "$state/tls/server.key" \
    "$(sed -E "s/^([a-z_]+) = '?([^']*)'?$/-c \1=\2/" <<<"$HA_CONF" | tr '\n' ' ')"
}

ha_wait_ready() {
  local _
  for _ in $(seq 1 60); do on_node "$1" ready && return; sleep 0.5; done
  log "node $1 (port $(ha_port "$1")) did not accept connections within 30 s: see its log" \
    "($(if as_root; then echo "/var/log/postgresql/postgresql-$(pg_version)-$(ha_cluster "$1").log"; else echo "$ha_state/$1/postgres.log"; fi))"
  exit 1
}

ha_start_node() {
  local n="$1"
  log "starting node $n on port $(ha_port "$n")"
  if as_root; then
    pg_ctlcluster "$(pg_version)" "$(ha_cluster "$n")" start
  else
    mkdir -p "$ha_state/$n/run"
    "$(pg_bin)/pg_ctl" -D "$(ha_datadir "$n")" -l "$ha_state/$n/postgres.log" -w -o "$(ha_options "$n")" start >/dev/null
  fi
  ha_wait_ready "$n"
  if as_root; then on_node "$n" ensure_tls; fi
}

ha_stop_node() {
  local n="$1"
  if ! on_node "$n" ready; then return; fi
  log "stopping node $n (fast shutdown: open transactions abort, sessions end)"
  if as_root; then pg_ctlcluster "$(pg_version)" "$(ha_cluster "$n")" stop -m fast
  else "$(pg_bin)/pg_ctl" -D "$(ha_datadir "$n")" -m fast -w stop >/dev/null; fi
}

ha_drop_node() {
  local n="$1"
  if as_root; then
    if pg_lsclusters -h 2>/dev/null | awk -v c="$(ha_cluster "$n")" '$2 == c' | grep -q .; then
      log "dropping node $n ($(pg_version)/$(ha_cluster "$n"))"
      pg_dropcluster --stop "$(pg_version)" "$(ha_cluster "$n")"
    fi
  elif ha_exists "$n"; then
    log "dropping node $n ($ha_state/$n)"
    "$(pg_bin)/pg_ctl" -D "$(ha_datadir "$n")" -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "${ha_state:?}/$n"
  fi
  rm -f "$(ha_marker "$n")"
}

ha_create_primary() {
  local n="$1"
  log "creating node $n as the primary, on port $(ha_port "$n")"
  if as_root; then
    local ver; ver="$(pg_version)"
    pg_createcluster "$ver" "$(ha_cluster "$n")" --port "$(ha_port "$n")" -- \
      --auth-local=peer --auth-host=scram-sha-256 >/dev/null
    printf '%s' "$HA_CONF" >"/etc/postgresql/$ver/$(ha_cluster "$n")/conf.d/stock-ledger-ha.conf"
  else
    mkdir -p "$ha_state/$n/run"
    "$(pg_bin)/initdb" -D "$(ha_datadir "$n")" -A trust -U "$(id -un)" >/dev/null
  fi
  ha_start_node "$n"
  ha_ensure_primary_roles "$n"
}

ha_ensure_primary_roles() {
  local password="${REPLICATION_PASSWORD//\'/\'\'}"
  on_node "$1" ensure_roles
  ha_sql "$1" <<SQL
SET client_min_messages = warning;
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$REPLICATOR') THEN
    CREATE ROLE $REPLICATOR LOGIN REPLICATION;
  END IF;
END \$\$;
ALTER ROLE $REPLICATOR PASSWORD '$password';
SQL
}

# How standby $2 reaches primary $1; application_name names the standby in pg_stat_replication.
ha_conninfo() {
  echo "host=127.0.0.1 port=$(ha_port "$1") user=$REPLICATOR password=$REPLICATION_PASSWORD application_name=$(ha_cluster "$2")"
}

# Node $1, dropped if it exists, re-made as a standby of the running primary $2 (pg_basebackup -R).
ha_make_standby() {
  local s="$1" p="$2" dir
  ha_drop_node "$s"
  dir="$(ha_datadir "$s")"
  log "making node $s a standby of node $p (pg_basebackup -R from port $(ha_port "$p"))"
  if as_root; then
    # Debian's configuration around the cluster (/etc/postgresql/...), then its data directory replaced by the copy
    # (pg_createcluster adopts an existing directory only if it holds its own postgresql.conf).
    local ver; ver="$(pg_version)"
    pg_createcluster "$ver" "$(ha_cluster "$s")" --port "$(ha_port "$s")" -- \
      --auth-local=peer --auth-host=scram-sha-256 >/dev/null
    printf '%s' "$HA_CONF" >"/etc/postgresql/$ver/$(ha_cluster "$s")/conf.d/stock-ledger-ha.conf"
    find "$dir" -mindepth 1 -delete
  else
    mkdir -p "$dir" "$ha_state/$s/run"; chmod 700 "$dir"
  fi
  as_pg env PGPASSWORD="$REPLICATION_PASSWORD" "$(pg_bin)/pg_basebackup" -d "$(ha_conninfo "$p" "$s")" -D "$dir" \
    -R -X stream --checkpoint=fast
  ha_start_node "$s"
}

# Points standby $1 at primary $2 (a reload applies primary_conninfo) and waits until it streams from it.
ha_follow() {
  local s="$1" p="$2" conninfo
  conninfo="$(ha_conninfo "$p" "$s")"
  ha_sql "$s" -c "ALTER SYSTEM SET primary_conninfo = '${conninfo//\'/\'\'}'" -c 'SELECT pg_reload_conf()' >/dev/null
  ha_wait_streaming "$s" "$p" 20
}

ha_streaming() {
  [[ "$(ha_sql "$2" -c "SELECT count(*) FROM pg_stat_replication
    WHERE application_name = '$(ha_cluster "$1")' AND state = 'streaming'" 2>/dev/null)" == 1 ]]
}

ha_wait_streaming() {
  local s="$1" p="$2" within="$3" i
  for (( i = 0; i < within * 4; i++ )); do
    if ha_streaming "$s" "$p"; then return 0; fi
    sleep 0.25
  done
  return 1
}

ha_start() {
  ensure_installed
  ca_issue "$state/tls" server "IP:127.0.0.1"
  mkdir -p "$ha_state"
  if ! ha_exists a && ! ha_exists b; then ha_create_primary a; fi
  local p s n
  p="$(ha_primary)"
  if [[ -z "$p" ]]; then
    # No primary runs: start the one node that is not a standby and not diverged (never two).
    local candidates=()
    for n in a b; do
      if [[ "$(ha_role "$n")" == stopped && ! -f "$(ha_datadir "$n")/standby.signal" ]]; then candidates+=("$n"); fi
    done
    if (( ${#candidates[@]} == 1 )); then
      p="${candidates[0]}"; ha_start_node "$p"
    elif (( ${#candidates[@]} == 2 )); then
      log "both nodes were primaries (timelines diverged): 'scripts/postgres.sh ha rebuild' makes a fresh pair"; exit 1
    else
      log "no node can be the primary (only standbys or diverged nodes): 'scripts/postgres.sh ha rebuild'" \
        "makes a fresh pair (or promote a standby by hand: pg_ctlcluster $(pg_version) <cluster> promote)"
      exit 1
    fi
  fi
  s="$(ha_other "$p")"
  ha_ensure_primary_roles "$p"
  case "$(ha_role "$s")" in
    primary)
      log "both nodes run as primaries (split brain): 'scripts/postgres.sh ha rebuild' makes a fresh pair"; exit 1 ;;
    standby) ;;
    stopped)
      # A stopped node without standby.signal is an old primary: starting it would make a second primary.
      if [[ -f "$(ha_datadir "$s")/standby.signal" ]]; then ha_start_node "$s"; else ha_make_standby "$s" "$p"; fi ;;
    absent | diverged) ha_make_standby "$s" "$p" ;;
  esac
  if ! ha_streaming "$s" "$p" && ! ha_follow "$s" "$p"; then
    log "node $s cannot follow node $p (a timeline it cannot replay): re-making it from node $p"
    ha_make_standby "$s" "$p"
    ha_wait_streaming "$s" "$p" 30 || { log "node $s does not stream from node $p: see both logs"; exit 1; }
  fi
  log "pair ready: node $p (port $(ha_port "$p")) primary, node $s (port $(ha_port "$s")) streaming from it;" \
    "$(ha_owner_url | sed 's/:[^:@]*@/:***@/')"
}

ha_stop() {
  local n
  for n in a b; do if ha_exists "$n"; then ha_stop_node "$n"; fi; done
}

ha_status() {
  local n role problem="" p=""
  for n in a b; do
    role="$(ha_role "$n")"
    case "$role" in
      primary)
        p="$n"
        echo "$n $(ha_port "$n") primary $(ha_sql "$n" -c "SELECT 'timeline ' || timeline_id FROM pg_control_checkpoint()")," \
          "standbys streaming: $(ha_sql "$n" -c "SELECT coalesce(string_agg(application_name || ' (' || sync_state || ')', ', '), 'none')
            FROM pg_stat_replication WHERE state = 'streaming'")" ;;
      standby)
        echo "$n $(ha_port "$n") standby $(ha_sql "$n" -c "SELECT coalesce((SELECT 'streaming from port ' || sender_port
            FROM pg_stat_wal_receiver WHERE status = 'streaming'), 'not receiving WAL') || ', replayed up to ' ||
            coalesce(pg_last_wal_replay_lsn()::text, '-')")" ;;
      *) echo "$n $(ha_port "$n") $role" ;;
    esac
  done
  if [[ -z "$p" ]]; then problem="no primary runs"
  elif ! ha_streaming "$(ha_other "$p")" "$p"; then problem="node $(ha_other "$p") does not stream from the primary"
  fi
  if [[ -n "$problem" ]]; then echo "pair: degraded: $problem ('scripts/postgres.sh ha start' heals it)"; return 1; fi
  echo "pair: healthy"
}

# The running primary and standby, or an error saying what to do.
ha_pair() {
  local p s
  p="$(ha_primary)"
  if [[ -z "$p" ]]; then log "no primary runs: 'scripts/postgres.sh ha start' first"; exit 1; fi
  s="$(ha_other "$p")"
  if [[ "$(ha_role "$s")" != standby ]]; then
    log "node $s is not a running standby: 'scripts/postgres.sh ha start' first"; exit 1
  fi
  echo "$p $s"
}

ha_cut() {
  local p s i
  read -r p s < <(ha_pair)
  log "cutting replication: node $s's walreceiver now points at port 1, node $p (primary) keeps committing"
  ha_sql "$s" -c "ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=1 application_name=$(ha_cluster "$s")'" \
    -c 'SELECT pg_reload_conf()' >/dev/null
  # Until the walsender is gone, WAL still flows: the cut is only done when the primary no longer sees the standby.
  for (( i = 0; i < 80; i++ )); do
    if [[ "$(ha_sql "$p" -c "SELECT count(*) FROM pg_stat_replication
          WHERE application_name = '$(ha_cluster "$s")'")" == 0 ]]; then
      log "replication cut: node $s receives no WAL; commits on node $p from now on exist only there"
      return
    fi
    sleep 0.25
  done
  log "node $p still has a walsender for node $s after 20 s: the cut did not take; 'scripts/postgres.sh ha rebuild'"
  exit 1
}

ha_failover() {
  local lossy="" hold=4
  while (( $# )); do
    case "$1" in
      --lossy) lossy=1 ;;
      --hold) hold="${2:?--hold needs a number of seconds}"; shift ;;
      *) log "unknown option $1: ha failover --lossy [--hold SECONDS]"; exit 2 ;;
    esac
    shift
  done
  if [[ -z "$lossy" ]]; then
    log "only 'ha failover --lossy' exists (a failover that loses commits on purpose); 'ha switchover' loses none"
    exit 2
  fi
  local p s pid lsn_p lsn_s lost
  read -r p s < <(ha_pair)
  ha_cut
  log "holding node $p as primary for $hold s: what commits there now, the standby never sees"
  sleep "$hold"
  lsn_p="$(ha_sql "$p" -c 'SELECT pg_current_wal_lsn()')"
  lsn_s="$(ha_sql "$s" -c 'SELECT coalesce(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())')"
  pid="$(head -n 1 "$(ha_datadir "$p")/postmaster.pid")"
  log "kill -9 node $p (postmaster $pid and its children)"
  touch "$(ha_marker "$p")"
  # The postmaster and every backend at once, as a lost machine: no shutdown checkpoint, no last WAL sent.
  # shellcheck disable=SC2046 # one PID per word
  kill -9 "$pid" $(pgrep -P "$pid") 2>/dev/null || true
  while on_node "$p" ready; do sleep 0.1; done
  ha_promote "$s"
  lost="$(ha_sql "$s" -c "SELECT pg_wal_lsn_diff('$lsn_p', '$lsn_s')")"
  log "failover done: node $s (port $(ha_port "$s")) is the primary; at least $lost bytes of WAL from node $p" \
    "are lost; node $p is left stopped (diverged): 'scripts/postgres.sh ha start' re-makes it as a standby"
  echo "primary=$s port=$(ha_port "$s") lost_wal_bytes=$lost"
}

ha_promote() {
  local n="$1" i
  log "promoting node $n"
  if as_root; then pg_ctlcluster "$(pg_version)" "$(ha_cluster "$n")" promote
  else "$(pg_bin)/pg_ctl" -D "$(ha_datadir "$n")" -w promote >/dev/null; fi
  for (( i = 0; i < 120; i++ )); do
    if [[ "$(ha_sql "$n" -c 'SELECT pg_is_in_recovery()')" == f ]]; then
      # A primary follows nobody; a later basebackup from it must not inherit a conninfo.
      ha_sql "$n" -c 'ALTER SYSTEM RESET primary_conninfo' -c 'SELECT pg_reload_conf()' >/dev/null
      return
    fi
    sleep 0.25
  done
  log "node $n is still in recovery 30 s after promote: see its log"; exit 1
}

ha_switchover() {
  local p s checkpoint i
  read -r p s < <(ha_pair)
  if ! ha_streaming "$s" "$p"; then
    log "node $s does not stream from node $p: a switchover now would lose commits; 'scripts/postgres.sh ha start' first"
    exit 1
  fi
  # A clean shutdown ends with a checkpoint record that the walsender still sends to the standby.
  ha_stop_node "$p"
  checkpoint="$(as_pg "$(pg_bin)/pg_controldata" -D "$(ha_datadir "$p")" | sed -n 's/^Latest checkpoint location: *//p')"
  log "node $p stopped at its shutdown checkpoint $checkpoint; waiting until node $s has replayed it"
  for (( i = 0; ; i++ )); do
    if [[ "$(ha_sql "$s" -c "SELECT pg_last_wal_replay_lsn() > '$checkpoint'")" == t ]]; then break; fi
    if (( i >= 60 )); then
      log "node $s did not replay node $p's shutdown checkpoint within 15 s: not promoting it;" \
        "'scripts/postgres.sh ha start' starts node $p again as the primary"
      exit 1
    fi
    sleep 0.25
  done
  ha_promote "$s"
  log "re-attaching node $p as a standby of node $s"
  as_pg touch "$(ha_datadir "$p")/standby.signal"
  ha_start_node "$p"
  if ! ha_follow "$p" "$s"; then
    log "node $p cannot follow node $s: re-making it from node $s"
    ha_make_standby "$p" "$s"
    ha_wait_streaming "$p" "$s" 30 || { log "node $p does not stream from node $s: see both logs"; exit 1; }
  fi
  log "switchover done: node $s (port $(ha_port "$s")) is the primary, node $p streams from it"
  echo "primary=$s port=$(ha_port "$s")"
}

ha_rebuild() {
  ensure_installed
  ha_drop_node a
  ha_drop_node b
  ha_start
}

ha() {
  case "${1:-}" in
    start) ha_start ;;
    stop) ha_stop ;;
    status) ha_status ;;
    url) ha_owner_url ;;
    worker-url) ha_worker_url ;;
    switchover) ha_switchover ;;
    cut) ha_cut ;;
    failover) shift; ha_failover "$@" ;;
    rebuild) ha_rebuild ;;
    *) echo "usage: $0 ha start|stop|status|url|worker-url|switchover|cut|failover --lossy [--hold SECONDS]|rebuild" >&2
       exit 2 ;;
  esac
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
  ha) shift; ha "$@" ;;
  *) echo "usage: $0 start|stop|restart|status|url|worker-url|verify-full-url|ha ..." >&2; exit 2 ;;
esac
