"""The declared mapping from a topic's records to the message contract: which format the value and the key are in,
which field of the value (or which header) holds each field of the contract, and how `occurred_at`, `qty` and
`kind` are written. No code: one JSON document, `STOCK_LEDGER_MAPPING` or the file `STOCK_LEDGER_MAPPING_FILE`
names (docs/formats.md). The default is the contract itself: plain JSON, the SKU as the UTF-8 key.

`load_mapping` is pure and refuses, naming the field, every mapping that no record could satisfy; what only a
record or a schema can contradict is decided per record (a quarantine reason) by `formats/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal, get_args

import msgspec

from stock_ledger.errors import ConfigError

ValueFormat = Literal["json", "avro", "protobuf", "json_schema"]
KeyFormat = Literal["utf8", "json_string", "registry"]
TimeFormat = Literal["rfc3339", "epoch_seconds", "epoch_millis", "epoch_micros", "timestamp"]
QtyFormat = Literal["integer", "decimal"]

CONTRACT_FIELDS: Final = ("movement_id", "warehouse_id", "sku", "qty", "kind", "occurred_at")
# A header is bytes: only the text fields of the contract may come from one.
HEADER_FIELDS: Final = frozenset({"movement_id", "warehouse_id", "sku", "kind"})
KINDS: Final = ("receipt", "return", "transfer_in", "pick", "transfer_out", "adjustment")
REGISTRY_VALUES: Final = frozenset({"avro", "protobuf", "json_schema"})
_TOP: Final = ("value", "key", "fields", "occurred_at", "qty", "kind")
_LIMIT: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class Header:
    """A field taken from the record header of this name (its value as UTF-8 text)."""

    name: str


Source = str | Header


@dataclass(frozen=True, slots=True)
class MessageMapping:
    value: ValueFormat = "json"
    key: KeyFormat = "utf8"
    # Contract field -> where it is read (a field of the value, or a header); a field not named reads its own name.
    fields: dict[str, Source] = field(default_factory=dict)
    occurred_at: TimeFormat = "rfc3339"
    qty: QtyFormat = "integer"
    kind: dict[str, str] = field(default_factory=dict)  # the producer's value -> the contract's kind

    @property
    def is_default(self) -> bool:
        """The contract as it is: the worker's plain-JSON hot path (`domain.parse`), untouched."""
        return self == MessageMapping()

    @property
    def uses_registry(self) -> bool:
        return self.value in REGISTRY_VALUES or self.key == "registry"

    @property
    def uses_headers(self) -> bool:
        return any(isinstance(s, Header) for s in self.fields.values())

    def source(self, contract_field: str) -> Source:
        return self.fields.get(contract_field, contract_field)

    def describe(self) -> dict[str, object]:
        """The mapping as a JSON-ready document (the worker logs it at start)."""
        return {"value": self.value, "key": self.key, "occurred_at": self.occurred_at, "qty": self.qty,
                "kind": self.kind, "fields": {k: {"header": v.name} if isinstance(v, Header) else v
                                              for k, v in self.fields.items()}}


def load_mapping(text: str, where: str = "STOCK_LEDGER_MAPPING") -> MessageMapping:
    """The mapping a JSON document declares; `ConfigError` naming `where` and the field for anything no record
    could satisfy (an unknown field or format, a header for a number, a kind the contract does not know, a typed
    timestamp in JSON, a decimal in Protobuf)."""
    if len(text) > _LIMIT:
        raise ConfigError(f"{where} is longer than {_LIMIT} characters")
    try:
        document = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc}); see docs/formats.md for examples") from None
    if not isinstance(document, dict):
        raise ConfigError(f'{where} must be a JSON object such as {{"value": "avro"}} (docs/formats.md)')
    unknown = sorted(set(document) - set(_TOP))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(_TOP)}")
    value = _choice(where, "value", document.get("value", "json"), get_args(ValueFormat))
    mapping = MessageMapping(
        value=value,  # type: ignore[arg-type]
        key=_choice(where, "key", document.get("key", "utf8"), get_args(KeyFormat)),  # type: ignore[arg-type]
        fields=_fields(where, document.get("fields", {})),
        occurred_at=_choice(where, "occurred_at", document.get("occurred_at", "rfc3339"),  # type: ignore[arg-type]
                            get_args(TimeFormat)),
        qty=_choice(where, "qty", document.get("qty", "integer"), get_args(QtyFormat)),  # type: ignore[arg-type]
        kind=_kinds(where, document.get("kind", {})),
    )
    if mapping.occurred_at == "timestamp" and mapping.value in {"json", "json_schema"}:
        raise ConfigError(f'{where}: occurred_at "timestamp" needs a typed timestamp (Avro timestamp-millis or '
                          "-micros, Protobuf google.protobuf.Timestamp); JSON has none: use rfc3339 or epoch_*")
    if mapping.qty == "decimal" and mapping.value == "protobuf":
        raise ConfigError(f"{where}: qty \"decimal\" is for Avro's decimal type and JSON numbers; Protobuf has no "
                          'decimal scalar: map qty from an integer field ("qty": "integer")')
    return mapping


def _choice(where: str, name: str, raw: object, choices: tuple[str, ...]) -> str:
    if raw not in choices:
        raise ConfigError(f"{where}: {name} {raw!r} must be one of {', '.join(choices)}")
    return str(raw)


def _fields(where: str, raw: object) -> dict[str, Source]:
    if not isinstance(raw, dict):
        raise ConfigError(f'{where}: fields must be an object, contract field -> source (e.g. {{"sku": '
                          '"itemCode"}})')
    fields: dict[str, Source] = {}
    for name, source in raw.items():
        if name not in CONTRACT_FIELDS:
            raise ConfigError(f"{where}: fields.{name} is not a field of the contract ({', '.join(CONTRACT_FIELDS)})")
        if isinstance(source, str) and 0 < len(source) <= 256:
            fields[name] = source
        elif isinstance(source, dict) and set(source) == {"header"} and isinstance(source["header"], str) \
                and source["header"]:
            if name not in HEADER_FIELDS:
                raise ConfigError(f"{where}: fields.{name} cannot come from a header (a header is text; only "
                                  f"{', '.join(sorted(HEADER_FIELDS))} may)")
            fields[name] = Header(source["header"])
        else:
            raise ConfigError(f'{where}: fields.{name} must be a field name of the value ("itemCode") or '
                              '{"header": "NAME"}')
    taken = [s for s in fields.values() if isinstance(s, str)]
    twice = sorted({s for s in taken if taken.count(s) > 1})
    if twice:
        raise ConfigError(f"{where}: fields: the value's field {twice[0]!r} is mapped to two contract fields")
    return fields


def _kinds(where: str, raw: object) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: kind must be an object, the producer's value -> the contract's kind (e.g. "
                          '{"PICK": "pick"})')
    for theirs, ours in raw.items():
        if ours not in KINDS:
            raise ConfigError(f"{where}: kind.{theirs} maps to {ours!r}, which is not a kind of the contract "
                              f"({', '.join(KINDS)})")
    return dict(raw)
