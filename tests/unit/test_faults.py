"""Test-only crash points (STOCK_LEDGER_FAULT): the spec is validated at start and fires on the n-th visit only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from stock_ledger import faults
from stock_ledger.errors import ConfigError
from stock_ledger.faults import POINTS, Faults


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, signal.Signals]]:
    """Record the signals a Faults would send itself instead of sending them."""
    sent: list[tuple[int, signal.Signals]] = []
    monkeypatch.setattr(
        faults, "os", SimpleNamespace(getpid=os.getpid, kill=lambda pid, sig: sent.append((pid, sig)))
    )
    return sent


class TestSpec:
    """`point[@n][:kill|stop]`, comma-separated; anything else is a configuration error."""

    def test_the_points_are_the_crash_points_in_batch_order(self) -> None:
        """The four moments of the first issue, plus `during_copy` (a worker frozen mid-COPY) and `before_claim` (a
        claim delayed across a rebalance) of the hardening issue, then the monitor's `during_closing`."""
        assert POINTS == ("before_claim", "after_read", "during_copy", "after_rows", "before_commit", "after_commit",
                          "during_closing")

    @pytest.mark.parametrize("spec", [None, "", " ", ",", " , "])
    def test_no_spec_arms_nothing(self, spec: str | None) -> None:
        """Unset (production) is inert."""
        assert not Faults(spec)

    @pytest.mark.parametrize(
        "spec",
        [
            "after_read",
            "after_rows@3",
            "before_commit:stop",
            "after_commit@2:kill",
            "after_rows@10:stop",
            " after_read , after_rows@2:stop ",
            "after_rows@1:stop,after_rows@3:kill",
            "after_read:hang",
            "after_read@4:hang,after_commit@2",
            *POINTS,
        ],
    )
    def test_a_good_spec_arms_faults(self, spec: str) -> None:
        """Every point, an optional 1-based count, an optional action (kill, stop; hang at after_read only);
        spaces around items are tolerated."""
        assert Faults(spec)

    @pytest.mark.parametrize(
        "spec",
        [
            "nowhere",
            "after-rows",
            "AFTER_ROWS",
            "after_rows:explode",
            "after_rows:kill:stop",
            "after_rows@x",
            "after_rows@-1",
            "after_rows@1.5",
            "after_rows@ 2",
            "after_read,bogus",
            "@2:kill",
            ":kill",
            "after_rows@0",
            "after_rows@\u00b2",
            "after_rows:hang",
            "after_commit@2:hang",
        ],
        ids=lambda s: s.encode("unicode_escape").decode(),
    )
    def test_a_bad_spec_is_a_config_error_naming_the_variable(self, spec: str) -> None:
        """A typo must fail loudly at start (exit 2), never leave a crash test that silently never crashes.
        @0 would never fire (counts are 1-based) and a non-ASCII digit like '²' must not escape as a ValueError;
        hang is only meaningful where the main loop waits (after_read)."""
        with pytest.raises(ConfigError) as caught:
            Faults(spec)
        assert "STOCK_LEDGER_FAULT" in str(caught.value)


class TestReached:
    """The n-th visit of an armed point, and only that one, sends the signal to the process itself."""

    def test_an_unarmed_fault_set_never_signals(self, kills: list[tuple[int, signal.Signals]]) -> None:
        """Production: every point can be reached any number of times."""
        f = Faults(None)
        assert [f.reached(point) for point in POINTS * 3] == [False] * (3 * len(POINTS))
        assert kills == []

    def test_the_nth_visit_kills_and_no_other(self, kills: list[tuple[int, signal.Signals]]) -> None:
        """after_rows@3: visits 1 and 2 pass, visit 3 sends SIGKILL to our own pid, visits 4 and 5 pass."""
        f = Faults("after_rows@3")
        seen = []
        for visit in range(1, 6):
            assert f.reached("after_rows") is False
            seen.append((visit, len(kills)))
        assert seen == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
        assert kills == [(os.getpid(), signal.SIGKILL)]

    def test_the_default_is_the_first_visit_and_kill(self, kills: list[tuple[int, signal.Signals]]) -> None:
        """`before_commit` alone means `before_commit@1:kill`."""
        f = Faults("before_commit")
        f.reached("before_commit")
        assert kills == [(os.getpid(), signal.SIGKILL)]

    def test_stop_sends_sigstop(self, kills: list[tuple[int, signal.Signals]]) -> None:
        """`:stop` freezes the process (a long GC pause) instead of killing it."""
        f = Faults("after_commit@2:stop")
        f.reached("after_commit")
        f.reached("after_commit")
        assert kills == [(os.getpid(), signal.SIGSTOP)]

    def test_points_are_counted_separately(self, kills: list[tuple[int, signal.Signals]]) -> None:
        """Visits of other points do not advance an armed point's count."""
        f = Faults("after_rows@2")
        for point in ("after_read", "after_rows", "before_commit", "after_commit", "after_read"):
            f.reached(point)
        assert kills == []
        f.reached("after_rows")
        assert kills == [(os.getpid(), signal.SIGKILL)]

    def test_several_plans_on_one_point_each_fire_on_their_visit(
        self, kills: list[tuple[int, signal.Signals]]
    ) -> None:
        """`after_rows@1:stop,after_rows@3:kill`: freeze on the first visit, die on the third."""
        f = Faults("after_rows@1:stop,after_rows@3:kill")
        for _ in range(4):
            f.reached("after_rows")
        assert kills == [(os.getpid(), signal.SIGSTOP), (os.getpid(), signal.SIGKILL)]

    def test_hang_answers_true_on_its_visit_and_sends_no_signal(
        self, kills: list[tuple[int, signal.Signals]]
    ) -> None:
        """`after_read@2:hang`: the second visit returns True (the main loop then waits for shutdown, a stalled
        worker as /healthz sees it); no signal is sent, and the other visits return False."""
        f = Faults("after_read@2:hang")
        assert [f.reached("after_read") for _ in range(4)] == [False, True, False, False]
        assert kills == []


# -------------------------------------------------------------------------------- real signals, real process

_CHILD = textwrap.dedent("""
    import sys
    from stock_ledger.faults import Faults

    f = Faults(sys.argv[1])
    for visit in (1, 2, 3):
        f.reached("after_rows")
        print(f"survived {visit}", flush=True)
""")


def _spawn(spec: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
    )


def _state(pid: int) -> str:
    """The process state letter from /proc/<pid>/stat (after the command name, which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_kill_dies_by_sigkill_on_the_second_visit() -> None:
    """`after_rows@2:kill` in a real process: it prints after the first visit, then dies by SIGKILL on the second,
    so exactly one line is printed and the exit status is -SIGKILL (no cleanup, no atexit, like an OOMKill)."""
    child = _spawn("after_rows@2:kill")
    out, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL, err.decode()
    assert out == b"survived 1\n"


def test_stop_freezes_on_the_second_visit_until_sigcont() -> None:
    """`after_rows@2:stop` in a real process:
    1. it prints after the first visit, then stops itself (state T) on the second;
    2. while stopped nothing more is printed;
    3. after SIGCONT it carries on where it froze and finishes normally."""
    child = _spawn("after_rows@2:stop")
    assert child.stdout is not None
    try:
        deadline = time.monotonic() + 20
        while _state(child.pid) not in {"T", "t"}:
            assert child.poll() is None, "the child exited instead of stopping"
            assert time.monotonic() < deadline, "the child never stopped"
            time.sleep(0.01)
        os.set_blocking(child.stdout.fileno(), False)
        assert os.read(child.stdout.fileno(), 4096) == b"survived 1\n"
        time.sleep(0.1)
        assert _state(child.pid) in {"T", "t"}
        os.set_blocking(child.stdout.fileno(), True)

        os.kill(child.pid, signal.SIGCONT)
        rest, err = child.communicate(timeout=30)
        assert child.returncode == 0, err.decode()
        assert rest == b"survived 2\nsurvived 3\n"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


class TestMidway:
    """`during_copy` fires in the middle of the rows COPY consumes, so the server is inside COPY waiting for data."""

    @pytest.mark.asyncio
    async def test_the_point_is_reached_halfway_and_every_row_still_flows(self, kills: list) -> None:
        f = Faults("during_copy:stop")
        seen: list[int] = []
        async for row in f.midway("during_copy", list(range(10))):
            seen.append(row)
            if row == 4:
                assert kills == []
        assert seen == list(range(10))
        assert [sig for _, sig in kills] == [signal.SIGSTOP]
