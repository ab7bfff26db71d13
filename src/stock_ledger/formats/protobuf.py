"""Protobuf values by a schema fetched at run time: the registry's schema text made into a descriptor pool, and a
record's message read from it.

A registry serves a Protobuf schema as `.proto` text (what the Java serializers register) or as a base64
`FileDescriptorProto` (what confluent-kafka's Python serializer registers, and some registries serve as stored).
Both become a `FileDescriptorProto`: the first through proto-schema-parser's syntax tree (a pure-Python parser of
the .proto grammar), converted here field by field; protobuf's own `DescriptorPool` then resolves every type name
and refuses what does not hold together, exactly as protoc would. Imports of Google's well-known types are in the
pool from the start; other imports come from the registry as references. A record is then parsed by protobuf's
own C decoder (upb) into a dynamic message; the contract's fields are read from it by name.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from google.protobuf import (
    any_pb2,
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    empty_pb2,
    field_mask_pb2,
    message_factory,
    struct_pb2,
    timestamp_pb2,
    wrappers_pb2,
)
from google.protobuf.descriptor import FieldDescriptor
from proto_schema_parser import ast
from proto_schema_parser.parser import Parser

from stock_ledger.formats.fields import Unreadable, epoch_time

if TYPE_CHECKING:
    from collections.abc import Sequence

    from google.protobuf.descriptor import Descriptor

    from stock_ledger.mapping import MessageMapping

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS: Final = {
    "double": _FDP.TYPE_DOUBLE, "float": _FDP.TYPE_FLOAT, "int64": _FDP.TYPE_INT64, "uint64": _FDP.TYPE_UINT64,
    "int32": _FDP.TYPE_INT32, "fixed64": _FDP.TYPE_FIXED64, "fixed32": _FDP.TYPE_FIXED32, "bool": _FDP.TYPE_BOOL,
    "string": _FDP.TYPE_STRING, "bytes": _FDP.TYPE_BYTES, "uint32": _FDP.TYPE_UINT32, "sfixed32": _FDP.TYPE_SFIXED32,
    "sfixed64": _FDP.TYPE_SFIXED64, "sint32": _FDP.TYPE_SINT32, "sint64": _FDP.TYPE_SINT64,
}
_INTEGERS: Final = frozenset({
    FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_SFIXED32,
    FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
})
_WELL_KNOWN: Final = (any_pb2, duration_pb2, empty_pb2, field_mask_pb2, struct_pb2, timestamp_pb2, wrappers_pb2)
_TIMESTAMP: Final = "google.protobuf.Timestamp"
_PLAIN, _ENUM, _TIMESTAMP_FIELD = object(), object(), object()


def file_descriptor(name: str, text: str) -> descriptor_pb2.FileDescriptorProto:
    """`text` (.proto source, or a base64 FileDescriptorProto) as a FileDescriptorProto named `name`; ValueError
    saying why not."""
    stripped = text.strip()
    if stripped and " " not in stripped and "\n" not in stripped:
        try:
            proto = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(stripped, validate=True))
        except (binascii.Error, ValueError, Exception) as exc:
            raise ValueError(f"neither .proto text nor a base64 FileDescriptorProto ({exc})") from None
        proto.name = name
        return proto
    try:
        tree = Parser().parse(text)
    except Exception as exc:
        raise ValueError(f"the .proto text does not parse: {exc}") from None
    return _Converter(name).file(tree)


class _Converter:
    """proto-schema-parser's syntax tree -> FileDescriptorProto (type names left as written: the pool resolves
    them relative to the package and the enclosing messages, as protoc does)."""

    def __init__(self, name: str) -> None:
        self.proto = descriptor_pb2.FileDescriptorProto(name=name)

    def file(self, tree: ast.File) -> descriptor_pb2.FileDescriptorProto:
        self.proto.syntax = tree.syntax or "proto2"
        for element in tree.file_elements:
            if isinstance(element, ast.Package):
                self.proto.package = element.name
            elif isinstance(element, ast.Import):
                self.proto.dependency.append(element.name)
            elif isinstance(element, ast.Message):
                self.message(self.proto.message_type.add(), element)
            elif isinstance(element, ast.Enum):
                self.enum(self.proto.enum_type.add(), element)
        return self.proto

    def message(self, out: descriptor_pb2.DescriptorProto, message: ast.Message) -> None:
        out.name = message.name
        for element in message.elements:
            if isinstance(element, ast.Field):
                self.field(out, element)
            elif isinstance(element, ast.MapField):
                self.map_field(out, element)
            elif isinstance(element, ast.OneOf):
                out.oneof_decl.add(name=element.name)
                for member in element.elements:
                    if isinstance(member, ast.Field):
                        self.field(out, member, oneof=len(out.oneof_decl) - 1)
            elif isinstance(element, ast.Message):
                self.message(out.nested_type.add(), element)
            elif isinstance(element, ast.Enum):
                self.enum(out.enum_type.add(), element)
            elif isinstance(element, ast.Group):
                raise ValueError(f"message {message.name}: groups (proto2) are not supported")  # noqa: TRY004

    def field(self, out: descriptor_pb2.DescriptorProto, f: ast.Field, oneof: int | None = None) -> None:
        added = out.field.add(name=f.name, number=f.number)
        cardinality = f.cardinality.value if f.cardinality is not None else None
        added.label = {"REPEATED": _FDP.LABEL_REPEATED, "REQUIRED": _FDP.LABEL_REQUIRED}.get(
            cardinality or "", _FDP.LABEL_OPTIONAL)
        _typed(added, f.type)
        if oneof is not None:
            added.oneof_index = oneof
        elif cardinality == "OPTIONAL" and self.proto.syntax == "proto3":
            # proto3 `optional`: explicit presence through a synthetic oneof, as protoc writes it.
            added.proto3_optional = True
            out.oneof_decl.add(name=f"_{f.name}")
            added.oneof_index = len(out.oneof_decl) - 1

    def map_field(self, out: descriptor_pb2.DescriptorProto, f: ast.MapField) -> None:
        entry = out.nested_type.add(name="".join(p.capitalize() for p in f.name.split("_")) + "Entry")
        entry.options.map_entry = True
        _typed(entry.field.add(name="key", number=1, label=_FDP.LABEL_OPTIONAL), f.key_type)
        _typed(entry.field.add(name="value", number=2, label=_FDP.LABEL_OPTIONAL), f.value_type)
        out.field.add(name=f.name, number=f.number, label=_FDP.LABEL_REPEATED, type=_FDP.TYPE_MESSAGE,
                      type_name=entry.name)

    def enum(self, out: descriptor_pb2.EnumDescriptorProto, enum: ast.Enum) -> None:
        out.name = enum.name
        for value in enum.elements:
            if isinstance(value, ast.EnumValue):
                out.value.add(name=value.name, number=value.number)


def _typed(field: descriptor_pb2.FieldDescriptorProto, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        field.type_name = type_name  # message or enum: the pool decides which when it resolves the name


@dataclass(frozen=True, slots=True)
class ProtoReader:
    """One schema id's message type, and where each contract field is read from it."""

    schema_id: int
    message: Any  # the dynamic message class
    fields: dict[str, FieldDescriptor]  # contract field -> the message's field
    plan: tuple[tuple[str, str, object, FieldDescriptor], ...] = ()

    def __post_init__(self) -> None:
        plan = []
        for name, f in self.fields.items():
            how = {FieldDescriptor.TYPE_ENUM: _ENUM, FieldDescriptor.TYPE_MESSAGE: _TIMESTAMP_FIELD}.get(f.type, _PLAIN)
            plan.append((name, f.name, how, f))
        object.__setattr__(self, "plan", tuple(plan))

    def read(self, payload: bytes) -> dict[str, object] | str:
        """The contract's fields from one message (before the contract's checks), or why the bytes are not one."""
        try:
            message = self.message.FromString(payload)
        except Exception as exc:
            return f"value is not a Protobuf message of schema id {self.schema_id}: {exc}"
        out: dict[str, object] = {}
        for name, attr, how, f in self.plan:
            value = getattr(message, attr)
            if how is _ENUM:
                known = f.enum_type.values_by_number.get(value)
                value = known.name if known is not None else value
            elif how is _TIMESTAMP_FIELD:  # google.protobuf.Timestamp: checked at compile time
                if not message.HasField(attr):
                    continue
                value = _timestamp(value.seconds, value.nanos)
            out[name] = value
        return out


def _timestamp(seconds: int, nanos: int) -> object:
    """A google.protobuf.Timestamp as an aware datetime (to the microsecond: what the ledger stores); one outside
    Python's datetime is returned as the out-of-range marker epoch_time uses."""
    return epoch_time(seconds * 1_000_000 + nanos // 1000, "epoch_micros")


def compile_protobuf(schema_id: int, text: str, references: Sequence[tuple[str, str]], indexes: Sequence[int],
                     mapping: MessageMapping) -> ProtoReader | Unreadable:
    """The reader of one schema id's message (the message indexes of the record's frame pick it in the file), or
    why the ledger cannot read that schema as the contract under `mapping`."""
    try:
        pool = descriptor_pool.DescriptorPool()
        for module in _WELL_KNOWN:
            pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
        for name, referenced in references:
            if not name.startswith("google/protobuf/"):
                pool.Add(file_descriptor(name, referenced))
        proto = file_descriptor(f"stock-ledger/schema-{schema_id}.proto", text)
        file = pool.Add(proto)
    except Exception as exc:
        return Unreadable(f"schema id {schema_id} is not a usable Protobuf schema: {exc}")
    desc = _message_at(list(file.message_types_by_name.values()), indexes)
    if desc is None:
        return Unreadable(f"schema id {schema_id} has no message at index {list(indexes)}")
    fields: dict[str, FieldDescriptor] = {}
    for name in ("movement_id", "warehouse_id", "sku", "qty", "kind", "occurred_at"):
        source = mapping.source(name)
        if not isinstance(source, str):
            continue  # a header
        f = desc.fields_by_name.get(source)
        if f is None:
            return Unreadable(f"schema id {schema_id} (message {desc.full_name}) has no field {source!r} for "
                              f"{name}")
        problem = _type_problem(name, f, mapping)
        if problem:
            return Unreadable(f"schema id {schema_id} (message {desc.full_name}): field {source!r} for {name} is "
                              f"{problem}")
        fields[name] = f
    return ProtoReader(schema_id, message_factory.GetMessageClass(desc), fields)


def _message_at(top: list[Descriptor], indexes: Sequence[int]) -> Descriptor | None:
    """The message the frame's indexes name: [0] is the file's first message, [1, 0] the first nested in the
    second."""
    level: list[Descriptor] = top
    found: Descriptor | None = None
    for i in indexes or [0]:
        if not 0 <= i < len(level):
            return None
        found = level[i]
        level = list(found.nested_types)
    return found


def _type_problem(name: str, f: FieldDescriptor, mapping: MessageMapping) -> str | None:
    """Why this field cannot hold the contract's `name` (None: it can)."""
    if f.is_repeated:
        return "repeated; the contract's fields are single values"
    kind = f.type
    if name == "qty":
        return None if kind in _INTEGERS else "not an integer type"
    if name == "occurred_at":
        wanted = {"rfc3339": "a string", "timestamp": _TIMESTAMP}.get(mapping.occurred_at, "an integer type")
        if mapping.occurred_at == "timestamp":
            ok = kind == FieldDescriptor.TYPE_MESSAGE and f.message_type.full_name == _TIMESTAMP
        elif mapping.occurred_at == "rfc3339":
            ok = kind == FieldDescriptor.TYPE_STRING
        else:
            ok = kind in _INTEGERS
        return None if ok else f"not {wanted} (STOCK_LEDGER_MAPPING occurred_at is {mapping.occurred_at!r})"
    if name == "kind" and kind == FieldDescriptor.TYPE_ENUM:
        return None
    return None if kind == FieldDescriptor.TYPE_STRING else "not a string"
