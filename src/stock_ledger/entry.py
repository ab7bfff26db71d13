"""The `stock-ledger` console entry point, and `python -m stock_ledger`'s.

A SIGTERM that arrives while the command's modules are still importing (a second or more on a busy node) would be
lost: as a container's PID 1 the process has no default action for it, so a pod stopped right after a restart ran
on until the SIGKILL at the end of its grace period. The signal is held from here on and acted on as soon as the
command can: nothing has started yet, so it stops at once (`run` exits 0: it has nothing to drain).
"""

from __future__ import annotations

import signal


def main() -> int:
    held: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    from stock_ledger.cli.main import main as run  # noqa: PLC0415 - only once the signal is held: the point of this module

    return run(sigterm_held=held)
