"""Ad hoc (2026-12-01, session 28): how long one `getmany` holds the event loop when its records are already
buffered, for max_records 5,000 (one batch, as before d28cdf3) and 500 (one chunk). Needs `make services` and the
topic `st.getmany` filled by `stock-ledger produce --count 200000` (STOCK_LEDGER_TOPIC=st.getmany after
`stock-ledger create-topic`). Each timing: the records of that call waited in aiokafka's buffer; the call is
timed around `await` (it does not suspend when records are buffered, so this is time the loop is held)."""
import asyncio, statistics, time
from aiokafka import AIOKafkaConsumer, TopicPartition


async def main() -> None:
    c = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9092", enable_auto_commit=False)
    await c.start()
    tps = [TopicPartition("st.getmany", p) for p in range(24)]
    c.assign(tps)
    await c.seek_to_beginning(*tps)
    for size in (5000, 500, 5000, 500):
        held = []
        for _ in range(15):
            await asyncio.sleep(0.3)  # let the fetcher fill its buffer
            t0 = time.perf_counter()
            got = await c.getmany(timeout_ms=0, max_records=size)
            held.append((time.perf_counter() - t0) * 1000)
            n = sum(map(len, got.values()))
        print(f"max_records {size}: last call {n} records; loop held per call, ms: median {statistics.median(held):.1f}"
              f", min {min(held):.1f}, max {max(held):.1f}", flush=True)
    await c.stop()

asyncio.run(main())
