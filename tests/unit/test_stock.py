"""The pure parts of the warehouse signals: time arguments, rendering, JSON shape, usage errors of the CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from stock_ledger import cli
from stock_ledger.cli import args
from stock_ledger.cli import stock as commands
from stock_ledger.clients.database import READER_SESSION
from stock_ledger.ledger.stock import History, Level, Movement

T0 = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-11-29T10:00:00+01:00", T0),
    ("2026-11-29T09:00:00Z", T0),
    ("2026-11-29t09:00:00z", T0),
    ("2026-11-29 09:00:00+00:00", T0),
    ("2026-11-29T04:30:00.250-04:30", T0 + timedelta(milliseconds=250)),
    ("2026-11-29T09:00:00.123456789Z", T0 + timedelta(microseconds=123456)),
])
def test_rfc3339_times_with_an_offset_are_accepted(text: str, expected: datetime) -> None:
    """Any RFC 3339 date-time with an offset (Z, z, ±hh:mm, a space for T, fractions) names one instant."""
    parsed = args.rfc3339(text)
    assert parsed == expected
    assert parsed.tzinfo is not None


@pytest.mark.parametrize("text", [
    "2026-11-29T10:00:00",        # no offset: which time zone?
    "2026-11-29",                 # a date is not an instant
    "2026-11-29T10:00+01:00",     # RFC 3339 requires seconds
    "2026-13-01T00:00:00Z",       # no month 13
    "2026-11-29T25:00:00Z",
    "yesterday",
    "1732870800",
    "2026-11-29T10:00:00+0100",   # the offset needs its colon
    "",
])
def test_anything_else_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"RFC 3339 time with an offset.*2026-11-29T10:00:00\+01:00"):
        args.rfc3339(text)


def test_limit_must_be_a_positive_whole_number() -> None:
    assert args.positive_int("7") == 7
    for bad in ("0", "-1", "1.5", "ten"):
        with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
            args.positive_int(bad)


@pytest.mark.parametrize("argv", [
    ["stock", "show", "--warehouse", "WH-1", "--at", "2026-11-29T10:00:00"],
    ["stock", "show", "--warehouse", "WH-1", "--at", "noon"],
    ["movements", "--sku", "SKU-1", "--since", "2026-11-29"],
    ["movements", "--sku", "SKU-1", "--limit", "0"],
    ["stock", "show"],           # --warehouse is required
    ["movements"],               # --sku is required
    ["stock"],                   # `show` is required
])
def test_bad_usage_exits_2_with_one_clear_line_before_touching_anything(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bad --at/--since/--limit (or a missing option) exit 2 and say what is wrong; no database is needed."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error_lines) == 1, error_lines


def test_help_says_at_is_business_time(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["stock", "show", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "business time" in text
    assert "not the order the ledger applied movements in" in text


def test_help_of_movements_defines_the_order(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["movements", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "application order" in text
    assert "Kafka offset order" in text


def test_a_missing_database_url_is_a_configuration_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert cli.main(["stock", "show", "--warehouse", "WH-1"]) == 2
    assert "DATABASE_URL is required" in capsys.readouterr().err


def _levels() -> list[Level]:
    return [Level("WH-1", "SKU-A", 12, None), Level("WH-1", "SKU-B", -3, T0)]


def test_levels_now_render_with_when_each_went_negative() -> None:
    text = commands.render_levels(_levels(), "WH-1", at=None, negative=False)
    lines = text.splitlines()
    assert lines[0] == "stock in warehouse WH-1, now (stock_levels)"
    assert lines[1].split() == ["sku", "on_hand", "went_negative_at"]
    assert lines[3].split() == ["SKU-A", "12"]
    assert lines[4].split() == ["SKU-B", "-3", "2026-11-29T09:00:00+00:00"]
    assert "when the ledger applied the batch" in lines[-1]


def test_levels_as_of_a_time_say_which_clock() -> None:
    at = datetime(2026, 11, 29, 10, 0, tzinfo=timezone(timedelta(hours=1)))
    text = commands.render_levels(_levels(), "WH-1", at=at, negative=True)
    assert text.splitlines()[0] == ("negative stock in warehouse WH-1, as of 2026-11-29T10:00:00+01:00 (business "
                                    "time: Σ of movements with occurred_at <= it)")
    assert "went_negative_at" not in text
    assert commands.render_levels([], "WH-1", at=None, negative=True).endswith(": none")


def test_levels_json_is_one_document_with_iso_times() -> None:
    doc = json.loads(json.dumps(commands.levels_json(_levels(), "WH-1", at=None, negative=False)))
    assert doc == {
        "warehouse_id": "WH-1", "as_of": None, "basis": "stock_levels", "negative_only": False,
        "levels": [{"warehouse_id": "WH-1", "sku": "SKU-A", "on_hand": 12, "went_negative_at": None},
                   {"warehouse_id": "WH-1", "sku": "SKU-B", "on_hand": -3,
                    "went_negative_at": "2026-11-29T09:00:00+00:00"}],
    }


def _history(matching: int = 2) -> History:
    ids = [uuid.UUID(int=1), uuid.UUID(int=2)]
    return History([
        Movement(T0, T0 + timedelta(seconds=5), "WH-1", "SKU-A", "receipt", 5, 5, ids[0], "warehouse.movements", 3, 40),
        Movement(T0, T0 + timedelta(seconds=6), "WH-1", "SKU-A", "pick", -8, -3, ids[1], "warehouse.movements", 3, 41),
    ], matching)


def test_history_rows_carry_running_on_hand_and_kafka_coordinates() -> None:
    lines = commands.render_history(_history(), "SKU-A", warehouse="WH-1", since=None, limit=100).splitlines()
    assert lines[0] == ("movements of SKU-A in warehouse WH-1, in application order (kafka_topic, kafka_partition, "
                        "kafka_offset)")
    assert lines[3].split()[-4:] == ["5", "5", str(uuid.UUID(int=1)), "warehouse.movements/3/40"]
    assert lines[4].split()[-4:] == ["-8", "-3", str(uuid.UUID(int=2)), "warehouse.movements/3/41"]
    assert not any("showing the newest" in line for line in lines)


def test_a_cut_history_says_how_to_see_more() -> None:
    text = commands.render_history(_history(matching=250), "SKU-A", warehouse=None, since=T0, limit=2)
    assert "that occurred at or after 2026-11-29T09:00:00+00:00" in text
    assert "showing the newest 2 of 250: raise --limit (now 2) or narrow with --since" in text


def test_history_json_names_the_order_and_each_kafka_record() -> None:
    doc = commands.history_json(_history(), "SKU-A", warehouse=None, since=None, limit=100)
    assert doc["order"] == "kafka_topic, kafka_partition, kafka_offset"
    assert doc["matching"] == 2
    assert [m["on_hand"] for m in doc["movements"]] == [5, -3]
    assert doc["movements"][1]["kafka"] == {"topic": "warehouse.movements", "partition": 3, "offset": 41}
    assert doc["movements"][1]["movement_id"] == str(uuid.UUID(int=2))
    json.dumps(doc)  # serialisable as is


def test_a_slow_read_says_so_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """A scan of a large ledger takes seconds: after the delay, one line on stderr says what is going on."""
    asyncio.run(commands.say_when_slow(0.01))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("stock-ledger: still reading stock_movements after 0.01s (`movements` and `--at`")


def test_cli_sessions_are_read_only_whatever_the_role() -> None:
    assert READER_SESSION["default_transaction_read_only"] == "on"


def test_the_reads_name_the_in_step_condition_that_migration_0016_indexes() -> None:
    """The partial indexes serve a read only if its condition is theirs: the reader's text and the migration's, spaces
    aside, are one (a drift would leave every `--at` scanning, right but slow)."""
    from pathlib import Path  # noqa: PLC0415 - this test only

    from stock_ledger.ledger.stock import IN_STEP  # noqa: PLC0415

    sql = " ".join((Path(__file__).resolve().parents[2] / "migrations" / "0016_closings.sql").read_text().split())
    condition = " ".join(IN_STEP.split())
    assert f"WITH (autosummarize = on) WHERE {condition};" in sql
    assert f"WHERE NOT ({condition});" in sql
