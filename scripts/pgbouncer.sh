#!/usr/bin/env bash
# PgBouncer (Debian's package, installed if missing) in front of scripts/postgres.sh's PostgreSQL, with PgBouncer's
# default configuration apart from where it listens, where it finds the users and the pool mode asked for.
#
#   scripts/pgbouncer.sh start [--mode session|transaction|statement]   # idempotent; session is the default
#   scripts/pgbouncer.sh stop | status [--mode ...]
#   scripts/pgbouncer.sh url [--mode ...]        # the owner's DATABASE_URL through the pooler
#   scripts/pgbouncer.sh worker-url [--mode ...] # the least-privileged worker's DATABASE_URL through the pooler
#
# One pooler per mode, each on its own port on 127.0.0.1 only (no Unix socket): session 6432 (PgBouncer's own
# default), transaction 6433, statement 6434; PGBOUNCER_PORT overrides the mode's port. Every database name is
# forwarded (`* =`), so the tests' scratch databases are reachable too. Users stock_ledger and stock_ledger_worker
# are authenticated from an auth_file with their passwords (the same as scripts/postgres.sh sets, from the same
# variables), which PgBouncer also logs in to PostgreSQL with (SCRAM, as pg_hba.conf asks). Why not the SCRAM secrets
# from pg_authid: PgBouncer can log in with a client's SCRAM proof only while the auth_file holds the server's exact
# secret, and every `ALTER ROLE ... PASSWORD` (the test fixtures run one per session) makes a new salt, after which
# every new server connection fails ("password authentication failed"; seen here, and a reload did not clear it: a
# restart did). The file is readable by its owner only.
# PgBouncer refuses to run as root: as root it runs as the postgres user, its files in /var/lib/postgresql.
set -euo pipefail

PGPORT="${PGPORT:-5432}"
OWNER_PASSWORD="${STOCK_LEDGER_DB_PASSWORD:-stock_ledger}"
WORKER_PASSWORD="${STOCK_LEDGER_WORKER_PASSWORD:-stock_ledger_worker}"

log() { printf '[pgbouncer] %s\n' "$*" >&2; }
as_root() { [[ "$(id -u)" == 0 ]]; }

mode=session
action="${1:-start}"
shift || true
while (($#)); do
  case "$1" in
    --mode) mode="${2:-}"; shift 2 || { log "--mode needs a value"; exit 2; } ;;
    --mode=*) mode="${1#--mode=}"; shift ;;
    *) log "unknown argument: $1"; exit 2 ;;
  esac
done
case "$mode" in
  session) default_port=6432 ;;
  transaction) default_port=6433 ;;
  statement) default_port=6434 ;;
  *) log "--mode must be session, transaction or statement (got '$mode')"; exit 2 ;;
esac
port="${PGBOUNCER_PORT:-$default_port}"
if as_root; then
  dir="/var/lib/postgresql/stock-ledger-pgbouncer/$mode"
else
  dir="${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}/pgbouncer/$mode"
fi

owner_url() { echo "postgresql://stock_ledger:$OWNER_PASSWORD@127.0.0.1:$port/stock_ledger"; }
worker_url() { echo "postgresql://stock_ledger_worker:$WORKER_PASSWORD@127.0.0.1:$port/stock_ledger"; }

ensure_installed() {
  if command -v pgbouncer >/dev/null; then return; fi
  if ! as_root; then
    log "PgBouncer is not installed and this is not root: run 'sudo apt-get install -y pgbouncer'"
    exit 1
  fi
  log "installing Debian's pgbouncer package (first run only)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq pgbouncer >/dev/null
}

# As the user PgBouncer runs as: postgres when we are root, else ourselves.
as_owner() { if as_root; then runuser -u postgres -- "$@"; else "$@"; fi; }

pid() { [[ -f "$dir/pgbouncer.pid" ]] && cat "$dir/pgbouncer.pid"; }
running() { local p; p="$(pid 2>/dev/null)" && [[ -n "$p" ]] && kill -0 "$p" 2>/dev/null; }
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }

write_config() {
  as_owner mkdir -p "$dir"
  chmod 700 "$dir"
  printf '"stock_ledger" "%s"\n"stock_ledger_worker" "%s"\n' "$OWNER_PASSWORD" "$WORKER_PASSWORD" \
    | as_owner tee "$dir/userlist.txt.new" >/dev/null
  chmod 600 "$dir/userlist.txt.new"
  as_owner mv "$dir/userlist.txt.new" "$dir/userlist.txt"
  # Everything not named here is PgBouncer's default: the point is that the defaults work.
  as_owner tee "$dir/pgbouncer.ini" >/dev/null <<INI
[databases]
* = host=127.0.0.1 port=$PGPORT

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_file = $dir/userlist.txt
pidfile = $dir/pgbouncer.pid
logfile = $dir/pgbouncer.log
pool_mode = $mode
INI
}

start() {
  ensure_installed
  if ! (exec 3<>"/dev/tcp/127.0.0.1/$PGPORT") 2>/dev/null; then
    log "PostgreSQL is not listening on 127.0.0.1:$PGPORT: run scripts/postgres.sh start first"
    exit 1
  fi
  write_config
  if running; then
    kill -HUP "$(pid)"  # re-reads the configuration and the auth_file
    log "already running ($mode mode) on 127.0.0.1:$port; configuration reloaded"
    return
  fi
  if listening; then
    log "port $port is taken by another process: set PGBOUNCER_PORT"
    exit 1
  fi
  log "starting PgBouncer ($mode mode) on 127.0.0.1:$port"
  as_owner pgbouncer -d -q "$dir/pgbouncer.ini"
  for _ in $(seq 1 50); do
    if listening; then log "ready: $(owner_url | sed 's/:[^:@]*@/:***@/')"; return; fi
    sleep 0.1
  done
  log "PgBouncer did not listen on 127.0.0.1:$port within 5 s; see $dir/pgbouncer.log"
  exit 1
}

stop() {
  if ! running; then log "not running ($mode mode)"; return; fi
  local p; p="$(pid)"
  kill -INT "$p"  # SIGINT: shut down at once (SIGTERM waits for every client to leave)
  for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$p" 2>/dev/null || true
}

case "$action" in
  start) start ;;
  stop) stop ;;
  status) if running; then echo running; else echo stopped; exit 1; fi ;;
  url) owner_url ;;
  worker-url) worker_url ;;
  *) echo "usage: $0 start|stop|status|url|worker-url [--mode session|transaction|statement]" >&2; exit 2 ;;
esac
