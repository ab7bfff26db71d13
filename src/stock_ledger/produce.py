"""A deterministic load generator: the same seed always produces the same movements, keyed by SKU."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Final

from stock_ledger.clients import kafka
from stock_ledger.domain import Movement, encode
from stock_ledger.progress import Progress

if TYPE_CHECKING:
    from collections.abc import Iterator

    from stock_ledger.config import Settings

_BASE: Final = datetime(2026, 1, 1, tzinfo=UTC)
# (kind, weight, sign): picks dominate a warehouse's day; receipts keep stock positive on average.
_KINDS: Final = (("receipt", 30, 1), ("pick", 40, -1), ("return", 5, 1), ("transfer_in", 10, 1),
                 ("transfer_out", 10, -1), ("adjustment", 5, 0))


def movements(count: int, skus: int = 1000, warehouses: int = 4, seed: int = 1) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) pairs of valid movements."""
    rng = random.Random(seed)  # noqa: S311 - deterministic test data, not secrets
    kinds = [k for k, *_ in _KINDS]
    weights = [w for _, w, _ in _KINDS]
    signs = {k: s for k, _, s in _KINDS}
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]
        sign = signs[kind] or rng.choice((-1, 1))
        sku = f"SKU-{rng.randrange(skus):06d}"
        movement = Movement(
            movement_id=uuid.UUID(int=rng.getrandbits(128), version=4),
            warehouse_id=f"WH-{rng.randrange(warehouses):03d}",
            sku=sku,
            qty=sign * rng.randint(1, 100),
            kind=kind,  # type: ignore[arg-type]
            occurred_at=_BASE + timedelta(milliseconds=i),
        )
        yield sku.encode(), encode(movement)


async def produce(  # noqa: PLR0913 - the CLI's flags, one to one
    settings: Settings, count: int, *, rate: float | None = None, skus: int = 1000, warehouses: int = 4,
    seed: int = 1, show_progress: bool = True,
) -> int:
    """Send `count` movements to the settings' topic (at `rate` per second if given) with an idempotent producer;
    return the count."""
    topic = settings.topic
    producer = kafka.producer(settings)
    await producer.start()
    progress = Progress(f"produce {topic}", count) if show_progress else None
    pending: list[asyncio.Future[object]] = []
    started = time.monotonic()
    try:
        for i, (key, value) in enumerate(movements(count, skus, warehouses, seed)):
            if rate and i % 50 == 0:
                ahead = started + i / rate - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
            pending.append(await producer.send(topic, value=value, key=key))
            if len(pending) >= 2000:
                await asyncio.gather(*pending)
                if progress:
                    progress.advance(len(pending))
                pending.clear()
        await producer.flush()
        await asyncio.gather(*pending)
        if progress:
            progress.advance(len(pending))
            progress.finish()
    finally:
        await producer.stop()
    return count

