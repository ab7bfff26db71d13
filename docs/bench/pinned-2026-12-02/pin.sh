#!/usr/bin/env bash
# Give PostgreSQL a core of its own on a 2-vCPU host: `pin.sh on` pins every PostgreSQL process to CPU 1 (backends
# forked later inherit it from the postmaster) and the Kafka broker to CPU 0; run the bench under `taskset -c 0`
# so the worker, the producer and the raw measurements' clients share CPU 0 with the broker. `pin.sh off` undoes it.
# `pin.sh show` prints each process's CPU list. Needs root (or the processes' owner) and util-linux's taskset.
set -euo pipefail
case "${1:-show}" in
  on) pg=1 other=0 ;;
  off) pg=0,1 other=0,1 ;;
  show) pg='' other='' ;;
  *) echo "usage: pin.sh on|off|show" >&2; exit 2 ;;
esac
broker=$(pgrep -f 'kafka\.Kafka' || true)
[[ -n $broker ]] || { echo "pin.sh: no Kafka broker running (start it: scripts/kafka.sh start)" >&2; exit 1; }
postgres=$(pgrep -u postgres || true)
[[ -n $postgres ]] || { echo "pin.sh: no PostgreSQL process (start it: scripts/postgres.sh start)" >&2; exit 1; }
for pid in $postgres; do
  if [[ -n $pg ]]; then taskset -a -p -c "$pg" "$pid" > /dev/null; fi
  echo "postgres $pid: $(taskset -p -c "$pid" | sed 's/.*: //')"
done
for pid in $broker; do
  if [[ -n $other ]]; then taskset -a -p -c "$other" "$pid" > /dev/null; fi
  echo "broker $pid: $(taskset -p -c "$pid" | sed 's/.*: //')"
done
