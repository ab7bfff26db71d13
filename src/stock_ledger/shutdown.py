"""Shutdown: the signals that ask for it (`Worker.handle_exit` answers them: the first drains, a second exits at
once) and the teardown of what the worker started: every task cancelled, then awaited; the consumer out of the
group."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import TYPE_CHECKING

import structlog
from aiokafka.errors import KafkaError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from aiokafka import AIOKafkaConsumer

# One logger name for the worker's events, whichever of its modules logs them.
log = structlog.get_logger("stock_ledger.service")

_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def exit_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[signal.Signals], None]) -> Iterator[None]:
    """`handler(sig)` on SIGTERM and SIGINT, while inside."""
    for sig in _EXIT_SIGNALS:
        loop.add_signal_handler(sig, handler, sig)
    try:
        yield
    finally:
        for sig in _EXIT_SIGNALS:
            loop.remove_signal_handler(sig)


async def cancel(*tasks: asyncio.Task[None] | None) -> None:
    """Cancel each task (None: never started), then wait for it to end; what it raised on the way out is dropped."""
    for task in tasks:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def close_consumer(consumer: AIOKafkaConsumer) -> None:
    try:
        # Leaving the group promptly hands our partitions to the survivors without waiting for a timeout.
        await asyncio.wait_for(consumer.stop(), 10)
    except (TimeoutError, KafkaError) as exc:
        log.warning("kafka.close_failed", error=str(exc))
