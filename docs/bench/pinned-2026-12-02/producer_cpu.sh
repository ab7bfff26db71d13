#!/usr/bin/env bash
# CPU of the soak's paced producer alone: N movements at RATE/s into a fresh 24-partition topic, user+sys seconds
# and wall time of the JVM (GNU time). Usage: producer_cpu.sh SOURCE.java [RATE] [N] [extra JVM flags...]
# Run from the repository root with the broker up; uses the project's Kafka jars.
set -euo pipefail
src=$1 rate=${2:-20000} n=${3:-600000}
shift $(( $# < 3 ? $# : 3 ))
libs=${KAFKA_LIBS:-$HOME/.cache/stock-ledger/kafka-4.1.1/libs}
topic=producer-cpu-$(date +%s%N)
STOCK_LEDGER_TOPIC=$topic KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:9092 .venv/bin/stock-ledger create-topic > /dev/null 2>&1
/usr/bin/time -f "$(basename "$src") $* rate $rate n $n: user %U s, sys %S s, wall %e s" \
  java -Xmx256m "$@" -cp "$libs/*" "$src" 127.0.0.1:9092 "$topic" "$n" 24 "$rate" 2>&1 | tail -1
