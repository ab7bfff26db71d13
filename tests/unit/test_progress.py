"""Progress of long operations: off a terminal (CI logs, kubectl logs) plain lines, never carriage returns."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from stock_ledger import progress
from stock_ledger.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=fake.monotonic))
    return fake


def test_the_final_line_states_the_count_the_time_and_the_rate(clock: Clock) -> None:
    """50,000 movements in 25 s, on a non-TTY stream: the last line is 'produce: 50,000 in 25.0s (2,000/s)'."""
    out = io.StringIO()
    p = Progress("produce", 50_000, stream=out)
    for _ in range(50):
        clock.now += 0.5
        p.advance(1_000)
    p.finish()
    lines = out.getvalue().splitlines()
    assert lines[-1] == "produce: 50,000 in 25.0s (2,000/s)"
    assert "\r" not in out.getvalue()
    assert "\x1b" not in out.getvalue()


def test_off_a_terminal_a_line_is_written_every_few_seconds_not_per_record(clock: Clock) -> None:
    """every=2 s: 10 s of progress gives about 5 interim lines, each with count, total, percentage, rate and eta."""
    out = io.StringIO()
    p = Progress("produce", 10_000, stream=out, every=2.0)
    for _ in range(100):
        clock.now += 0.1
        p.advance(100)
    interim = out.getvalue().splitlines()
    assert 4 <= len(interim) <= 6
    assert interim[0] == "produce: 2,000/10,000 ( 20.0%) 1,000/s eta 8s"
    p.finish()
    assert out.getvalue().splitlines()[-1] == "produce: 10,000 in 10.0s (1,000/s)"


def test_without_a_total_the_lines_show_count_and_rate(clock: Clock) -> None:
    """An open-ended count (verify reading the topic) has no percentage or eta."""
    out = io.StringIO()
    p = Progress("read", None, stream=out, every=1.0)
    clock.now += 1.5
    p.advance(3_000)
    clock.now += 1.5
    p.finish()
    assert out.getvalue().splitlines() == ["read: 3,000 2,000/s", "read: 3,000 in 3.0s (1,000/s)"]


def test_finishing_at_once_does_not_divide_by_zero(clock: Clock) -> None:
    """Zero elapsed time and zero records: a final line, no exception."""
    out = io.StringIO()
    p = Progress("produce", 0, stream=out)
    p.finish()
    assert out.getvalue() == "produce: 0 in 0.0s (0/s)\n"


def test_real_clock_final_line_has_count_and_rate() -> None:
    """No fakes: the final line on a StringIO names the count and a rate."""
    out = io.StringIO()
    p = Progress("produce", 1_234, stream=out)
    p.advance(1_234)
    p.finish()
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("produce: 1,234 in ")
    assert last.endswith("/s)")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("no_color", "escapes"), [("", True), ("1", False)])
def test_no_color_turns_the_live_line_into_plain_lines(clock: Clock, monkeypatch: pytest.MonkeyPatch,
                                                       no_color: str, escapes: bool) -> None:
    """On a terminal the live line redraws with ANSI escapes; with NO_COLOR set to any non-empty value
    (https://no-color.org) it prints plain lines instead, and an empty NO_COLOR changes nothing."""
    monkeypatch.setenv("NO_COLOR", no_color)
    out = _Terminal()
    p = Progress("verify", 10, stream=out)
    clock.now += 5
    p.advance(5)
    p.finish()
    assert ("\x1b" in out.getvalue()) is escapes
    assert ("\r" in out.getvalue()) is escapes
