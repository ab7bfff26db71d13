#!/bin/bash
# Alternates two source trees (PYTHONPATH) in drains by ../cpu-cuts-2026-12-01/drain_ab.py (one repetition each,
# debug log for the transaction median); output lines: time, label, drain_ab's line, the median batch transaction.
# It reads the worker log drain_ab.py leaves in /tmp/s27 (that script's paths are the sessions' own; see its docstring).
# usage: ab.sh pairs N label_a path_a label_b path_b
pairs=$1; N=$2
for i in $(seq $pairs); do for v in "$3=$4" "$5=$6"; do lab=${v%%=*}; path=${v#*=}
  r=$(.venv/bin/python docs/bench/cpu-cuts-2026-12-01/drain_ab.py $N 1 PYTHONPATH=$path STOCK_LEDGER_LOG_LEVEL=debug 2>&1 | grep -E "^rep")
  t=$(grep -h '"batch.committed"' /tmp/s27/startup-0.log | python3 -c "
import sys,json,statistics
xs=[json.loads(l) for l in sys.stdin]
print('txn median %.1f ms' % (1000*statistics.median(x['seconds'] for x in xs)))")
  echo "$(date +%T) $lab: $r | $t"
done; done
