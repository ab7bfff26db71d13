"""transactional: the worker on a topic written in producer transactions, and what recording the offsets that held
no record (markers, aborted records: table non_record_offsets) costs.

N movements in transactions of --per-transaction, every --abort-every-th aborted. Then the real worker drains it
(to the log end, past the last marker), a worker drains the same N produced without transactions, and the batch
transaction alone is timed in this process on the topic's committed records (`BatchBuilder` batches of an equal
share of every partition, each continuing where the last ended: a non-record row per partition per batch, the most
there can be), with `offsets.record_non_records` as shipped and replaced by a no-op, alternating, --repeat times.
"""

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaProducer
from scripts import benchkit as kit
from scripts.benchkit import BATCH, PARTITIONS, Bench, say

from stock_ledger.faults import Faults
from stock_ledger.ledger import offsets, pgtime
from stock_ledger.ledger.batch import Batch, BatchBuilder, Record
from stock_ledger.ledger.claims import Claims
from stock_ledger.ledger.transaction import Ledger
from stock_ledger.produce import movements

_SIZE = "SELECT count(*) AS rows, pg_total_relation_size('non_record_offsets') AS bytes FROM non_record_offsets"


async def produce_in_transactions(bench: Bench, topic: str, a: argparse.Namespace) -> list[Record]:
    """N committed movements (aborted ones on top); the committed records as a read_committed consumer returns them."""
    producer = AIOKafkaProducer(bootstrap_servers=bench.services.kafka, transactional_id=f"bench-{uuid.uuid4().hex}",
                                linger_ms=5)
    generated, committed, transactions = iter(movements(a.count * 2, seed=11)), 0, 0
    await producer.start()
    try:
        while committed < a.count:
            transactions += 1
            aborted = transactions % a.abort_every == 0
            size = a.per_transaction if aborted else min(a.per_transaction, a.count - committed)
            await producer.begin_transaction()
            for key, value in (next(generated) for _ in range(size)):
                await producer.send(topic, value, key=key)
            await (producer.abort_transaction() if aborted else producer.commit_transaction())
            committed += 0 if aborted else size
    finally:
        await producer.stop()
    bench.results["transactions"], kept = transactions, await bench.read_topic(topic)
    if len(kept) != a.count:
        raise RuntimeError(f"read {len(kept):,} committed records, expected {a.count:,}")
    return kept


def batches(topic: str, records: list[Record], epochs: dict[int, int]) -> list[Batch]:
    by_partition: dict[int, list[Record]] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(r)
    share, built, stands = BATCH // PARTITIONS, [], dict.fromkeys(range(PARTITIONS), 0)
    for start in range(0, max(map(len, by_partition.values())), share):
        builder = BatchBuilder(topic, epochs, dict(stands))
        for p in sorted(by_partition):
            if chunk := by_partition[p][start:start + share]:
                builder.add(p, chunk)
        built.append(builder.batch())
        stands |= {x.partition: x.next_offset for x in built[-1].slices}
    return built


async def apply_all(bench: Bench, topic: str, records: list[Record], label: str, *, record: bool) -> float:
    """Seconds in the batch transactions of `records` applied to a fresh database."""
    shipped, name = offsets.record_non_records, await bench.create_database(label)
    try:
        async with kit.connection(bench.services.url_for(name, worker=True)) as conn:
            await pgtime.install(conn)
            claims = await Claims("bench", Faults(None)).claim(conn, topic, range(PARTITIONS), None, None,
                                                               reset=dict.fromkeys(range(PARTITIONS), 0))
            built = batches(topic, records, {c.partition: c.epoch for c in claims})
            ledger = Ledger("bench", Faults(None))
            offsets.record_non_records = shipped if record else lambda *_: asyncio.sleep(0)  # the B: a no-op
            started = time.perf_counter()
            for batch in built:
                await ledger.apply(conn, batch)
            seconds = time.perf_counter() - started
            if record:
                bench.results["ab_non_records"] = dict(await conn.fetchrow(_SIZE) or {})
    finally:
        offsets.record_non_records = shipped
        await bench.drop_database(name)
    return seconds


async def measure(bench: Bench, a: argparse.Namespace) -> str:
    await bench.create_database()
    topic, plain, res = await bench.create_topic("transactional"), await bench.create_topic("plain"), bench.results
    records = await produce_in_transactions(bench, topic, a)
    await bench.produce(plain, a.count, seed=12)
    res["worker"] = (await bench.worker(topic, "transactional", rows=a.count)).result
    async with bench.owner() as conn:
        res["worker_non_records"] = dict(await conn.fetchrow(_SIZE) or {})
    res["plain_worker"] = (await bench.worker(plain, "plain")).result
    res["ab_rounds"] = rounds = []
    for r in range(a.repeat):  # alternating which goes first: a fresh database's first writes are its coldest
        order = (False, True) if r % 2 else (True, False)
        got = {record: await apply_all(bench, topic, records, f"ab{r}{int(record)}", record=record) for record in order}
        rounds.append({"with_seconds": got[True], "without_seconds": got[False]})
        say(f"A/B round {r + 1}/{a.repeat}: with {got[True]:.2f}s, without {got[False]:.2f}s")
    with_s, without_s = (statistics.median(x[k] for x in rounds) for k in ("with_seconds", "without_seconds"))
    w, p, per_million = res["worker"], res["plain_worker"], 1_000_000 / a.count
    rows: list[Any] = [
        ("worker x1, transactional topic", f"{w['rate']:,.0f}/s", f"{w['cpu_seconds_per_100k']:.2f} CPU s per 100k"),
        ("worker x1, the same N without transactions", f"{p['rate']:,.0f}/s",
         f"{p['cpu_seconds_per_100k']:.2f} CPU s per 100k"),
        ("batch transactions, non-record runs written", f"{with_s:.2f} s", ""),
        ("batch transactions, not written", f"{without_s:.2f} s", f"overhead {100 * (with_s / without_s - 1):+.1f}%"),
    ] + [(f"non_record_offsets per million movements, {what}", f"{n['rows'] * per_million:,.0f} rows",
          f"{n['bytes'] * per_million / 2**20:.1f} MiB") for what, n in
         (("the worker's drain", res["worker_non_records"]), ("the A/B's batches", res["ab_non_records"]))]
    return (f"stock-ledger transactional: N={a.count:,} in {res['transactions']:,} transactions of "
            f"{a.per_transaction}, every {a.abort_every}th aborted; A/B median of {a.repeat}\n\n"
            + kit.table(("measurement", "value", "detail"), rows))
