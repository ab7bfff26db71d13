"""The declared mapping and the formats' pure decoder, without services. Records are written by the libraries'
own writers (fastavro's schemaless_writer, protobuf's SerializeToString), never by our decoder run backwards;
the integration tests (tests/integration/test_formats.py) use confluent-kafka's serializers and a real registry."""

from __future__ import annotations

import datetime as dt
import decimal
import io
import json
import uuid
from typing import Any

import fastavro
import pytest

from stock_ledger.config import load_settings
from stock_ledger.domain import Movement, Rejection
from stock_ledger.errors import ConfigError
from stock_ledger.formats.decode import RecordDecoder, Registered, schema_ids
from stock_ledger.formats.protobuf import file_descriptor
from stock_ledger.ledger.batch import Record
from stock_ledger.mapping import Header, MessageMapping, load_mapping

MID = "6f1c2d8e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"
AT = dt.datetime.fromtimestamp(1_795_000_000, dt.UTC)  # 1_795_000_000 s after the epoch, by the standard library


def avro_value(schema_id: int, schema: dict[str, Any], datum: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), datum)
    return b"\x00" + schema_id.to_bytes(4, "big") + out.getvalue()


def record(fields: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "record", "name": "M", "namespace": "w", "fields": fields}


BASE = [{"name": "movement_id", "type": "string"}, {"name": "warehouse_id", "type": "string"},
        {"name": "sku", "type": "string"}, {"name": "qty", "type": "long"}, {"name": "kind", "type": "string"},
        {"name": "occurred_at", "type": "string"}]
DATUM = {"movement_id": MID, "warehouse_id": "WH", "sku": "S", "qty": 3, "kind": "receipt",
         "occurred_at": "2026-11-29T10:00:00+01:00"}


def avro_decoder(mapping: dict[str, Any], *schemas: tuple[int, dict[str, Any]]) -> RecordDecoder:
    return RecordDecoder(load_mapping(json.dumps({"value": "avro"} | mapping)),
                         {i: Registered(i, "AVRO", json.dumps(s)) for i, s in schemas})


class TestTheMappingIsValidatedAtStart:
    """A mapping no record could satisfy is a start-up error (exit 2) naming the field."""

    @pytest.mark.parametrize(("document", "named"), [
        ({"value": "xml"}, "value 'xml'"),
        ({"colour": 1}, "unknown field 'colour'"),
        ({"fields": {"quantity": "q"}}, "fields.quantity is not a field of the contract"),
        ({"fields": {"qty": {"header": "q"}}}, "fields.qty cannot come from a header"),
        ({"fields": {"sku": "a", "kind": "a"}}, "the value's field 'a' is mapped to two"),
        ({"kind": {"PICK": "picked"}}, "kind.PICK maps to 'picked'"),
        ({"occurred_at": "timestamp"}, 'occurred_at "timestamp" needs a typed timestamp'),
        ({"value": "protobuf", "qty": "decimal"}, 'qty "decimal"'),
        ({"occurred_at": "epoch_nanos"}, "occurred_at 'epoch_nanos' must be one of"),
    ])
    def test_each_unsatisfiable_mapping_names_its_field(self, document: dict[str, Any], named: str) -> None:
        with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace('"', '"')):
            load_mapping(json.dumps(document))

    def test_a_registry_format_without_a_registry_names_the_variable(self) -> None:
        with pytest.raises(ConfigError, match="SCHEMA_REGISTRY_URL"):
            load_settings({"STOCK_LEDGER_MAPPING": '{"value": "avro"}'})

    def test_the_file_form_and_the_default(self, tmp_path: Any) -> None:
        path = tmp_path / "mapping.json"
        path.write_text('{"fields": {"sku": "itemCode", "warehouse_id": {"header": "wh"}}}')
        settings = load_settings({"STOCK_LEDGER_MAPPING_FILE": str(path)})
        assert settings.mapping.fields == {"sku": "itemCode", "warehouse_id": Header("wh")}
        assert load_settings({}).mapping.is_default
        with pytest.raises(ConfigError, match="both STOCK_LEDGER_MAPPING and STOCK_LEDGER_MAPPING_FILE"):
            load_settings({"STOCK_LEDGER_MAPPING_FILE": str(path), "STOCK_LEDGER_MAPPING": "{}"})

    def test_an_unknown_id_must_be_given_up_on_before_the_retry_deadline(self) -> None:
        with pytest.raises(ConfigError, match="STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS"):
            load_settings({"STOCK_LEDGER_MAPPING": '{"value": "avro"}', "SCHEMA_REGISTRY_URL": "http://r",
                           "STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS": "90", "STOCK_LEDGER_RETRY_DEADLINE_SECONDS": "60"})


class TestAvroResolution:
    """Writer schemas resolve against the ledger's reader schema; what cannot is quarantined naming id and field."""

    def test_reordered_added_and_promoted_fields_are_read(self) -> None:
        writer = record([{"name": "extra", "type": ["null", "string"], "default": None}, *reversed(BASE[:3]),
                         {"name": "qty", "type": "int"}, *BASE[4:]])
        m = avro_decoder({}, (7, writer))(b"S", avro_value(7, writer, DATUM | {"extra": "x"}))
        assert isinstance(m, Movement)
        assert (m.qty, m.sku, str(m.movement_id)) == (3, "S", MID)

    @pytest.mark.parametrize(("qty_type", "mapping", "reason"), [
        ("double", {}, "field 'qty' for qty is double"),
        ({"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}, {"qty": "decimal"},
         "scale 0"),
        ({"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 0}, {}, '"qty": "decimal"'),
    ])
    def test_a_schema_the_ledger_cannot_read_names_the_schema_id_and_the_field(
            self, qty_type: Any, mapping: dict[str, Any], reason: str) -> None:
        writer = record([*BASE[:3], {"name": "qty", "type": qty_type}, *BASE[4:]])
        qty: Any = 3.0 if qty_type == "double" else decimal.Decimal(3)
        got = avro_decoder(mapping, (9, writer))(b"S", avro_value(9, writer, DATUM | {"qty": qty}))
        assert isinstance(got, Rejection)
        assert got.code == "incompatible_schema"
        assert "schema id 9" in got.reason
        assert reason in got.reason

    def test_a_missing_field_names_the_mapped_name(self) -> None:
        writer = record(BASE)
        got = avro_decoder({"fields": {"sku": "itemCode"}}, (3, writer))(b"S", avro_value(3, writer, DATUM))
        assert isinstance(got, Rejection)
        assert "has no field 'itemCode' for sku" in got.reason

    def test_a_decimal_of_scale_0_and_epoch_millis_and_a_mapped_kind(self) -> None:
        writer = record([*BASE[:3], {"name": "qty", "type": {"type": "bytes", "logicalType": "decimal",
                                                              "precision": 9, "scale": 0}},
                         {"name": "kind", "type": {"type": "enum", "name": "K", "symbols": ["PICK"]}},
                         {"name": "occurred_at", "type": "long"}])
        datum = DATUM | {"qty": decimal.Decimal(-4), "kind": "PICK", "occurred_at": 1_795_000_000_123}
        m = avro_decoder({"qty": "decimal", "occurred_at": "epoch_millis", "kind": {"PICK": "pick"}},
                         (4, writer))(b"S", avro_value(4, writer, datum))
        assert isinstance(m, Movement)
        assert (m.qty, m.kind, m.occurred_at) == (-4, "pick", AT + dt.timedelta(milliseconds=123))

    @pytest.mark.parametrize("unit", ["timestamp-millis", "timestamp-micros"])
    def test_a_timestamp_reads_the_same_instant_whether_the_schema_needs_resolving_or_not(self, unit: str) -> None:
        """The contract's schema (read as written) and a writer that needs Avro's resolution (a nullable
        timestamp, an int qty, an extra field with a logical type of its own) give the same movement."""
        stamp = {"type": "long", "logicalType": unit}
        exact = record([{"name": "movement_id", "type": {"type": "string", "logicalType": "uuid"}}, *BASE[1:5],
                        {"name": "occurred_at", "type": stamp}])
        resolved = record([*BASE[:3], {"name": "qty", "type": "int"}, BASE[4],
                           {"name": "occurred_at", "type": ["null", stamp]},
                           {"name": "on", "type": {"type": "int", "logicalType": "date"}}])
        at = AT + dt.timedelta(milliseconds=123)
        decoder = avro_decoder({"occurred_at": "timestamp"}, (1, exact), (2, resolved))
        got = [decoder(b"S", avro_value(1, exact, DATUM | {"occurred_at": at})) for _ in range(2)]
        got.append(decoder(b"S", avro_value(2, resolved, DATUM | {"occurred_at": at, "on": dt.date(2026, 1, 2)})))
        assert [(m.occurred_at, m.qty) for m in got if isinstance(m, Movement)] == [(at, 3)] * 3, got
        null = decoder(b"S", avro_value(2, resolved, DATUM | {"occurred_at": None, "on": dt.date(2026, 1, 2)}))
        assert isinstance(null, Rejection)
        assert (null.code, "schema id 2" in null.reason) == ("invalid_encoding", True)

    def test_a_timestamp_outside_the_storable_range_is_out_of_range(self) -> None:
        writer = record([*BASE[:5], {"name": "occurred_at", "type": {"type": "long",
                                                                       "logicalType": "timestamp-micros"}}])
        got = avro_decoder({"occurred_at": "timestamp"}, (5, writer))(
            b"S", avro_value(5, record([*BASE[:5], {"name": "occurred_at", "type": "long"}]),
                             DATUM | {"occurred_at": 2**62}))
        assert isinstance(got, Rejection)
        assert got.code == "out_of_range", got

    def test_bytes_that_do_not_decode_and_an_unknown_id_are_quarantined_never_raised(self) -> None:
        writer = record(BASE)
        decoder = avro_decoder({}, (1, writer))
        decoder.registered = {1: decoder.registered[1], 2: None}  # type: ignore[index]
        value = avro_value(1, writer, DATUM)
        assert decoder(b"S", value[:-4]).code == "invalid_encoding"  # type: ignore[union-attr]
        assert decoder(b"S", b'{"a": 1}').code == "invalid_encoding"  # type: ignore[union-attr]
        unknown = decoder(b"S", b"\x00\x00\x00\x00\x02" + value[5:])
        assert isinstance(unknown, Rejection)
        assert (unknown.code, "schema id 2" in unknown.reason) == ("unknown_schema", True)


class TestKeysHeadersAndTimes:
    def test_a_json_string_key_and_a_header_field(self) -> None:
        decoder = RecordDecoder(load_mapping('{"key": "json_string", "fields": {"warehouse_id": {"header": "w"}}}'))
        value = json.dumps({k: v for k, v in DATUM.items() if k != "warehouse_id"}).encode()
        m = decoder(b'"S"', value, [("w", b"WH-9")])
        assert isinstance(m, Movement)
        assert m.warehouse_id == "WH-9"
        assert decoder(b"S", value, [("w", b"WH-9")]).code == "key_mismatch"  # type: ignore[union-attr]
        missing = decoder(b'"S"', value, [])
        assert isinstance(missing, Rejection)
        assert missing.reason == "header 'w' (warehouse_id) is missing"

    def test_epoch_units_and_out_of_range(self) -> None:
        for unit, value in (("epoch_seconds", 1_795_000_000), ("epoch_millis", 1_795_000_000_000),
                            ("epoch_micros", 1_795_000_000_000_000)):
            m = RecordDecoder(load_mapping(json.dumps({"occurred_at": unit})))(
                b"S", json.dumps(DATUM | {"occurred_at": value}).encode())
            assert isinstance(m, Movement)
            assert m.occurred_at == AT
        far = RecordDecoder(load_mapping('{"occurred_at": "epoch_seconds"}'))(
            b"S", json.dumps(DATUM | {"occurred_at": 10**15}).encode())
        assert far.code == "out_of_range"  # type: ignore[union-attr]

    def test_schema_ids_are_listed_once_per_batch(self) -> None:
        records = [Record(0, i, -1, b"\x00\x00\x00\x00\x05x", b"\x00\x00\x00\x00\x07y") for i in range(100)]
        assert schema_ids(load_mapping('{"value": "avro"}'), records) == {7}
        assert schema_ids(load_mapping('{"value": "avro", "key": "registry"}'), records) == {5, 7}
        assert schema_ids(MessageMapping(), records) == set()


PROTO = """
syntax = "proto3";
package warehouse.v1;
import "google/protobuf/timestamp.proto";
option java_package = "com.example";
message Movement {
  string movement_id = 1;
  string warehouse_id = 2;
  string sku = 3;
  sint64 qty = 4;
  Kind kind = 5;
  google.protobuf.Timestamp occurred_at = 6;
  map<string, string> tags = 7;
  oneof source { string scanner = 8; int32 terminal = 9; }
  optional string note = 10;
  Inner inner = 11;
  message Inner { string z = 1; }
  reserved 20 to 25;
}
enum Kind { KIND_UNSPECIFIED = 0; RECEIPT = 1; PICK = 2; }
"""


class TestProtobufFromProtoText:
    """.proto text, as a Java producer registers it, becomes a descriptor pool; a record written by protobuf's own
    encoder (from protoc-equivalent descriptors the pool built) is read through the mapping."""

    def test_a_proto_file_with_maps_oneofs_optionals_and_nested_types_decodes(self) -> None:
        from google.protobuf import descriptor_pool, message_factory, timestamp_pb2  # noqa: PLC0415

        pool = descriptor_pool.DescriptorPool()
        pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
        pool.Add(file_descriptor("m.proto", PROTO))
        cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("warehouse.v1.Movement"))
        message = cls(movement_id=MID, warehouse_id="WH", sku="S", qty=-2, kind=2, note="n", scanner="s")
        message.tags["a"] = "b"
        message.occurred_at.FromDatetime(dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC))
        value = b"\x00\x00\x00\x00\x0b\x00" + message.SerializeToString()
        decoder = RecordDecoder(load_mapping('{"value": "protobuf", "occurred_at": "timestamp", '
                                             '"kind": {"PICK": "pick"}}'), {11: Registered(11, "PROTOBUF", PROTO)})
        m = decoder(b"S", value)
        assert isinstance(m, Movement)
        assert (m.qty, m.kind, m.occurred_at.microsecond) == (-2, "pick", 678901)
        wrong = RecordDecoder(load_mapping('{"value": "protobuf"}'), {11: Registered(11, "PROTOBUF", PROTO)})(
            b"S", value)
        assert isinstance(wrong, Rejection)
        assert "field 'occurred_at' for occurred_at is not a string" in wrong.reason
        assert wrong.code == "incompatible_schema"
        assert uuid.UUID(MID) == m.movement_id
