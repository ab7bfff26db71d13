"""Claiming assigned partitions: the epoch (fencing token), the offset to seek to, and the log's holes.

A claim runs in the main loop, never in the rebalance callback (aiokafka sends no heartbeats while that runs, and
a claim can wait on a zombie's lock). For each pending partition it
  1. bumps the epoch in PostgreSQL, guarded by Kafka's group generation (ledger.claims.Claims.claim),
     terminating zombie sessions of this group that block it;
  2. resolves the seek position: the stored offset; the reset policy where none is stored; and where the stored
     offset lies outside the log (retention, deleted records, a recreated topic), STOCK_LEDGER_ON_GAP decides:
     `halt` keeps the partition paused and says why, `record` writes the hole to ledger_gaps in the transaction
     that moves the offset past it (below the log start only: past the log end the log was replaced, and moving
     anywhere would re-apply coordinates already in the ledger);
  3. seeks and resumes, unless a rebalance made the claim stale meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Final

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError

from stock_ledger.clients.database import session_name
from stock_ledger.clients.servers import Server, writable_server
from stock_ledger.errors import Mismatch, OffsetMismatchError, StockLedgerError
from stock_ledger.gaps import Gap, find_gap
from stock_ledger.ledger import offsets
from stock_ledger.ledger.claims import Unblock

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    import asyncpg
    from aiokafka import AIOKafkaConsumer

    from stock_ledger.config import Settings
    from stock_ledger.consumer.assignment import Assignment
    from stock_ledger.errors import FencedError
    from stock_ledger.ledger.claims import Claim, Claims
    from stock_ledger.metrics import Metrics

log = structlog.get_logger(__name__)

GAP_RECHECK_SECONDS: Final = 30.0


class Claimer:
    def __init__(  # noqa: PLR0913, PLR0917 - its collaborators, each injected so tests can replace them
        self, settings: Settings, claims: Claims, assignment: Assignment, consumer: AIOKafkaConsumer,
        metrics: Metrics, connect: Callable[[], Awaitable[asyncpg.Connection]],
    ) -> None:
        self._s = settings
        self._claims = claims
        self._assignment = assignment
        self._consumer = consumer
        self._metrics = metrics
        self._unblock = Unblock(settings.lock_timeout_ms / 2000, connect, session_name(settings.group_id))
        self._refused_since: float | None = None
        self._last_recheck = time.monotonic()
        self._server: Server | None = None

    def generation(self) -> tuple[int | None, str | None]:
        # aiokafka exposes neither publicly (NOTES.md); the generation guards the claim, the member id is shown.
        coordinator = getattr(self._consumer, "_coordinator", None)
        generation = getattr(coordinator, "generation", None)
        member_id = getattr(coordinator, "member_id", None)
        return (generation if isinstance(generation, int) and generation >= 0 else None,
                member_id if isinstance(member_id, str) and member_id else None)

    async def claim(self, conn: asyncpg.Connection) -> None:
        """Claim every pending partition (see the module docstring). Safe to retry as a whole."""
        ticket = self._assignment.begin_claim()
        if not ticket.partitions:
            return
        generation, member_id = self.generation()
        reset = await self._reset_positions(ticket.partitions)
        self._claims.faults.reached("before_claim")
        claims = await self._claims.claim(conn, self._s.topic, ticket.partitions, generation, member_id,
                                          force=self._force_due(), unblock=self._unblock, reset=reset)
        if self._note_refused(ticket.partitions, claims, generation):
            # Stale: the rebalance that tells us so arrives with a heartbeat; claiming in a tight loop meanwhile
            # would only load the database.
            await asyncio.sleep(min(1.0, self._s.session_timeout_ms / 3000))
        starts, halted = await self._positions(conn, claims)
        if not self._assignment.claimed(ticket, starts, {p: g.describe() for p, g in halted.items()}):
            return  # a newer rebalance happened meanwhile; its own claim (a newer epoch) supersedes this one
        for p, (_, offset) in starts.items():
            self._consumer.seek(self._tp(p), offset)
        self._consumer.resume(*[self._tp(p) for p in starts])
        self._metrics.claims.inc(len(starts))
        self._metrics.assigned_partitions.set(len(self._assignment.epochs))
        log.info("claim.done", generation=generation, member_id=member_id,
                 claims={p: {"epoch": e, "seek": o} for p, (e, o) in starts.items()})

    def _force_due(self) -> bool:
        """A claim refused for a newer stored generation means this member is stale; it learns so within a few
        heartbeats. Refused for longer, with no rebalance, the group itself restarted its generations (it was
        deleted, or expired while empty): the stored generations are from a previous life of the group."""
        limit = 3 * self._s.session_timeout_ms / 1000
        known = self.generation()[0] is not None  # an unknown generation never forces (the SQL refuses it too)
        return known and self._refused_since is not None and time.monotonic() - self._refused_since > limit

    def _note_refused(self, wanted: Sequence[int], claims: list[Claim], generation: int | None) -> bool:
        refused = sorted(set(wanted) - {c.partition for c in claims})
        if not refused:
            self._refused_since = None
            return False
        self._refused_since = self._refused_since or time.monotonic()
        log.warning("claim.superseded", partitions=refused, generation=generation,
                    detail="a claim of a newer group generation owns these partitions; waiting for the rebalance")
        return True

    async def _positions(self, conn: asyncpg.Connection,
                         claims: list[Claim]) -> tuple[dict[int, tuple[int, int]], dict[int, Gap]]:
        """partition -> (epoch, offset to seek to); and the partitions halted on a hole."""
        if not claims:
            return {}, {}
        tps = [self._tp(c.partition) for c in claims]
        lows, highs = await self._consumer.beginning_offsets(tps), await self._consumer.end_offsets(tps)
        starts: dict[int, tuple[int, int]] = {}
        halted: dict[int, Gap] = {}
        for c, tp in zip(claims, tps, strict=True):
            low, high = int(lows[tp]), int(highs[tp])
            if c.next_offset is None:
                raise StockLedgerError(
                    f"no stored offset for partition {c.partition} and STOCK_LEDGER_AUTO_OFFSET_RESET=none: set it "
                    "to earliest to apply the whole history")
            if c.reset:
                log.info("claim.reset_policy", policy=self._s.auto_offset_reset, partition=c.partition,
                         offset=c.next_offset, detail="nothing was stored: this start is stored with the claim")
            if c.resumed:
                log.error("claim.resumed_from_ledger", partition=c.partition, offset=c.next_offset,
                          policy=self._s.auto_offset_reset, log_start=low, log_end=high,
                          detail=f"nothing was stored for partition {c.partition}, but the ledger holds its records "
                                 f"up to offset {c.next_offset - 1}: it was claimed before and its consumer_offsets "
                                 "row was lost (a restore or failover to a point before its first claim, a row "
                                 f"deleted by hand); resuming at {c.next_offset}, not at the reset policy's start"
                                 + ("; what retention deleted since cannot be applied: a hole" if c.next_offset < low
                                    else ""),
                          action="find out how the row was lost; `stock-ledger verify`")
            gap = find_gap(c.partition, c.next_offset, low, high)
            if gap is None:
                starts[c.partition] = (c.epoch, c.next_offset)
            elif gap.skippable and self._s.on_gap == "record":
                gap_id = await self._claims.skip_gap(conn, self._s.topic, gap, c.epoch)
                log.error("gap.recorded", partition=c.partition, gap_id=gap_id, first=gap.first_offset,
                          last=gap.last_offset, detail=gap.describe(),
                          action="reconcile stock by hand, then `stock-ledger gaps ack ID --note ...`")
                if gap_id is not None:
                    starts[c.partition] = (c.epoch, low)
            else:
                log.error("gap.halted", partition=c.partition, first=gap.first_offset, last=gap.last_offset,
                          detail=gap.describe(), action=gap.remedy())
                halted[c.partition] = gap
        return starts, halted

    async def _reset_positions(self, partitions: Sequence[int]) -> dict[int, int]:
        """Where the reset policy would start each partition, for the claim to store where nothing is stored yet
        (read before the claim; the holes are judged on log bounds read after it, see `_positions`)."""
        policy = self._s.auto_offset_reset
        if policy == "none":
            return {}
        tps = [self._tp(p) for p in partitions]
        bounds = await (self._consumer.beginning_offsets(tps) if policy == "earliest"
                        else self._consumer.end_offsets(tps))
        return {tp.partition: int(bounds[tp]) for tp in tps}

    async def check_session(self, conn: asyncpg.Connection) -> None:
        """Run on every new session before it writes: refuse a server that cannot take writes, log a change of
        server, and claim again each held partition whose stored offset is behind what this worker committed (the
        database went back in time: a failover to a standby that lost commits, a restore), so the lost range is
        re-applied from Kafka now, not when the partition's next record arrives. Offsets ahead of ours are left to
        the batch guard: an earlier attempt of the batch in flight may have committed with its reply lost."""
        server = await writable_server(conn)
        if self._server is not None and server != self._server:
            log.warning("db.server_changed", before=self._server.describe(), after=server.describe(),
                        detail="a reconnect reached another server (a failover?): checking the stored offsets")
        self._server = server
        await self.check_offsets(conn)

    async def check_offsets(self, conn: asyncpg.Connection) -> None:
        """Claim again each held partition whose stored offset is behind what this worker committed (see
        `check_session`); also run while idle, when no batch guard would look (a restore on the same server)."""
        held = self._assignment.committed_positions
        if not held:
            return
        current = await offsets.current(conn, self._s.group_id, self._s.topic, held)
        lost: dict[int, Mismatch] = {}
        for p, (epoch, expected) in held.items():
            stored_epoch, stored = current.get(p, (None, None))
            if stored_epoch is not None and stored_epoch > epoch:
                continue  # a newer claim: the batch guard fences us
            if stored_epoch is None or stored_epoch < epoch or stored is None or stored < expected:
                lost[p] = Mismatch(expected, stored_epoch, stored)
        if lost:
            self.mismatched(OffsetMismatchError(lost), {p: held[p][0] for p in lost}, found_by="session_check")

    def mismatched(self, exc: OffsetMismatchError, epochs: Mapping[int, int], found_by: str = "batch_guard") -> None:
        """The stored offsets are not where this worker left them (see errors.Mismatch). Nothing was written past
        them; each partition is claimed again (a new epoch, seek to the stored offset), so whatever the database
        lost is re-applied from Kafka, or, if Kafka no longer has it, halts or is recorded as a hole like any other.
        `epochs`: the epoch each partition was written under; one no longer held so was reported already."""
        fresh = {p: m for p, m in exc.partitions.items() if self._assignment.epochs.get(p) == epochs.get(p)}
        if not fresh:
            return
        for m in fresh.values():
            self._metrics.offset_mismatches.labels(m.direction).inc()
        log.error("batch.offset_mismatch", found_by=found_by,
                  partitions={p: {"expected": m.expected, "stored": m.stored, "stored_epoch": m.epoch,
                                  "direction": m.direction} for p, m in sorted(fresh.items())},
                  detail="; ".join(f"partition {p}: {m.describe()}" for p, m in sorted(fresh.items())),
                  action="claiming again at the stored offsets; see the runbook, StockLedgerOffsetMismatch")
        self.reexamine(list(fresh), reason="stored offset moved under this worker")

    def reexamine(self, partitions: Sequence[int], reason: str) -> None:
        """Claim these again (their position must be resolved afresh); paused until then."""
        log.warning("claim.reexamine", partitions=sorted(partitions), reason=reason)
        self._pause(partitions)
        self._assignment.reclaim(partitions)

    def recheck_due(self) -> bool:
        """Halted partitions are claimed again now and then: an operator may have moved their offset."""
        if not self._assignment.halted or time.monotonic() - self._last_recheck < GAP_RECHECK_SECONDS:
            return False
        self._last_recheck = time.monotonic()
        self._assignment.reclaim(list(self._assignment.halted))
        return True

    async def fenced(self, exc: FencedError, conn: asyncpg.Connection | None) -> None:
        self._metrics.fenced.inc()
        log.warning("batch.fenced", partitions={p: {"ours": o, "stored": s} for p, (o, s) in exc.partitions.items()},
                    detail="another worker claimed these partitions; not writing them until they are claimed again")
        self._pause(list(exc.partitions))
        self._assignment.fenced(exc.partitions, time.monotonic())
        self._metrics.assigned_partitions.set(len(self._assignment.epochs))
        if conn is not None:
            await self._exit_if_replaced(conn, list(exc.partitions))

    async def _exit_if_replaced(self, conn: asyncpg.Connection, partitions: list[int]) -> None:
        """With static membership, a claim by a newer process with our instance id means we are the zombie of a
        force-deleted pod: aiokafka would keep rejoining and the two would take turns fencing each other. Exit."""
        instance = self._s.group_instance_id
        if not instance:
            return
        _, ours = self.generation()
        try:
            found = await offsets.owners(conn, self._s.group_id, self._s.topic, partitions)
        except Exception as exc:
            log.info("claim.owner_check_failed", error=f"{type(exc).__name__}: {exc}", detail="asked again next fence")
            return
        for partition, owner in found.items():
            # Kafka names a static member "<group.instance.id>-<uuid>".
            if owner and owner != ours and owner.startswith(f"{instance}-"):
                raise StockLedgerError(
                    f"partition {partition} was claimed by member {owner}, a newer process with this "
                    f"STOCK_LEDGER_GROUP_INSTANCE_ID={instance}: this process is a zombie and exits"
                )

    def check_fenced_partitions(self) -> None:
        """A fenced partition that Kafka still assigns to us and never reassigns would stall: restart instead."""
        assigned = [tp.partition for tp in self._consumer.assignment()]
        p = self._assignment.overdue_fenced(assigned, time.monotonic(), 3 * self._s.session_timeout_ms / 1000)
        if p is not None:
            raise StockLedgerError(
                f"partition {p} stayed assigned to this worker after it was fenced, but was not reassigned: "
                "exiting so the restart rejoins the group with a fresh claim"
            )

    def _pause(self, partitions: Sequence[int]) -> None:
        assigned = self._consumer.assignment()
        with contextlib.suppress(IllegalStateError):
            self._consumer.pause(*[tp for tp in map(self._tp, partitions) if tp in assigned])

    def _tp(self, partition: int) -> TopicPartition:
        return TopicPartition(self._s.topic, partition)
