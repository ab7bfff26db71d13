"""An archived segment on disk: `<segment>.parquet` (every column of its movements, in offset order, zstd) and
`<segment>.manifest.json` beside it, in STOCK_LEDGER_ARCHIVE_DIR. Parquet because analysts already read it (DuckDB,
Spark, pandas, polars) without us; the manifest says what the file must hold, so that the file can be checked
against the segment before the segment is dropped, and against itself (and the database's record of it) any time
later (`archive verify`).

The manifest: the segment and its offsets, the row count and Σ qty, the rows and offsets per Kafka partition, the
first and last occurred_at/applied_at, per (warehouse, sku) the rows, Σ qty and first/last occurred_at (what
archived_sums keeps online), and the file's SHA-256 and size.

Memory follows one chunk of rows and the number of (warehouse, sku) pairs, never the segment's size.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stock_ledger.errors import OperatorError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Sequence
    from pathlib import Path

FORMAT: Final = "stock-ledger-archive/1"
_TIME: Final = pa.timestamp("us", tz="UTC")
SCHEMA: Final = pa.schema([
    ("movement_id", pa.string()), ("warehouse_id", pa.string()), ("sku", pa.string()), ("qty", pa.int64()),
    ("kind", pa.string()), ("occurred_at", _TIME), ("kafka_topic", pa.string()), ("kafka_partition", pa.int32()),
    ("kafka_offset", pa.int64()), ("kafka_timestamp", _TIME), ("applied_at", _TIME),
])
# Rows per row group: a reader filtering by offset or time skips whole groups by their statistics.
ROW_GROUP: Final = 250_000
_READ_CHUNK: Final = 65_536

Key = tuple[str, str]  # (warehouse_id, sku)


@dataclass
class Summary:
    """What a segment or a file holds, summed the same way on both sides (SQL in ledger/archives.py, here)."""

    rows: int = 0
    qty: int = 0
    keys: dict[Key, list[Any]] = field(default_factory=dict)  # -> [rows, Σ qty, first occurred_at, last occurred_at]
    partitions: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # -> [rows, first offset, last offset]
    occurred: list[datetime] = field(default_factory=list)  # [first, last], empty when no rows
    applied: list[datetime] = field(default_factory=list)

    def add(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        self.rows += table.num_rows
        self.qty += int(pc.sum(table["qty"]).as_py())
        by_key = table.group_by(["warehouse_id", "sku"]).aggregate(
            [("qty", "count"), ("qty", "sum"), ("occurred_at", "min"), ("occurred_at", "max")])
        for w, s, n, q, lo, hi in zip(*(by_key[c].to_pylist() for c in (
                "warehouse_id", "sku", "qty_count", "qty_sum", "occurred_at_min", "occurred_at_max")), strict=True):
            self.add_key((w, s), n, q, lo, hi)
        by_partition = table.group_by(["kafka_topic", "kafka_partition"]).aggregate(
            [("kafka_offset", "count"), ("kafka_offset", "min"), ("kafka_offset", "max")])
        for t, p, n, lo, hi in zip(*(by_partition[c].to_pylist() for c in (
                "kafka_topic", "kafka_partition", "kafka_offset_count", "kafka_offset_min", "kafka_offset_max")),
                                   strict=True):
            was = self.partitions.get((t, p))
            self.partitions[(t, p)] = [n, lo, hi] if was is None else [was[0] + n, min(was[1], lo), max(was[2], hi)]
        for name, span in (("occurred_at", self.occurred), ("applied_at", self.applied)):
            low, high = (x.as_py() for x in pc.min_max(table[name]).values())
            span[:] = [low, high] if not span else [min(span[0], low), max(span[1], high)]

    def add_key(self, key: Key, rows: int, qty: int, first: datetime, last: datetime) -> None:
        was = self.keys.get(key)
        self.keys[key] = ([rows, qty, first, last] if was is None
                          else [was[0] + rows, was[1] + qty, min(was[2], first), max(was[3], last)])

    def differences(self, other: Summary, *, limit: int = 5) -> list[str]:
        """How `other` differs from this one, in words (at most `limit` (warehouse, sku) pairs named)."""
        found = []
        if (self.rows, self.qty) != (other.rows, other.qty):
            found.append(f"rows {self.rows} vs {other.rows}, Σ qty {self.qty} vs {other.qty}")
        if self.partitions != other.partitions:
            found.append(f"offsets per Kafka partition {_runs(self.partitions)} vs {_runs(other.partitions)}")
        keys = sorted(k for k in self.keys.keys() | other.keys.keys() if self.keys.get(k) != other.keys.get(k))
        found += [f"{w}/{s}: {self.keys.get((w, s))} vs {other.keys.get((w, s))}" for w, s in keys[:limit]]
        if len(keys) > limit:
            found.append(f"... {len(keys) - limit} more (warehouse, sku) pairs differ")
        return found

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows, "qty": self.qty,
            "kafka": [{"topic": t, "partition": p, "rows": v[0], "first_offset": v[1], "last_offset": v[2]}
                      for (t, p), v in sorted(self.partitions.items())],
            "occurred_at": [_iso(x) for x in self.occurred], "applied_at": [_iso(x) for x in self.applied],
            "sums": [[w, s, v[0], v[1], _iso(v[2]), _iso(v[3])] for (w, s), v in sorted(self.keys.items())],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        return cls(
            rows=d["rows"], qty=d["qty"],
            keys={(w, s): [n, q, _time(lo), _time(hi)] for w, s, n, q, lo, hi in d["sums"]},
            partitions={(k["topic"], k["partition"]): [k["rows"], k["first_offset"], k["last_offset"]]
                        for k in d["kafka"]},
            occurred=[_time(x) for x in d["occurred_at"]], applied=[_time(x) for x in d["applied_at"]],
        )

    def key_sums(self) -> Iterator[tuple[str, str, int, int, datetime, datetime]]:
        for (w, s), (n, q, lo, hi) in sorted(self.keys.items()):
            yield w, s, n, q, lo, hi


@dataclass
class Manifest:
    segment: str
    kafka_partition: int
    first_offset: int
    end_offset: int
    summary: Summary
    sha256: str
    bytes: int
    unknown_offsets: int
    created_at: str
    created_by: str

    @property
    def file(self) -> str:
        return f"{self.segment}.parquet"

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "segment": self.segment, "kafka_partition": self.kafka_partition,
                "first_offset": self.first_offset, "end_offset": self.end_offset, "file": self.file,
                "sha256": self.sha256, "bytes": self.bytes, "unknown_offsets": self.unknown_offsets,
                "created_at": self.created_at, "created_by": self.created_by, **self.summary.as_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        if d.get("format") != FORMAT:
            raise OperatorError(f"manifest of {d.get('segment')!r} has format {d.get('format')!r}, not {FORMAT}")
        return cls(d["segment"], d["kafka_partition"], d["first_offset"], d["end_offset"], Summary.from_dict(d),
                   d["sha256"], d["bytes"], d["unknown_offsets"], d["created_at"], d["created_by"])


def paths(directory: Path, segment: str) -> tuple[Path, Path]:
    """(the Parquet file, its manifest)."""
    return directory / f"{segment}.parquet", directory / f"{segment}.manifest.json"


def _table(chunk: Sequence[Sequence[Any]]) -> pa.Table:
    columns = list(zip(*chunk, strict=True))
    columns[0] = tuple(str(x) for x in columns[0])  # movement_id: text, what every reader shows
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, SCHEMA, strict=True)],
                                schema=SCHEMA)


async def write(path: Path, chunks: AsyncIterator[Sequence[Sequence[Any]]]) -> Summary:
    """Write the rows (in SCHEMA's column order) to `path` through a temporary file, fsynced and renamed into place
    only when complete; the summary of what was written."""
    partial = path.with_name(path.name + ".partial")
    summary = Summary()
    with pq.ParquetWriter(partial, SCHEMA, compression="zstd") as writer:
        async for chunk in chunks:
            table = _table(chunk)
            writer.write_table(table, row_group_size=ROW_GROUP)
            summary.add(table)
    _sync_rename(partial, path)
    return summary


def summarize(path: Path) -> Summary:
    """Read the whole file back and sum it (a chunk at a time); OperatorError if it is not an archive file."""
    try:
        reader = _open(path)
    except (OSError, pa.ArrowException) as exc:
        raise OperatorError(f"{path} cannot be read as Parquet ({exc}): the file is damaged; restore it from a "
                            "backup of the archive directory") from exc
    if not reader.schema_arrow.equals(SCHEMA):
        raise OperatorError(f"{path} does not have the archive's columns ({reader.schema_arrow}): not an archive "
                            "file of this ledger")
    summary = Summary()
    for batch in reader.iter_batches(batch_size=_READ_CHUNK):
        summary.add(pa.Table.from_batches([batch], schema=SCHEMA))
    return summary


def batches(path: Path) -> Iterator[list[tuple[Any, ...]]]:
    """The file's rows in SCHEMA's column order, a chunk at a time (for a restore)."""
    for batch in _open(path).iter_batches(batch_size=_READ_CHUNK):
        yield list(zip(*(batch.column(i).to_pylist() for i in range(batch.num_columns)), strict=True))


def _open(path: Path) -> pq.ParquetFile:
    # pre_buffer (pyarrow's default) keeps what iter_batches has read, so memory would grow with the file (measured:
    # +30 MiB per million movements); without it a read holds one row group.
    return pq.ParquetFile(path, pre_buffer=False)


def sha256(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def write_manifest(path: Path, manifest: Manifest) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(manifest.as_dict(), indent=1) + "\n")
    _sync_rename(partial, path)


def read_manifest(path: Path) -> Manifest:
    try:
        return Manifest.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise OperatorError(f"{path} is missing: the archive directory is not the one the segment was archived to "
                            "(STOCK_LEDGER_ARCHIVE_DIR), or the file was removed; restore it from a backup") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise OperatorError(f"{path} is not a readable manifest ({exc}): restore it from a backup") from exc


def now() -> str:
    return datetime.now(UTC).isoformat()


def _sync_rename(partial: Path, path: Path) -> None:
    """fsync the file, rename it into place, fsync the directory: after a crash, the name holds all of it or is
    absent."""
    fd = os.open(partial, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    partial.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _iso(value: datetime) -> str:
    return value.isoformat()


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _runs(partitions: dict[tuple[str, int], list[int]]) -> str:
    return ", ".join(f"{t}/{p}: {v[0]} rows [{v[1]}, {v[2]}]" for (t, p), v in sorted(partitions.items())) or "none"


def sums_until(path: Path, warehouse: str, skus: Sequence[str], at: datetime) -> dict[str, int]:
    """sku -> Σ qty of the file's movements of `warehouse` and `skus` that occurred at or before `at`: what `stock
    show --at` adds for the pairs whose movements in an archived segment lie on both sides of `at`. Row groups whose
    statistics exclude the filter are skipped."""
    where = [("warehouse_id", "=", warehouse), ("sku", "in", list(skus)),
             ("occurred_at", "<=", pa.scalar(at, type=_TIME))]
    try:
        table = pq.read_table(path, columns=["sku", "qty"], filters=where, pre_buffer=False)
    except FileNotFoundError:
        raise OperatorError(f"{path} is missing: set STOCK_LEDGER_ARCHIVE_DIR to the directory the segment was "
                            "archived to (see `stock-ledger archive list`)") from None
    if table.num_rows == 0:
        return {}
    by_sku = table.group_by("sku").aggregate([("qty", "sum")])
    return dict(zip(by_sku["sku"].to_pylist(), by_sku["qty_sum"].to_pylist(), strict=True))
