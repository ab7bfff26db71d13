"""`stock-ledger archive list|verify|restore`: what was archived, whether each archive still holds exactly that, and
one archive back in the database for an audit.

`verify` checks three things against each other: the file (its SHA-256 and size, and its rows summed again), its
manifest, and what the ledger recorded when it archived the segment (ledger_archives, archived_sums). A file or a
manifest changed after archival, a file cut short, or sums that no longer agree are each named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stock_ledger.archive import parquet
from stock_ledger.archive.run import archive_dir, segment_summary
from stock_ledger.errors import OperatorError
from stock_ledger.ledger import archives

if TYPE_CHECKING:
    import asyncpg

    from stock_ledger.config import Settings


@dataclass
class Verdict:
    segment: str
    rows: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


async def recorded(conn: asyncpg.Connection, segment: str) -> asyncpg.Record:
    found = await archives.archives(conn, archives.table_name(segment))
    if not found:
        raise OperatorError(f"no archive of {segment} is recorded in this ledger: see `stock-ledger archive list`")
    return found[0]


async def verify(settings: Settings, conn: asyncpg.Connection, segment: str) -> Verdict:
    r = await recorded(conn, segment)
    directory = archive_dir(settings, writable=False)
    path, manifest_path = parquet.paths(directory, segment)
    verdict = Verdict(segment, r["rows"])
    if not path.exists():
        verdict.problems.append(f"{path} is missing (is STOCK_LEDGER_ARCHIVE_DIR the directory it was archived to?)")
        return verdict
    sha256, size = parquet.sha256(path)
    if (sha256, size) != (r["sha256"], r["bytes"]):
        verdict.problems.append(f"{path.name} has SHA-256 {sha256} and {size} bytes; when archived it had "
                                f"{r['sha256']} and {r['bytes']}: the file was changed or replaced")
    try:
        manifest = parquet.read_manifest(manifest_path)
    except OperatorError as exc:
        verdict.problems.append(str(exc))
        manifest = None
    if manifest is not None and (manifest.sha256, manifest.bytes) != (r["sha256"], r["bytes"]):
        verdict.problems.append(f"{manifest_path.name} names SHA-256 {manifest.sha256}, the ledger recorded "
                                f"{r['sha256']}: the manifest was changed or belongs to another file")
    try:
        summary = parquet.summarize(path)
    except OperatorError as exc:
        verdict.problems.append(str(exc))
        return verdict
    if manifest is not None and (differs := manifest.summary.differences(summary)):
        verdict.problems.append(f"the file's rows do not sum to its manifest: {'; '.join(differs)}")
    online = parquet.Summary(rows=r["rows"], qty=int(r["qty"]))
    for s in await archives.archived_sums(conn, segment):
        online.add_key((s[0], s[1]), s[2], s[3], s[4], s[5])
    if differs := _sums(online).differences(_sums(summary)):
        verdict.problems.append(f"the file's rows do not sum to what the ledger counts for them (archived_sums): "
                                f"{'; '.join(differs)}")
    return verdict


def _sums(summary: parquet.Summary) -> parquet.Summary:
    """Only what archived_sums keeps: rows, Σ qty, and per (warehouse, sku)."""
    return parquet.Summary(rows=summary.rows, qty=summary.qty, keys=summary.keys)


async def restore(settings: Settings, conn: asyncpg.Connection, segment: str) -> tuple[str, int]:
    """The archive, verified first, as the table restored_<segment>; (its name, its rows)."""
    verdict = await verify(settings, conn, segment)
    if not verdict.ok:
        raise OperatorError(f"the archive of {segment} does not verify, so it was not restored: "
                            + "; ".join(verdict.problems))
    table = archives.restored_name(segment)
    if await archives.table_exists(conn, table):
        raise OperatorError(f"{table} exists already (an earlier restore): query it, or drop it and restore again")
    path, _ = parquet.paths(archive_dir(settings, writable=False), segment)
    await archives.create_restored(conn, segment, settings.reader_role, parquet.batches(path))
    restored = await segment_summary(conn, table)
    if differs := parquet.summarize(path).differences(restored):
        raise OperatorError(f"{table} does not sum to the archive ({'; '.join(differs)}): drop it and restore again")
    return table, restored.rows


def listing(rows: list[asyncpg.Record]) -> list[dict[str, Any]]:
    return [dict(r) for r in rows]
