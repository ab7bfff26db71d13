#!/usr/bin/env bash
# Alternate 2-minute soaks at RATE/s: OLD_TREE's scripts (its FastProducer.java, its JVM flags) against this tree's,
# PAIRS times; the worker is this tree's in both (the package installed in .venv). Run from the repository root:
#   git worktree add /tmp/h767 767ccc6 && docs/bench/pinned-2026-12-02/soak_ab.sh /tmp/h767 2 20000
set -euo pipefail
old=$1 pairs=${2:-2} rate=${3:-20000}
here=docs/bench/pinned-2026-12-02
for i in $(seq 1 "$pairs"); do
  for side in old new; do
    root=$([[ $side == old ]] && echo "$old" || pwd)
    out=$here/soak$((rate / 1000))k-ab-$side-$i.json
    echo "== pair $i, $side producer ($root), $(date -u +%H:%M:%S)"
    .venv/bin/python "$root/scripts/bench.py" --soak 2 --rate "$rate" --out "$out" > "${out%.json}.log" 2>&1
    grep -E "^ +2 " "${out%.json}.log" | head -1
    grep -E "^minute  2 CPU" "${out%.json}.log" || grep -oE "minute 2: .*" "${out%.json}.log" | grep -oE "CPU: .*"
  done
done
