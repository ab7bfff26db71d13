"""Avro values: each writer schema resolved against the ledger's reader schema, with fastavro.

The reader schema is the contract as the mapping names it: a record of just the six fields (under the writer
record's name, as Avro's resolution rules want), each of a type the ledger reads. Avro's own resolution then does
the rest: fields are matched by name (order does not matter), fields the ledger does not read are skipped, `int`
is promoted to `long` and `bytes` to `string`, a `["null", T]` union is read as T (a null is refused for that
record). What cannot be resolved (a missing field, a float quantity, a decimal with a scale) makes the schema
`Unreadable`, naming the schema id and the field: every record written with it is quarantined, none is guessed.

Resolution costs fastavro about as much again as the decoding itself, per record: where every field the ledger reads
is already written as the type it reads (the contract's own schema, with or without extra fields), the datum is
read with the writer schema alone. Timestamps are read as their bare count and made datetimes here, at a fraction
of fastavro's cost (docs/performance.md, "Declared formats").
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import fastavro

from stock_ledger.formats.fields import Unreadable, epoch_time
from stock_ledger.mapping import CONTRACT_FIELDS

if TYPE_CHECKING:
    from stock_ledger.mapping import MessageMapping

_INTEGERS: Final = frozenset({"int", "long"})
_TEXT: Final = frozenset({"string", "bytes"})
_TIMESTAMPS: Final = {"timestamp-millis": "epoch_millis", "timestamp-micros": "epoch_micros"}
# The one logical type decoded as such: every other is read as its underlying type. A uuid is the same string (the
# contract's check makes the UUID, in C, instead of fastavro's Python `uuid.UUID`), a timestamp the same count
# (`AvroReader.read` makes the datetime), and a field the ledger does not read can never fail a conversion.
_DECODED: Final = frozenset({"decimal"})


@dataclass(frozen=True, slots=True)
class AvroReader:
    schema_id: int
    writer: Any  # fastavro's parsed schemas
    reader: Any  # None: the writer's fields are already what the ledger reads, no resolution
    names: dict[str, str]  # contract field -> the field's name in the value
    timestamp_unit: str | None = None  # occurred_at written as a timestamp logical type: its epoch unit
    as_is: bool = False  # read as written, and its fields are exactly the contract's under their own names

    def read(self, payload: bytes) -> dict[str, object] | str:
        """The contract's fields from one datum (before the contract's checks), or why the bytes are not one."""
        try:
            datum = fastavro.schemaless_reader(io.BytesIO(payload), self.writer, self.reader)
        except Exception as exc:
            return f"value does not decode as Avro with schema id {self.schema_id}: {type(exc).__name__}: {exc}"
        if not isinstance(datum, dict):
            return f"value of schema id {self.schema_id} is not a record"
        # The contract's own field names and nothing else (its schema, read as written): the datum is the fields.
        fields = datum if self.as_is else {n: datum[source] for n, source in self.names.items() if source in datum}
        if self.timestamp_unit is not None and "occurred_at" in fields:
            fields["occurred_at"] = epoch_time(fields["occurred_at"], self.timestamp_unit)
        return fields


def compile_avro(schema_id: int, text: str, mapping: MessageMapping) -> AvroReader | Unreadable:
    """The reader of one writer schema under `mapping`, or why the ledger cannot read it as the contract."""
    try:
        document = json.loads(text)
        writer = fastavro.parse_schema(_without_uuid(document))
        bare_writer = fastavro.parse_schema(_bare(document))
    except Exception as exc:
        return Unreadable(f"schema id {schema_id} is not a usable Avro schema: {exc}")
    if not isinstance(writer, dict) or writer.get("type") != "record":
        return Unreadable(f"schema id {schema_id} is not an Avro record (a movement is a record of six fields)")
    named = writer.get("__named_schemas", {})
    by_name = {f["name"]: f for f in writer["fields"]}
    fields, names, direct = [], {}, True
    unit: str | None = None
    for name in CONTRACT_FIELDS:
        source = mapping.source(name)
        if not isinstance(source, str):
            continue  # a header
        found = by_name.get(source)
        if found is None:
            return Unreadable(f"schema id {schema_id} (record {writer['name']}) has no field {source!r} for {name}")
        core = _core(found["type"], named)
        wanted = _reader_type(name, core, mapping)
        if isinstance(wanted, Unreadable):
            return Unreadable(f"schema id {schema_id} (record {writer['name']}): field {source!r} for {name} is "
                              f"{_show(core)}, {wanted.reason}")
        if name == "occurred_at" and mapping.occurred_at == "timestamp":
            unit = _TIMESTAMPS[core["logicalType"]]
        direct = direct and _plain(_bare(found["type"])) == _plain(_bare(wanted))
        fields.append({"name": source, "type": _bare(wanted)})
        names[name] = source
    reader = None if direct else fastavro.parse_schema({"type": "record", "name": writer["name"], "fields": fields})
    as_is = direct and len(writer["fields"]) == len(names) == len(CONTRACT_FIELDS) and all(
        name == source for name, source in names.items())
    return AvroReader(schema_id, bare_writer, reader, names, unit, as_is)


def _without_uuid(schema: Any) -> Any:  # noqa: ANN401 - an Avro schema is JSON
    """The schema without its `uuid` logical types: what `compile_avro` inspects (a uuid is a string to it)."""
    if isinstance(schema, dict):
        return {k: _without_uuid(v) for k, v in schema.items() if not (k == "logicalType" and v == "uuid")}
    if isinstance(schema, list):
        return [_without_uuid(s) for s in schema]
    return schema


def _bare(schema: Any) -> Any:  # noqa: ANN401 - an Avro schema is JSON
    """The schema as it is decoded: every logical type but a decimal read as its underlying type (the same bytes)."""
    if isinstance(schema, dict):
        return {k: _bare(v) for k, v in schema.items() if not (k == "logicalType" and v not in _DECODED)}
    if isinstance(schema, list):
        return [_bare(s) for s in schema]
    return schema


def _plain(schema: Any) -> Any:  # noqa: ANN401
    """`{"type": "string"}` as `"string"`: the same type, for comparing a writer's field with what the ledger reads."""
    if isinstance(schema, dict) and schema.keys() == {"type"} and isinstance(schema["type"], str):
        return schema["type"]
    return schema


def _core(schema: Any, named: dict[str, Any]) -> Any:  # noqa: ANN401 - an Avro schema is JSON
    """The type a field holds when it is not null: a `["null", T]` union's T; a named type's definition."""
    if isinstance(schema, list):
        branches = [s for s in schema if s != "null"]
        if len(branches) == 1:
            return _core(branches[0], named)
        return schema
    if isinstance(schema, str) and schema in named:
        return named[schema]
    return schema


def _primitive(schema: Any) -> str | None:  # noqa: ANN401
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict) and isinstance(schema.get("type"), str) and "logicalType" not in schema:
        return str(schema["type"])
    return None


def _reader_type(name: str, core: Any, mapping: MessageMapping) -> Any:  # noqa: ANN401, PLR0911 - one rule per field
    """The type the ledger reads field `name` as, when the writer wrote `core`; Unreadable saying what it wants."""
    logical = core.get("logicalType") if isinstance(core, dict) else None
    plain = _primitive(core) or (core.get("type") if isinstance(core, dict) else None)
    if name == "qty":
        if logical == "decimal":
            if mapping.qty != "decimal":
                return Unreadable('a decimal: declare "qty": "decimal" in STOCK_LEDGER_MAPPING')
            if core.get("scale", 0) != 0:
                return Unreadable("the ledger reads qty as a whole number: a decimal of scale 0")
            return core
        return "long" if logical is None and plain in _INTEGERS else Unreadable("the ledger reads qty as int or long")
    if name == "occurred_at":
        if mapping.occurred_at == "timestamp":
            return core if logical in _TIMESTAMPS else Unreadable(
                'the mapping wants a timestamp-millis or timestamp-micros (occurred_at "timestamp")')
        if mapping.occurred_at == "rfc3339":
            return "string" if plain in _TEXT and logical is None else Unreadable(
                'the mapping wants an RFC 3339 string (occurred_at "rfc3339")')
        # epoch_*: the bare number, even under a timestamp logical type (the mapping says which unit it counts)
        return "long" if plain in _INTEGERS else Unreadable(f"the mapping wants an integer ({mapping.occurred_at})")
    if name == "kind" and isinstance(core, dict) and core.get("type") == "enum":
        return core
    if plain in _TEXT:
        return "string"
    return Unreadable("the ledger reads it as a string")


def _show(schema: Any) -> str:  # noqa: ANN401
    if isinstance(schema, dict) and "logicalType" in schema:
        scale = f"({schema.get('precision')},{schema.get('scale', 0)})" if schema["logicalType"] == "decimal" else ""
        return f"{schema['type']} with logicalType {schema['logicalType']}{scale}"
    if isinstance(schema, dict):
        return str(schema.get("type"))
    return schema if isinstance(schema, str) else json.dumps(schema)
