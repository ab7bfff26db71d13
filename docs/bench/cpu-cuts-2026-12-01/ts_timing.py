"""A Kafka timestamp (ms since the epoch) into the wire form (µs since 2000-01-01Z): the builder's conversion
before a4b0a82 (through a datetime, as pgtime.micros) and after (stock_ledger.batch._ts, integers). Same value
checked first; then the best of 7 runs of 200,000 calls each. Run: .venv/bin/python docs/bench/cpu-cuts-2026-12-01/ts_timing.py
"""

import timeit
from datetime import UTC, datetime, timedelta

from stock_ledger.batch import MAX_TIMESTAMP_MS, _ts
from stock_ledger.pgtime import micros

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def before(ms: int) -> tuple[int] | None:
    if not 0 <= ms <= MAX_TIMESTAMP_MS:
        return None
    return micros(_EPOCH + timedelta(milliseconds=ms))


for ms in (0, 1, 1_796_150_000_123, MAX_TIMESTAMP_MS, -1, MAX_TIMESTAMP_MS + 1):
    assert before(ms) == _ts(ms), ms
N = 200_000
for name, fn in (("before (datetime)", before), ("after (integers)", _ts)):
    best = min(timeit.repeat(lambda fn=fn: fn(1_796_150_000_123), number=N, repeat=7)) / N
    print(f"{name}: {best * 1e9:.0f} ns a call")
