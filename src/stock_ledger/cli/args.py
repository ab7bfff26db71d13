"""What the commands share: argument types (partitions, times, counts) and output (a table, JSON or text)."""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Final

from stock_ledger.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence


def parse_partitions(values: Iterable[str]) -> frozenset[int] | None:
    """`--partition 3 --partition 5,7`: a set of partition numbers (None when the flag is absent)."""
    found: set[int] = set()
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            try:
                number = int(part)
            except ValueError:
                raise ConfigError(f"--partition {part.strip()!r} is not a partition number") from None
            if number < 0:
                raise ConfigError(f"--partition {number} is negative")
            found.add(number)
    return frozenset(found) if found else None


_AGE: Final = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def past_time(raw: str, flag: str, now: datetime | None = None) -> datetime:
    """`--since`, `--to-timestamp`: an ISO 8601 / RFC 3339 time (naive = UTC) or an age back from now: 90s, 15m, 6h,
    2d."""
    text = raw.strip()
    if match := _AGE.match(text):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"{flag} {raw!r} is neither an ISO 8601 time (2026-11-30T10:00:00+00:00) nor an age (15m, 6h, 2d)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


_RFC3339: Final = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$")


def rfc3339(text: str) -> datetime:
    """An argparse type: an RFC 3339 time with an offset (`2026-11-29T10:00:00+01:00`, `...Z`); else exit 2."""
    if _RFC3339.match(text):
        # Python keeps microseconds: nanoseconds are cut, which only widens `<= T` by under a microsecond.
        normalized = re.sub(r"(\.\d{6})\d+", r"\1", text).replace("z", "Z").replace("t", "T")
        try:
            return datetime.fromisoformat(normalized)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(
        f"{text!r} is not an RFC 3339 time with an offset: write it like 2026-11-29T10:00:00+01:00 or "
        "2026-11-29T09:00:00Z"
    )


def positive_int(text: str) -> int:
    """An argparse type for --limit."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def emit(document: object, text: str, *, as_json: bool) -> None:
    print(json.dumps(document, indent=2, default=str) if as_json else text)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], numeric: frozenset[int] = frozenset(),
          *, rule: bool = False) -> str:
    """Columns padded to their widest cell (right-aligned where `numeric`), optionally with a rule under the
    header."""
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if i in numeric else v.ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()

    lines = [line(headers), *([line(["-" * w for w in widths])] if rule else []), *(line(r) for r in cells)]
    return "\n".join(lines)
