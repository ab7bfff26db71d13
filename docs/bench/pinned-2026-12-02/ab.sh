#!/usr/bin/env bash
# Alternate the 1M bench shared (every process on both vCPUs) and pinned (PostgreSQL on CPU 1; the broker, the bench
# and its workers on CPU 0), PAIRS times. Run from the repository root with the services up (`make services`).
set -euo pipefail
pairs=${1:-2}
here=docs/bench/pinned-2026-12-02
for i in $(seq 1 "$pairs"); do
  for mode in shared pinned; do
    if [[ $mode == pinned ]]; then "$here/pin.sh" on > /dev/null; run=(taskset -c 0); else "$here/pin.sh" off > /dev/null; run=(); fi
    echo "== pair $i, $mode, $(date -u +%H:%M:%S)"
    "${run[@]}" .venv/bin/python scripts/bench.py --count 1000000 --repeat 1 --workers 2 --batch-sizes 5000,5000 \
      --out "$here/bench-$mode-$i.json" > "$here/bench-$mode-$i.log" 2>&1
    python3 - "$here/bench-$mode-$i.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
m, r = d["median"], d["ratios"]
sweep = ", ".join(f"{s['rate']:,.0f}" for s in d["batch_sweep"])
print(f"raw COPY {m['raw_copy_rate']:,.0f}/s  worker {m['worker_rate']:,.0f}/s  ratio {r['worker_vs_limit']:.2f}"
      f"  sweep {sweep}  worker x2 {m['worker2_rate']:,.0f}/s  cpu/100k {m['worker_cpu_seconds_per_100k']:.2f}")
PY
  done
done
"$here/pin.sh" off > /dev/null
