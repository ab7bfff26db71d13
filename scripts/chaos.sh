#!/usr/bin/env bash
# The staging chaos drill, generalised: produce movements while killing the workers, then prove the ledger exact.
# `--help` says how to run it; the Helm chart's opt-in drill Job (chaos.enabled, helm/stock-ledger/templates/
# chaos-job.yaml) runs `--mode k8s` against the drill's own workers, topic and database, and CI runs `--mode local`
# (tests/integration/test_chaos_script.py). The flags and the k8s drill are here; --mode local hands over, with the
# checked flags, to its Python supervisor scripts/chaos_local.py (worker processes, readiness, restarts, progress).
#
# Output: progress, the plan and verify's table go to stderr; stdout carries one line, `count|distinct`.
# Exit codes: 0 the ledger holds exactly --count movements, each once; 1 it does not, or the drill itself failed;
# 2 bad flags or environment (nothing was started).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly ROOT

usage() {
  cat <<'EOF'
Usage: chaos.sh --mode local|k8s [options]

Produce movements with `stock-ledger produce` while killing the stock-ledger workers --kills times at random
gaps, wait until the ledger has caught up, then run `stock-ledger verify --expect COUNT`. Prints the
`count|distinct` line on stdout (everything else goes to stderr); exits 0 only if the ledger holds exactly
COUNT movements, each once, with no gap, no duplicate and exact stock levels. Expects a fresh topic and
database, as the staging pipeline's `50000|50000` check does.

Modes:
  --mode k8s     Force-delete the worker pods, as the staging pipeline does:
                   kubectl delete pod -l SELECTOR -n NAMESPACE --grace-period=0 --force --wait=false
                 The producer and verify run here (in the chaos pod). Before the first kill all matching pods
                 must be Ready; after the last, the drill waits until as many new pods are Ready again.
                 Needs get/list/watch/delete on pods in NAMESPACE, nothing else.
  --mode local   Start --workers `stock-ledger run` processes here, SIGKILL a random one per kill and restart
                 it at once (as a Deployment's ReplicaSet replaces a pod), stop them with SIGTERM at the end.
                 The database must be migrated (`make migrate`).

Options:
  --count N             movements to produce (default 50000)
  --rate R              movements per second (default 2000)
  --kills N             kills, 0 for a baseline run without any (default 5)
  --interval A-B        seconds between kills, uniformly random in [A, B], e.g. 3-10 or 0.5-2 (default 3-10)
  --seed S              seeds the producer and the kill schedule (default: random, printed so a run can be replayed)
  --stock-ledger PATH   the CLI (default: $STOCK_LEDGER_BIN, else `stock-ledger` on PATH, else .venv/bin/stock-ledger)
  --drain-timeout SEC   how long to wait for lag 0 before verifying anyway (default 300)
  --ready-timeout SEC   how long to wait for workers to be Ready (default 300)
 k8s mode:
  --namespace NS        required: the namespace of the release; nothing outside it is touched
  --selector SEL        label selector of the worker pods (default app.kubernetes.io/name=stock-ledger); needs at
                        least one key=value term, and must not match the pod the drill runs in
  --kubectl PATH        kubectl binary (default: kubectl on PATH)
 local mode:
  --workers K           worker processes (default 1)
  --log-dir DIR         where worker-I.N.log files go (default: a new temporary directory, printed at start)
  -h, --help            this text

Environment (passed through to every stock-ledger command):
  KAFKA_BOOTSTRAP_SERVERS, DATABASE_URL (required; in local mode the worker's URL: verify only reads),
  STOCK_LEDGER_TOPIC, STOCK_LEDGER_GROUP_ID, and any other STOCK_LEDGER_* setting. In local mode every worker
  gets its own STOCK_LEDGER_METRICS_PORT, and STOCK_LEDGER_GROUP_INSTANCE_ID, if set, becomes a per-incarnation
  id (ID-worker-restart), as the chart derives it from the pod name.

Examples:
  scripts/chaos.sh --mode local --workers 2 --count 20000 --kills 3 --interval 1-3
  scripts/chaos.sh --mode k8s --namespace staging \
      --selector app.kubernetes.io/name=stock-ledger,app.kubernetes.io/instance=stock-ledger
EOF
}

# ------------------------------------------------------------------------------------------ output

log() {
  local now
  printf -v now '%(%Y-%m-%dT%H:%M:%S%z)T' -1
  printf '%s chaos: %s\n' "$now" "$*" >&2
}

die() { log "FAILED: $*"; exit 1; }

usage_error() {
  printf 'chaos.sh: %s\n' "$*" >&2
  printf "Try 'scripts/chaos.sh --help'.\n" >&2
  exit 2
}

# Milliseconds as the seconds `sleep` takes: 1500 -> 1.500.
seconds() { printf '%d.%03d' "$(($1 / 1000))" "$(($1 % 1000))"; }

# ------------------------------------------------------------------------------------------ flags

declare -A opt=(
  [--count]=50000 [--rate]=2000 [--kills]=5 [--interval]=3-10 [--seed]=""
  [--selector]=app.kubernetes.io/name=stock-ledger [--namespace]="" [--kubectl]=""
  [--workers]=1 [--log-dir]="" [--stock-ledger]="" [--drain-timeout]=300 [--ready-timeout]=300 [--mode]=""
)
declare -A given=()
readonly K8S_ONLY=(--namespace --selector --kubectl)
readonly LOCAL_ONLY=(--workers --log-dir)

parse_flags() {
  while (($#)); do
    case "$1" in
      -h | --help) usage; exit 0 ;;
      --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
      --*)
        [[ -v "opt[$1]" ]] || usage_error "unknown option: $1"
        (($# >= 2)) || usage_error "$1 needs a value"
        opt[$1]=$2
        given[$1]=1
        shift 2
        ;;
      *) usage_error "unexpected argument: $1" ;;
    esac
  done
}

# A whole number in [low, high], returned without leading zeros (bash would read 010 as octal).
whole() {
  local name=$1 value=$2 low=$3 high=$4
  if [[ ! $value =~ ^[0-9]{1,9}$ ]] || ((10#$value < low || 10#$value > high)); then
    usage_error "$name must be a whole number in [$low, $high] (got '$value')"
  fi
  printf '%d' "$((10#$value))"
}

# Seconds with up to three decimals, as milliseconds.
millis() {
  local name=$1 value=$2
  [[ $value =~ ^([0-9]{1,6})(\.([0-9]{1,3}))?$ ]] ||
    usage_error "$name must be seconds, e.g. 3 or 0.5 (got '$value')"
  local frac="${BASH_REMATCH[3]}000"
  printf '%d' "$((10#${BASH_REMATCH[1]} * 1000 + 10#${frac:0:3}))"
}

validate_flags() {
  mode=${opt[--mode]}
  case "$mode" in
    k8s | local) ;;
    "") usage_error "--mode is required: --mode local (processes here) or --mode k8s (pods, needs --namespace)" ;;
    *) usage_error "--mode must be local or k8s (got '$mode')" ;;
  esac
  local flag
  for flag in "${K8S_ONLY[@]}"; do
    [[ $mode == k8s || ! -v "given[$flag]" ]] || usage_error "$flag applies to --mode k8s only"
  done
  for flag in "${LOCAL_ONLY[@]}"; do
    [[ $mode == local || ! -v "given[$flag]" ]] || usage_error "$flag applies to --mode local only"
  done

  count=$(whole --count "${opt[--count]}" 1 100000000)
  kills=$(whole --kills "${opt[--kills]}" 0 10000)
  rate=${opt[--rate]}
  [[ $rate =~ ^[0-9]{1,7}(\.[0-9]{1,3})?$ && ! $rate =~ ^0*(\.0*)?$ ]] ||
    usage_error "--rate must be a number of movements per second > 0 (got '$rate')"
  drain_timeout=$(whole --drain-timeout "${opt[--drain-timeout]}" 1 86400)
  ready_timeout=$(whole --ready-timeout "${opt[--ready-timeout]}" 1 86400)

  local interval=${opt[--interval]}
  [[ $interval =~ ^([0-9.]+)-([0-9.]+)$ ]] ||
    usage_error "--interval must be MIN-MAX seconds, e.g. 3-10 (got '$interval')"
  gap_min=$(millis "--interval minimum" "${BASH_REMATCH[1]}")
  gap_max=$(millis "--interval maximum" "${BASH_REMATCH[2]}")
  ((gap_min <= gap_max)) || usage_error "--interval $interval: the minimum is greater than the maximum"

  if [[ -n ${opt[--seed]} ]]; then
    seed=$(whole --seed "${opt[--seed]}" 0 2147483647)
  else
    seed=$(((RANDOM << 15 | RANDOM) ^ $$))
  fi

  if [[ $mode == k8s ]]; then
    namespace=${opt[--namespace]}
    [[ -n $namespace ]] ||
      usage_error "--mode k8s needs an explicit --namespace: the drill force-deletes pods and never guesses where"
    [[ $namespace =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
      usage_error "--namespace must be a Kubernetes namespace name (got '$namespace')"
    selector=${opt[--selector]}
    # An empty or existence-only selector could match far more than the workers: demand a key=value term.
    [[ $selector =~ ^[^[:space:]]+$ && $selector =~ (^|,)[A-Za-z0-9./_-]+==?[A-Za-z0-9._-]+(,|$) ]] ||
      usage_error "--selector must hold at least one key=value term and no spaces (got '$selector')"
  else
    workers=$(whole --workers "${opt[--workers]}" 1 64)
  fi
}

# The CLI: --stock-ledger, $STOCK_LEDGER_BIN, `stock-ledger` on PATH, then the Makefile's venv.
resolve_cli() {
  local wanted=${opt[--stock-ledger]:-${STOCK_LEDGER_BIN:-}} source=--stock-ledger
  [[ -n ${opt[--stock-ledger]} ]] || source=STOCK_LEDGER_BIN
  if [[ -n $wanted ]]; then
    if ! cli=$(command -v -- "$wanted") || [[ ! -x $cli ]]; then
      usage_error "$source=$wanted is not an executable stock-ledger CLI"
    fi
  elif cli=$(command -v stock-ledger); then
    :
  elif [[ -x $ROOT/.venv/bin/stock-ledger ]]; then
    cli=$ROOT/.venv/bin/stock-ledger
  else
    usage_error "stock-ledger not found: pass --stock-ledger PATH, set STOCK_LEDGER_BIN, or run 'make venv'"
  fi
}

validate_env() {
  [[ -n ${DATABASE_URL:-} ]] ||
    usage_error "DATABASE_URL is required (verify reads the ledger; in local mode the workers write it)"
  if [[ $mode == k8s ]]; then
    local wanted=${opt[--kubectl]:-kubectl}
    if ! kubectl=$(command -v -- "$wanted") || [[ ! -x $kubectl ]]; then
      usage_error "kubectl not found (${opt[--kubectl]:+--kubectl }$wanted): install it or pass --kubectl PATH"
    fi
  fi
}

# ------------------------------------------------------------------------------------------ local mode

# The supervisor runs on the interpreter of the CLI's own environment (a venv's python sits next to its
# stock-ledger), which can import stock_ledger; it keeps this script's output lines and exit codes.
run_local() {
  local helper=$ROOT/scripts/chaos_local.py python dir
  [[ -f $helper ]] || usage_error "--mode local needs $helper: run it from a checkout of the repository"
  dir=$(dirname -- "$cli")
  for python in "$dir/python3" "$dir/python" "$ROOT/.venv/bin/python3" python3; do
    if command -v -- "$python" >/dev/null; then break; fi
  done
  exec "$python" "$helper" --cli "$cli" --count "$count" --rate "$rate" --kills "$kills" \
    --gap-ms "$gap_min" "$gap_max" --seed "$seed" --workers "$workers" --log-dir "${opt[--log-dir]}" \
    --drain-timeout "$drain_timeout" --ready-timeout "$ready_timeout"
}

# ------------------------------------------------------------------------------------------ k8s mode

producer_pid=""
verify_pid=""
workdir=""

# A random gap in [gap_min, gap_max] ms; two draws of $RANDOM because one gives only 15 bits.
next_gap() {
  local span=$((gap_max - gap_min + 1))
  gap=$((gap_min + ((RANDOM << 15 | RANDOM) % span)))
}

# Sleep `ms` milliseconds in short slices, watching the background processes between them.
pause() {
  local ms=$1 slice
  while ((ms > 0)); do
    slice=$((ms < 250 ? ms : 250))
    sleep "$(seconds "$slice")"
    ms=$((ms - slice))
    check_producer
  done
}

start_producer() {
  log "producer: $count movements at $rate/s (seed $seed) to ${STOCK_LEDGER_TOPIC:-warehouse.movements}"
  produce_started=$SECONDS
  "$cli" produce --count "$count" --rate "$rate" --seed "$seed" </dev/null >&2 &
  producer_pid=$!
}

# Reap the producer once it has exited; a failed producer ends the drill (the count could never match).
check_producer() {
  if [[ -z $producer_pid ]] || kill -0 "$producer_pid" 2>/dev/null; then return 0; fi
  local rc=0
  wait "$producer_pid" || rc=$?
  producer_pid=""
  ((rc == 0)) || die "the producer exited with status $rc"
  log "producer: done after $((SECONDS - produce_started))s"
}

wait_producer() {
  [[ -z $producer_pid ]] || log "waiting for the producer"
  while [[ -n $producer_pid ]]; do pause 250; done
}

# `verify --wait` first waits for lag 0 (stored offsets at every partition's log end), then checks everything.
verify_ledger() {
  local out="$workdir/verify.out" rc=0 line
  log "waiting up to ${drain_timeout}s for lag 0, then: stock-ledger verify --expect $count"
  "$cli" verify --wait "$drain_timeout" --expect "$count" </dev/null >"$out" &
  verify_pid=$!
  while kill -0 "$verify_pid" 2>/dev/null; do pause 250; done
  wait "$verify_pid" || rc=$?
  verify_pid=""
  cat "$out" >&2
  line=$(grep -E '^[0-9]+\|[0-9]+$' "$out" | tail -n 1) || die "verify printed no count|distinct line (status $rc)"
  printf '%s\n' "$line"
  [[ $line == "$count|$count" ]] || die "expected $count|$count, found $line"
  ((rc == 0)) || die "verify found a problem (status $rc): see the table above"
  log "ok: $line"
}

killed_pods=" "

kube() { "$kubectl" --request-timeout=30s "$@"; }

# name|deletionTimestamp|Ready status, one line per pod matching the selector.
pod_table() {
  kube get pods -n "$namespace" -l "$selector" -o \
    'jsonpath={range .items[*]}{.metadata.name}{"|"}{.metadata.deletionTimestamp}{"|"}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}'
}

# Sets `live` (pods not being deleted and not deleted by us) and `ready` (those of them that are Ready).
count_pods() {
  local table name deleting status
  table=$(pod_table) || die "kubectl get pods -n $namespace -l $selector failed"
  live=() ready=()
  while IFS='|' read -r name deleting status; do
    [[ -n $name && -z $deleting && $killed_pods != *" $name "* ]] || continue
    live+=("$name")
    [[ $status != True ]] || ready+=("$name")
  done <<<"$table"
}

# Wait until `want` pods (or, with want=0, all live pods and at least one) are Ready.
wait_pods_ready() {
  local want=$1 deadline=$((SECONDS + ready_timeout)) seen=""
  while :; do
    count_pods
    local target=$((want > 0 ? want : ${#live[@]}))
    if ((target > 0 && ${#ready[@]} >= target)); then break; fi
    if [[ $seen != "${#ready[@]}/$target" ]]; then
      seen="${#ready[@]}/$target"
      log "pods Ready: $seen"
    fi
    ((SECONDS < deadline)) ||
      die "only ${#ready[@]} of $target pods matching $selector in $namespace Ready after ${ready_timeout}s"
    pause 2000
  done
  log "pods Ready: ${#ready[@]} (${ready[*]})"
}

kill_pods() {
  local n=$1 out names
  out=$(kube delete pod -l "$selector" -n "$namespace" --grace-period=0 --force --wait=false -o name) ||
    die "kubectl delete pod -l $selector -n $namespace failed"
  names=$(sed -n 's|^pod/||p' <<<"$out" | tr '\n' ' ')
  names=${names% }
  killed_pods+="$names "
  log "kill $n/$kills: pods ${names:-(none matched: replacements not created yet)}"
}

run_k8s() {
  workdir=$(mktemp -d "${TMPDIR:-/tmp}/stock-ledger-chaos.XXXXXX")
  log "plan: --mode k8s: force-delete the pods matching -l $selector in namespace $namespace $kills times," \
    "$(seconds "$gap_min")-$(seconds "$gap_max")s apart, with:"
  log "plan:   $kubectl delete pod -l $selector -n $namespace --grace-period=0 --force --wait=false"
  log "plan: meanwhile produce $count movements at $rate/s (seed $seed) to" \
    "${STOCK_LEDGER_TOPIC:-warehouse.movements} at ${KAFKA_BOOTSTRAP_SERVERS:-localhost:9092};" \
    "then wait for the pods to be Ready and for lag 0, and verify group ${STOCK_LEDGER_GROUP_ID:-stock-ledger}"

  local answer
  answer=$(kube auth can-i delete pods -n "$namespace" 2>&1) ||
    die "kubectl may not delete pods in namespace $namespace (auth can-i: ${answer:-no answer})"
  wait_pods_ready 0
  local replicas=${#ready[@]}
  if [[ -n ${HOSTNAME:-} && " ${live[*]} " == *" $HOSTNAME "* ]]; then
    usage_error "the selector $selector matches this pod ($HOSTNAME): refusing to delete the drill itself"
  fi

  start_producer
  local i
  for ((i = 1; i <= kills; i++)); do
    next_gap
    pause "$gap"
    kill_pods "$i"
  done
  wait_producer
  log "waiting up to ${ready_timeout}s for $replicas replacement pods to be Ready"
  wait_pods_ready "$replicas"
  verify_ledger
  log "done: $kills kills, ledger exact"
}

# ------------------------------------------------------------------------------------------ cleanup

# On any exit: end what is still running, by pid.
cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  local pid
  for pid in "$producer_pid" "$verify_pid"; do
    [[ -z $pid ]] || kill -TERM "$pid" 2>/dev/null
  done
  for pid in "$producer_pid" "$verify_pid"; do
    [[ -z $pid ]] || wait "$pid" 2>/dev/null
  done
  if ((rc != 0)) && [[ -n $workdir ]]; then log "exit $rc; logs kept in $workdir"; fi
  exit "$rc"
}

main() {
  parse_flags "$@"
  validate_flags
  resolve_cli
  validate_env
  [[ $mode == k8s ]] || run_local
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  RANDOM=$seed
  run_k8s
}

main "$@"
