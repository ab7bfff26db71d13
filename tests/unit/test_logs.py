"""The Kafka client's repeated records, summarised (issue 31, item 6): `logs.ClientLogSummary` on a fake clock."""

from __future__ import annotations

import io
import json
import logging

import pytest

from stock_ledger import logs
from stock_ledger.logs import ClientLogSummary


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def record(name: str, msg: str, *args: object, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, "client.py", 1, msg, args, None)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def said() -> list[tuple[str, str, dict[str, object]]]:
    return []


@pytest.fixture
def summary(clock: Clock, said: list[tuple[str, str, dict[str, object]]]) -> ClientLogSummary:
    return ClientLogSummary(30, clock, lambda level, event, **fields: said.append((level, event, fields)))


def unable(node: int, port: int) -> logging.LogRecord:
    return record("aiokafka.client", "Unable connect to node with id %s: %s", node,
                  OSError(111, f"Connect call failed ('127.0.0.1', {port})"))


class TestRepeats:
    """Per cause (logger, level, message template without its numbers and addresses): the first record passes,
    the repeats within the interval are counted, and one summary line per interval says how many there were."""

    def test_the_first_passes_repeats_are_counted_and_summarised_once_per_interval(
        self, summary: ClientLogSummary, clock: Clock, said: list[tuple[str, str, dict[str, object]]],
    ) -> None:
        """312 connection errors to two nodes on two ports within 30 s: one passes, 311 do not; nothing is
        summarised before the window ends; at its end one line at the cause's level counts 311."""
        shown = []
        for i in range(312):
            clock.now += 0.09
            shown.append(summary.filter(unable(1 + i % 2, 19092 + i % 2)))
        assert shown == [True] + [False] * 311
        summary.flush()
        assert [e for _, e, _ in said] == ["kafka.unreachable"]  # no summary before the window ends
        clock.now = 1_000.09 + 30
        summary.flush()
        level, event, fields = said[-1]
        assert (level, event, fields["repeated"], fields["source"]) == ("error", "log.repeated", 311, "aiokafka.client")
        assert fields["summary"] == ("aiokafka.client: 'Unable connect to node with id %s: %s' repeated 311 times in "
                                     "the last 30 s")
        summary.flush()
        assert len([e for _, e, _ in said if e == "log.repeated"]) == 1  # once per window

    def test_a_cause_that_keeps_failing_shows_one_line_per_interval_not_its_records(
        self, summary: ClientLogSummary, clock: Clock, said: list[tuple[str, str, dict[str, object]]],
    ) -> None:
        """Ten records a second for 95 s, flushed every second: the first record and three summaries (30 s each);
        no further record passes while the cause keeps repeating."""
        passed = 0
        for tick in range(950):
            clock.now += 0.1
            passed += summary.filter(record("aiokafka.consumer.fetcher", "Failed fetch messages from %s: %s", 2,
                                            "NodeNotReadyError: Attempt to send a request to node which is not ready"))
            if tick % 10 == 9:
                summary.flush()
        repeats = [f["repeated"] for _, e, f in said if e == "log.repeated"]
        assert passed == 1
        assert len(repeats) == 3  # windows ending at about 31, 61 and 91 s
        assert all(295 <= r <= 310 for r in repeats), repeats  # ten a second for 30 s (+ up to a flush's second)

    def test_different_causes_are_counted_apart_and_other_loggers_are_untouched(
        self, summary: ClientLogSummary, clock: Clock, said: list[tuple[str, str, dict[str, object]]],
    ) -> None:
        """Two templates of one logger, one template at two levels, and our own logger: each client cause's
        first record passes; a stock_ledger record always passes, however often."""
        fetch = "Failed fetch messages from %s: %s"
        assert summary.filter(record("aiokafka.consumer.fetcher", fetch, 1, "x"))
        assert summary.filter(record("aiokafka.consumer.fetcher", "Unable to update metadata from %s", [1]))
        assert summary.filter(record("aiokafka.consumer.fetcher", fetch, 2, "y", level=logging.WARNING))
        assert not summary.filter(record("aiokafka.consumer.fetcher", fetch, 3, "z"))
        assert all(summary.filter(record("stock_ledger.worker", "batch.retry")) for _ in range(100))
        clock.now += 31
        summary.flush()
        repeated = [(f["message"], lvl, f["repeated"]) for lvl, e, f in said if e == "log.repeated"]
        assert repeated == [(fetch, "error", 1)]

    def test_numbers_and_addresses_in_a_preformatted_message_do_not_make_a_new_cause(
        self, summary: ClientLogSummary,
    ) -> None:
        """A message without arguments (already formatted) is compared without its numbers, addresses and ids."""
        assert summary.filter(record("aiokafka.conn", "Connection at 127.0.0.1:19092 closed (member 3f2a1b9c-"
                                                      "0000-4000-8000-00000000a1b2, 41 ms)"))
        assert not summary.filter(record("aiokafka.conn", "Connection at 127.0.0.1:19094 closed (member 77aa1b9c-"
                                                          "0000-4000-8000-00000000ffff, 7 ms)"))
        assert summary.filter(record("aiokafka.conn", "Connection at 127.0.0.1:19094 refused"))

    def test_a_cause_quiet_for_a_whole_window_shows_again(
        self, summary: ClientLogSummary, clock: Clock, said: list[tuple[str, str, dict[str, object]]],
    ) -> None:
        """One record, then nothing for 30 s: no summary (nothing was held back), and the next record passes."""
        assert summary.filter(unable(1, 19092))
        clock.now += 30
        summary.flush()
        assert not [e for _, e, _ in said if e == "log.repeated"]
        assert summary.filter(unable(1, 19092))


class TestOutage:
    """The worker's own line: once per outage, a warning that says what is happening and that the ledger is safe;
    an info line once the client has been free of connection errors for an interval."""

    def test_one_warning_per_outage_then_one_line_when_the_errors_cease(
        self, summary: ClientLogSummary, clock: Clock, said: list[tuple[str, str, dict[str, object]]],
    ) -> None:
        for _ in range(200):
            clock.now += 0.05
            summary.filter(unable(2, 19093))
            summary.filter(record("aiokafka.consumer.group_coordinator", "Heartbeat send request failed: %s. "
                                  "Will retry.", "KafkaConnectionError"))
        warnings = [(lvl, f) for lvl, e, f in said if e == "kafka.unreachable"]
        assert len(warnings) == 1
        level, fields = warnings[0]
        assert level == "warning"
        assert "Unable connect to node with id 2" in str(fields["client_says"])
        assert "ledger is safe" in str(fields["detail"])
        assert "position is in PostgreSQL" in str(fields["detail"])
        clock.now += 29
        summary.flush()
        assert not [e for _, e, _ in said if e == "kafka.errors_ceased"]
        clock.now += 1
        summary.flush()
        assert [e for _, e, _ in said].count("kafka.errors_ceased") == 1
        summary.filter(unable(2, 19093))  # a new outage is announced again
        assert [e for _, e, _ in said].count("kafka.unreachable") == 2

    def test_other_client_errors_are_not_an_outage(
        self, summary: ClientLogSummary, said: list[tuple[str, str, dict[str, object]]],
    ) -> None:
        summary.filter(record("aiokafka.consumer.group_coordinator", "Heartbeat failed for group %s because it is "
                              "rebalancing", "g", level=logging.WARNING))
        summary.filter(record("aiokafka.cluster", "Topic %s not found in cluster metadata", "t"))
        assert not said


def test_configure_puts_the_filter_on_the_handler_so_child_loggers_are_summarised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the real pipeline (JSON lines): 50 identical errors of `aiokafka.client` (a child logger, whose
    records reach the root handler without passing the root logger's filters) print one line, and the worker's
    kafka.unreachable warning, not 50."""
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr(logs, "_summary", None)  # a fresh filter, whatever other tests logged before
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("info", "json")
        for port in range(50):
            logging.getLogger("aiokafka.client").error('Unable connect to "%s:%s": %s', "127.0.0.1", 19000 + port,
                                                       OSError(111, "Connect call failed"))
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    events = [line["event"] for line in lines]
    assert events.count("kafka.unreachable") == 1
    assert len([e for e in events if e.startswith("Unable connect")]) == 1
    assert len(lines) == 2
