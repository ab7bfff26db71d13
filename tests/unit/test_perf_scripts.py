"""The pure helpers of the benchmarks (scripts/benchkit.py; scripts/benchmarks/: peers, growth, soak).

The benchmarks themselves run for minutes against Kafka Connect and multi-million-row ledgers, so CI does not run
them; what they compute from their measurements, and the input they hand the peer, is checked here."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from scripts import benchkit
from scripts.benchmarks import growth, peers, soak

from stock_ledger.domain import Movement, encode, parse
from stock_ledger.produce import movements

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_the_connect_envelope_carries_the_same_movement_with_a_schema_naming_every_payload_field() -> None:
    """The peer reads JsonConverter's {"schema", "payload"} form of the very movement we produce: same id, same
    values, the timestamp with its offset, uuid and timestamptz requested by Debezium's logical type names."""
    key, value = next(movements(1, seed=7))
    m = parse(key, value)
    assert isinstance(m, Movement)
    envelope = json.loads(peers.connect_envelope(m))
    payload, schema = envelope["payload"], envelope["schema"]
    assert [f["field"] for f in schema["fields"]] == list(payload)
    assert uuid.UUID(payload["movement_id"]) == m.movement_id
    assert datetime.fromisoformat(payload["occurred_at"]) == m.occurred_at
    assert (payload["warehouse_id"], payload["sku"], payload["qty"], payload["kind"]) == (
        m.warehouse_id, m.sku, m.qty, m.kind)
    names = {f["field"]: f.get("name") for f in schema["fields"]}
    assert names["movement_id"] == "io.debezium.data.Uuid"
    assert names["occurred_at"] == "io.debezium.time.ZonedTimestamp"


def test_the_envelope_keeps_the_warehouse_offset_of_the_timestamp() -> None:
    """A movement stamped at +02:00 reaches the peer as the same instant with its offset, not a naive time."""
    local = datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    m = parse(b"SKU-1", encode(Movement(uuid.uuid4(), "WH-1", "SKU-1", 3, "receipt", local)))
    assert isinstance(m, Movement)
    sent = json.loads(peers.connect_envelope(m))["payload"]["occurred_at"]
    assert sent.endswith("+02:00")
    assert datetime.fromisoformat(sent) == local.astimezone(UTC)


@pytest.mark.parametrize("name", ["worker.properties", "jdbc-sink.properties"])
def test_the_committed_connect_templates_fill_completely_and_refuse_a_missing_value(name: str) -> None:
    template = (SCRIPTS / "connect" / name).read_text()
    names = ("bootstrap", "state", "plugins", "rest_port", "name", "topic", "jdbc_url", "user", "password", "mode",
             "pk_mode", "pk_fields", "table")
    values = dict.fromkeys(names, "X")
    filled = peers.fill(template, **values)
    assert "${" not in filled.replace("$$", "")
    assert "InsertField$Value" in filled or name == "worker.properties"
    with pytest.raises(KeyError):
        peers.fill(template)


def test_jdbc_url_is_built_from_the_postgres_url_of_the_services() -> None:
    assert peers.jdbc_url("postgresql://u:p@127.0.0.1:5433/postgres", "sl_bench_1") == (
        "jdbc:postgresql://127.0.0.1:5433/sl_bench_1", "u", "p")


def test_scaling_efficiency_is_rate_over_n_times_the_single_worker_rate() -> None:
    eff = growth.scaling_efficiency({1: 100.0, 2: 150.0, 6: 120.0})
    assert eff == {1: 1.0, 2: 0.75, 6: pytest.approx(0.2)}
    assert growth.scaling_efficiency({2: 10.0}) == {}


def test_size_per_million_and_medians() -> None:
    assert growth.per_million(2 * 1024**2 * 5, 5_000_000) == pytest.approx(2.0)
    assert growth.per_million(10.0, 0) != growth.per_million(10.0, 0)  # NaN: no rows, no ratio
    assert benchkit.median_of([{"a": 1.0}, {"a": 5.0}, {"a": 2.0}]) == {"a": 2.0}


def test_the_bar_chart_is_well_formed_svg_with_one_bar_per_value() -> None:
    svg = benchkit.bar_svg("t", [("x1", 10.0), ("x2", 0.0), ("x3", 30.0)], "workers", [(20.0, "line")])
    root = ET.fromstring(svg)  # noqa: S314 - our own output
    bars = [e for e in root if e.tag.endswith("rect") and e.get("fill") == "#4878a8"]
    assert len(bars) == 3
    assert all(float(b.get("height", "-1")) >= 0 for b in bars)


def test_peak_rss_is_the_commands_own_not_the_bench_process_that_started_it(tmp_path: Path) -> None:
    """Linux carries the RSS high-water mark of a process's address space before exec into its ru_maxrss, and a child
    started from a big bench starts with the bench's pages: verify once read as big as the soak that ran it. A
    command using ~60 MiB, started while this process holds 300 MiB, measures about 60 MiB, not 300."""
    ballast = bytearray(300 * 1024 * 1024)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched: resident
    command = [sys.executable, "-c", "b = bytearray(60 << 20); b[::4096] = b'x' * len(b[::4096]); print('done')"]
    measured = soak.run_measured(command, {}, tmp_path / "out.txt")
    assert measured["exit_code"] == 0
    assert measured["last_line"] == "done"
    assert 60 <= measured["peak_rss_mib"] < 150, measured
    del ballast


def test_disk_writes_reports_each_minute_once_its_largest_100ms_write_and_its_bursts() -> None:
    """The soak's per-minute disk figures: total, largest 100-ms step, steps of 8 MiB or more; then a fresh minute."""
    disk = soak.DiskWrites()
    disk.steps = [0.5, 12.0, 0.25, 8.0, 7.9]
    assert disk.take() == {"written_mib": pytest.approx(28.65), "max_mib_per_100ms": 12.0, "bursts": 2}
    assert disk.take() is None  # nothing sampled since


@pytest.mark.asyncio
async def test_disk_writes_samples_the_host_disks_written_sectors(tmp_path: Path) -> None:
    """On Linux with a real disk, a written and synced file shows up in the samples."""
    disk = soak.DiskWrites()
    if not disk.disks:
        pytest.skip("no /sys/block disk with a device here")
    if _filesystem(tmp_path) in {"tmpfs", "ramfs"}:
        pytest.skip(f"{tmp_path} is in memory ({_filesystem(tmp_path)}): nothing written to a disk")
    sampling = asyncio.create_task(disk.run())
    await asyncio.sleep(0.15)
    with (tmp_path / "f").open("wb") as f:
        f.write(os.urandom(4 * 1024 * 1024))
        f.flush()
        os.fsync(f.fileno())
    await asyncio.sleep(0.25)
    sampling.cancel()
    taken = disk.take()
    assert taken is not None
    assert taken["written_mib"] >= 4


def test_cpu_shares_counts_the_workers_and_the_producers_cpu_against_the_hosts() -> None:
    """Two processes that spin for 1 s, one as the worker and one as the producer, show up as busy: each a share of a
    core above 0, all the shares together within the host's busy time, to the resolution of the kernel's counters
    (clock ticks: each value can be one tick off at each end). PostgreSQL and the broker: None where none runs here,
    else a share like the others."""
    import psutil  # noqa: PLC0415 - the bench's dependency, not the project's

    # The producer waits for a byte, spins, says so, and stays alive until its stdin closes: a process that has
    # ended cannot be read.
    producer_code = ("import sys, time\nsys.stdin.read(1)\nend = time.process_time() + 1.0\n"
                     "while time.process_time() < end: pass\nprint('spun', flush=True)\nsys.stdin.read()")
    started = time.monotonic()
    with subprocess.Popen([sys.executable, "-c", producer_code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE) as producer:
        assert producer.stdin is not None
        assert producer.stdout is not None
        shares = soak.CpuShares(psutil.Process(), psutil.Process(producer.pid))
        producer.stdin.write(b"x")
        producer.stdin.flush()  # the producer spins now, beside us
        end = time.process_time() + 1.0
        while time.process_time() < end:
            pass
        assert producer.stdout.readline() == b"spun\n"
        taken = shares.take()
        producer.stdin.close()
    host_seconds = (time.monotonic() - started) * psutil.cpu_count()
    ticks_pct = 100 * 2 / os.sysconf("SC_CLK_TCK") / host_seconds
    assert taken["worker_cpu_pct"] is not None
    assert taken["worker_cpu_pct"] > 0
    assert taken["producer_cpu_pct"] is not None
    assert taken["producer_cpu_pct"] > 0
    assert 0 < taken["host_busy_pct"] <= 100
    named = [taken[f"{n}_cpu_pct"] for n in ("worker", "producer", "postgres", "broker")]
    assert all(v is None or v >= 0 for v in named)
    # The same CPU time, counted once.
    assert taken["host_busy_pct"] >= sum(v or 0.0 for v in named) / psutil.cpu_count() - 4 * ticks_pct


def _filesystem(path: Path) -> str:
    """The type of the file system `path` is on: that of its longest mount point."""
    import psutil  # noqa: PLC0415 - the bench's dependency, not the project's

    resolved = path.resolve()
    mounts = [m for m in psutil.disk_partitions(all=True) if resolved.is_relative_to(m.mountpoint)]
    return max(mounts, key=lambda m: len(m.mountpoint)).fstype if mounts else "unknown"


def test_commit_times_pairs_each_partitions_batches_with_their_commit_and_fetch_times(tmp_path: Path) -> None:
    """The soak splits each row's latency at the moment the worker took its batch: the worker logs that moment with
    each committed batch; a worker that does not (an older one, run through PYTHONPATH) gives NaN, not a guess."""
    log = tmp_path / "worker.log"
    lines = [
        {"event": "batch.committed", "timestamp": "2026-12-01T10:00:00.500000Z", "fetched": 1764583200.25,
         "batch": {"3": [10, 19, 1], "7": [0, 4, 1]}},
        {"event": "worker.starting", "timestamp": "2026-12-01T10:00:00.600000Z"},
        {"event": "batch.committed", "timestamp": "2026-12-01T10:00:00.100000Z", "batch": {"3": [0, 9, 1]}},
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    commits = benchkit.commit_times([log])
    lasts, ats, fetched = commits[3]
    assert lasts == [9, 19]  # in offset order, whatever the order of the lines
    assert ats == [datetime(2026, 12, 1, 10, 0, 0, 100_000, tzinfo=UTC).timestamp(),
                   datetime(2026, 12, 1, 10, 0, 0, 500_000, tzinfo=UTC).timestamp()]
    assert fetched[0] != fetched[0]  # NaN: not logged
    assert fetched[1] == 1764583200.25
    assert commits[7] == ([4], [ats[1]], [1764583200.25])
