"""A record in a declared format -> a movement or a rejection: `RecordDecoder`, pure and total over the records
it is given, once every schema id they name is resolved (`schema_ids` lists them; the caller fetched them).

The steps, the same for every format: the key as the mapping declares it (UTF-8, a JSON string, or a
registry-framed string); the value's fields by its format (JSON, or the Schema Registry wire format: magic byte 0,
a 4-byte big-endian schema id, for Protobuf the message indexes, then an Avro datum, a Protobuf message or JSON);
header fields; the mapping's conversions; then the contract's own checks (`domain.validate`), the very ones plain
JSON gets.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

import fastavro
import msgspec

from stock_ledger.domain import MAX_DEPTH, Movement, RejectCode, Rejection, nests_deeper_than, parse, validate
from stock_ledger.formats.avro import AvroReader, compile_avro
from stock_ledger.formats.fields import Unreadable, convert
from stock_ledger.formats.protobuf import ProtoReader, compile_protobuf
from stock_ledger.mapping import CONTRACT_FIELDS, Header

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from stock_ledger.mapping import MessageMapping as Declared

_TYPE_OF: Final = {"avro": "AVRO", "protobuf": "PROTOBUF", "json_schema": "JSON"}
_JSON_STRING: Final = msgspec.json.Decoder(str)
_AVRO_STRING: Final = fastavro.parse_schema("string")


@dataclass(frozen=True, slots=True)
class Registered:
    """A schema as the registry serves it by id: its type (AVRO, PROTOBUF or JSON), its text, and the text of each
    schema it references by import name (Protobuf imports)."""

    schema_id: int
    schema_type: str
    text: str
    references: tuple[tuple[str, str], ...] = ()


def framed_id(data: bytes | None) -> int | None:
    """The schema id of a record in the Schema Registry wire format (None: not in it)."""
    if data is None or len(data) < 5 or data[0] != 0:
        return None
    return int.from_bytes(data[1:5], "big")


def schema_ids(mapping: Declared, records: Iterable[Any]) -> set[int]:
    """Every schema id the records' keys and values name, where the mapping reads them through the registry."""
    ids: set[int] = set()
    values, keys = mapping.value in _TYPE_OF, mapping.key == "registry"
    for r in records:
        for data in ((r.value,) if values else ()) + ((r.key,) if keys else ()):
            if data is not None and len(data) >= 5 and data[0] == 0:
                ids.add(int.from_bytes(data[1:5], "big"))
    return ids


def _message_indexes(data: bytes, pos: int) -> tuple[tuple[int, ...], int]:
    """Confluent's Protobuf frame: a zigzag varint count, then that many zigzag varint indexes (count 0: [0])."""
    def varint(at: int) -> tuple[int, int]:
        shift = result = 0
        while True:
            if at >= len(data) or shift > 63:
                raise ValueError("the message indexes of the Protobuf frame are truncated")
            byte = data[at]
            result |= (byte & 0x7F) << shift
            at += 1
            if not byte & 0x80:
                return (result >> 1) ^ -(result & 1), at
            shift += 7
    count, pos = varint(pos)
    if count == 0:
        return (0,), pos
    if not 0 < count <= 32:
        raise ValueError(f"the Protobuf frame names {count} message indexes")
    indexes = []
    for _ in range(count):
        index, pos = varint(pos)
        indexes.append(index)
    return tuple(indexes), pos


@dataclass(slots=True)
class RecordDecoder:
    """`decoder(key, value, headers)` -> Movement | Rejection under `mapping`, with the `registered` schemas (None:
    an id the registry does not know). Readers are compiled once per schema id and kept: pure, as it is memoised."""

    mapping: Declared
    registered: Mapping[int, Registered | None] = field(default_factory=dict)
    registry: str = "the schema registry"  # named in the reasons
    _readers: dict[tuple[int, tuple[int, ...]], AvroReader | ProtoReader | Unreadable] = field(default_factory=dict)
    # An Avro value's frame (magic byte and id) -> its reader, once one was compiled for it: the steps `_value`
    # takes to get there are the same for every record of the id, and this runs once per record.
    _avro_frames: dict[bytes, AvroReader] = field(default_factory=dict)
    _headers: tuple[tuple[str, str], ...] = ()
    _from_value: tuple[str, ...] = ()
    _json_names: dict[str, str] = field(default_factory=dict)
    _converts: bool = False

    def __post_init__(self) -> None:
        sources = {n: self.mapping.source(n) for n in CONTRACT_FIELDS}
        self._headers = tuple((n, s.name) for n, s in sources.items() if isinstance(s, Header))
        self._from_value = tuple(n for n, s in sources.items() if isinstance(s, str))
        self._json_names = {s: n for n, s in sources.items() if isinstance(s, str)}
        self._converts = self.mapping.qty == "decimal" or self.mapping.occurred_at.startswith("epoch") or bool(
            self.mapping.kind)

    def __call__(self, key: bytes | None, value: bytes | None,  # noqa: PLR0911 - one return per step that can fail
                 headers: Sequence[tuple[str, bytes | None]] = ()) -> Movement | Rejection:
        if not key:
            return parse(key, value)  # missing_key, in the contract's words
        key_text = key if self.mapping.key == "utf8" else self._key(key)
        if isinstance(key_text, Rejection):
            return key_text
        fields = self._value(value)
        if isinstance(fields, Rejection):
            return fields
        if len(fields) != len(self._from_value):
            name = next(n for n in self._from_value if n not in fields)
            return Rejection(RejectCode.INVALID_FIELD, f"field {self.mapping.source(name)!r} ({name}) is missing "
                             "(see 'Message format' in README.md)")
        for name, header in self._headers:
            found = [v for k, v in headers if k == header]
            if not found or found[-1] is None:
                return Rejection(RejectCode.INVALID_FIELD, f"header {header!r} ({name}) is missing")
            try:
                fields[name] = found[-1].decode()
            except UnicodeDecodeError:
                return Rejection(RejectCode.INVALID_FIELD, f"header {header!r} ({name}) is not UTF-8")
        if self._converts:
            convert(fields, self.mapping)
        occurred_at = fields.get("occurred_at")
        if type(occurred_at) is Rejection:  # out of range, from an epoch count or a Protobuf Timestamp
            return occurred_at
        return validate(key_text, fields)

    # ----------------------------------------------------------------------------------------------- the key

    def _key(self, key: bytes) -> bytes | Rejection:  # noqa: PLR0911 - one return per way a key can fail
        if self.mapping.key == "utf8":
            return key
        if self.mapping.key == "json_string":
            try:
                return _JSON_STRING.decode(key).encode()
            except (msgspec.DecodeError, UnicodeEncodeError):
                return Rejection(RejectCode.KEY_MISMATCH, f"key is not a JSON string (bytes {key[:64]!r}); "
                                 'STOCK_LEDGER_MAPPING declares key "json_string"')
        schema_id = framed_id(key)
        if schema_id is None:
            return Rejection(RejectCode.KEY_MISMATCH, f"key is not in the Schema Registry wire format (bytes "
                             f'{key[:16]!r}); STOCK_LEDGER_MAPPING declares key "registry"')
        schema = self._registered(schema_id)
        if isinstance(schema, Rejection):
            return schema
        try:
            if schema.schema_type == "AVRO" and schema.text.strip() in {'"string"', '{"type":"string"}',
                                                                         '{"type": "string"}'}:
                return str(fastavro.schemaless_reader(io.BytesIO(key[5:]), _AVRO_STRING)).encode()
            if schema.schema_type == "JSON":
                return _JSON_STRING.decode(key[5:]).encode()
        except Exception as exc:
            return Rejection(RejectCode.KEY_MISMATCH, f"key does not decode with schema id {schema_id}: {exc}")
        return Rejection(RejectCode.INCOMPATIBLE_SCHEMA, f"key schema id {schema_id} ({schema.schema_type}) is not "
                         'a string: the key must be the SKU (an Avro "string" or a JSON Schema string)')

    # --------------------------------------------------------------------------------------------- the value

    def _value(self, value: bytes | None) -> dict[str, object] | Rejection:
        fmt = self.mapping.value
        if value is None:
            code = RejectCode.INVALID_JSON if fmt == "json" else RejectCode.INVALID_ENCODING
            return Rejection(code, "record has no value (a tombstone)")
        if fmt == "json":
            return self._json(value, "")
        reader = self._avro_frames.get(value[:5])
        fields = self._framed(value, fmt) if reader is None else reader.read(value[5:])
        return Rejection(RejectCode.INVALID_ENCODING, fields) if isinstance(fields, str) else fields

    def _framed(self, value: bytes, fmt: str) -> dict[str, object] | Rejection | str:  # noqa: PLR0911 - idem
        """A value in the Schema Registry wire format the first time its frame is seen: the fields, a Rejection,
        or (as a reader's `read` says it) why the bytes do not decode."""
        schema_id = framed_id(value)
        if schema_id is None:
            return Rejection(RejectCode.INVALID_ENCODING, f"value is not in the Schema Registry wire format (magic "
                             f"byte 0, a 4-byte schema id; it starts with {value[:16]!r}); STOCK_LEDGER_MAPPING "
                             f"declares value {fmt!r}")
        schema = self._registered(schema_id)
        if isinstance(schema, Rejection):
            return schema
        if schema.schema_type != _TYPE_OF[fmt]:
            return Rejection(RejectCode.INCOMPATIBLE_SCHEMA, f"schema id {schema_id} is {schema.schema_type}; "
                             f"STOCK_LEDGER_MAPPING declares value {fmt!r}")
        if fmt == "json_schema":
            return self._json(value[5:], f" of schema id {schema_id}")
        pos, indexes = 5, cast("tuple[int, ...]", ())
        if fmt == "protobuf":
            try:
                indexes, pos = ((0,), 6) if value[5:6] == b"\x00" else _message_indexes(value, 5)
            except ValueError as exc:
                return Rejection(RejectCode.INVALID_ENCODING, f"schema id {schema_id}: {exc}")
        reader = self._reader(schema, indexes)
        if isinstance(reader, Unreadable):
            return Rejection(RejectCode.INCOMPATIBLE_SCHEMA, reader.reason)
        if isinstance(reader, AvroReader):
            self._avro_frames[value[:5]] = reader
        return reader.read(value[pos:])

    def _registered(self, schema_id: int) -> Registered | Rejection:
        if schema_id not in self.registered:
            # The caller resolves every id of the batch first (schema_ids): reaching this is a bug, not bad input.
            raise LookupError(f"schema id {schema_id} was not resolved before decoding")
        schema = self.registered[schema_id]
        if schema is None:
            return Rejection(RejectCode.UNKNOWN_SCHEMA, f"schema id {schema_id} is not in {self.registry}; once it "
                             "is registered, `stock-ledger rejected replay --reason unknown_schema` applies the record")
        return schema

    def _reader(self, schema: Registered, indexes: tuple[int, ...]) -> AvroReader | ProtoReader | Unreadable:
        slot = (schema.schema_id, indexes)
        reader = self._readers.get(slot)
        if reader is None:
            if schema.schema_type == "AVRO":
                reader = compile_avro(schema.schema_id, schema.text, self.mapping)
            else:
                reader = compile_protobuf(schema.schema_id, schema.text, schema.references, indexes, self.mapping)
            self._readers[slot] = reader
        return reader

    def _json(self, value: bytes, where: str) -> dict[str, object] | Rejection:
        if nests_deeper_than(value, MAX_DEPTH):
            return Rejection(RejectCode.TOO_DEEP, f"value{where} nests JSON more than {MAX_DEPTH} levels deep")
        try:
            document = msgspec.json.decode(value)
        except (msgspec.DecodeError, RecursionError) as exc:
            return Rejection(RejectCode.INVALID_JSON, f"value{where} is not UTF-8 JSON: {exc}")
        if not isinstance(document, dict):
            return Rejection(RejectCode.INVALID_JSON, f"value{where} is not a JSON object")
        names = self._json_names
        return {names[k]: v for k, v in document.items() if k in names}
