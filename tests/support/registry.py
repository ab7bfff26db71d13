"""The declared formats' test tools: the local Apicurio Registry (scripts/schema-registry.sh), and records in the Schema
Registry wire format written by an independent serializer (confluent-kafka's Avro, Protobuf and JSON Schema
serializers against the registry's Confluent-compatible API), never by the project's decoder run backwards."""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

from tests.support.services import script, script_output

# The contract as an Avro record, exactly as README's "Message format" shows it.
CONTRACT_AVRO: dict[str, Any] = {
    "type": "record", "name": "Movement", "namespace": "warehouse.v1", "fields": [
        {"name": "movement_id", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "warehouse_id", "type": "string"},
        {"name": "sku", "type": "string"},
        {"name": "qty", "type": "long"},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": [
            "receipt", "return", "transfer_in", "pick", "transfer_out", "adjustment"]}},
        {"name": "occurred_at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
    ]}
CONTRACT_AVRO_MAPPING: dict[str, Any] = {"value": "avro", "occurred_at": "timestamp"}


def contract_avro_records(writer: Writer, count: int, skus: int = 60) -> list[tuple[bytes, bytes, list[Any]]]:
    """`count` receipts of qty 1 in the contract's Avro schema, keyed by SKU as UTF-8."""
    serialize, value = writer.avro(CONTRACT_AVRO), writer.context()
    when = dt.datetime(2026, 11, 29, 9, 0, 0, 123456, tzinfo=dt.UTC)
    return [(f"SKU-{i % skus}".encode(), serialize({
        "movement_id": str(uuid.uuid4()), "warehouse_id": "WH-1", "sku": f"SKU-{i % skus}", "qty": 1,
        "kind": "receipt", "occurred_at": when}, value), []) for i in range(count)]


# The contract as an Avro record, with the names and forms a warehouse team's topic might have (README "Message
# format" shows the contract's own names): a renamed sku, kind as an enum of upper-case symbols, qty a decimal of
# scale 0, occurred_at a timestamp-millis, and a field the ledger does not read.
AVRO_V1: dict[str, Any] = {
    "type": "record", "name": "StockMovement", "namespace": "com.example.warehouse", "fields": [
        {"name": "movement_id", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "itemCode", "type": "string"},
        {"name": "qty", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 0}},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["RECEIPT", "PICK", "ADJUSTMENT"]}},
        {"name": "occurred_at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "operator", "type": "string"},
    ]}
# v2, as the producer team evolved it: fields reordered, an optional field added, one dropped.
AVRO_V2: dict[str, Any] = {
    "type": "record", "name": "StockMovement", "namespace": "com.example.warehouse", "fields": [
        {"name": "occurred_at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["RECEIPT", "PICK", "ADJUSTMENT"]}},
        {"name": "batch_note", "type": ["null", "string"], "default": None},
        {"name": "itemCode", "type": "string"},
        {"name": "movement_id", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "qty", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 0}},
    ]}
# A schema the ledger cannot read: qty as a double.
AVRO_FLOAT_QTY: dict[str, Any] = {
    "type": "record", "name": "StockMovement", "namespace": "com.example.warehouse", "fields": [
        {"name": "movement_id", "type": "string"}, {"name": "itemCode", "type": "string"},
        {"name": "qty", "type": "double"}, {"name": "kind", "type": "string"},
        {"name": "occurred_at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ]}
# Its mapping: sku <- itemCode, warehouse_id from the `warehouse` header, kinds mapped, decimal qty, timestamp.
AVRO_MAPPING: dict[str, Any] = {
    "value": "avro", "key": "registry", "fields": {"sku": "itemCode", "warehouse_id": {"header": "warehouse"}},
    "occurred_at": "timestamp", "qty": "decimal",
    "kind": {"RECEIPT": "receipt", "PICK": "pick", "ADJUSTMENT": "adjustment"},
}
PROTOBUF_MAPPING: dict[str, Any] = {"value": "protobuf", "occurred_at": "timestamp",
                                    "kind": {"RECEIPT": "receipt", "PICK": "pick"}}
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#", "title": "StockMovement", "type": "object",
    "properties": {"id": {"type": "string"}, "warehouse_id": {"type": "string"}, "sku": {"type": "string"},
                   "qty": {"type": "integer"}, "kind": {"type": "string"}, "ts": {"type": "integer"}},
    "required": ["id", "warehouse_id", "sku", "qty", "kind", "ts"]}
JSON_SCHEMA_MAPPING: dict[str, Any] = {"value": "json_schema", "key": "json_string",
                                       "fields": {"movement_id": "id", "occurred_at": "ts"},
                                       "occurred_at": "epoch_millis"}


def registry_url() -> str:
    """The registry the tests use: SCHEMA_REGISTRY_URL if set, else scripts/schema-registry.sh's (started if needed)."""
    if os.environ.get("SCHEMA_REGISTRY_URL"):
        return os.environ["SCHEMA_REGISTRY_URL"]
    script_output("schema-registry.sh", "start")
    return script_output("schema-registry.sh", "url")


def registry_control(action: str) -> None:
    """stop/kill/start the scripts' registry (fails the test with the script's words)."""
    done = script("schema-registry.sh", action)
    assert done.returncode == 0, f"scripts/schema-registry.sh {action}: {done.stderr}{done.stdout}"


def movement_proto_class() -> Any:
    """The contract as a Protobuf message (README "Message format"), built with protobuf's own descriptor API: the
    class confluent-kafka's serializer writes (and registers, as a base64 FileDescriptorProto)."""
    fdp = descriptor_pb2.FileDescriptorProto(name="warehouse/movement.proto", package="warehouse.v1",
                                             syntax="proto3", dependency=["google/protobuf/timestamp.proto"])
    kind = fdp.enum_type.add(name="Kind")
    for number, name in enumerate(["KIND_UNSPECIFIED", "RECEIPT", "PICK"]):
        kind.value.add(name=name, number=number)
    message = fdp.message_type.add(name="Movement")
    f = descriptor_pb2.FieldDescriptorProto
    for number, (name, kind_of) in enumerate([("movement_id", f.TYPE_STRING), ("warehouse_id", f.TYPE_STRING),
                                              ("sku", f.TYPE_STRING), ("qty", f.TYPE_SINT64)], 1):
        message.field.add(name=name, number=number, type=kind_of, label=f.LABEL_OPTIONAL)
    message.field.add(name="kind", number=5, type=f.TYPE_ENUM, type_name=".warehouse.v1.Kind", label=f.LABEL_OPTIONAL)
    message.field.add(name="occurred_at", number=6, type=f.TYPE_MESSAGE, type_name=".google.protobuf.Timestamp",
                      label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("warehouse.v1.Movement"))


@dataclass
class Writer:
    """confluent-kafka's serializer for one topic's values (and keys), registering schemas as a producer would."""

    url: str
    topic: str

    def __post_init__(self) -> None:
        # A deadline per request: the client's own retries (network errors and timeouts, max.retries) then
        # recover a request the registry never answers; with none, it blocked in recv until pytest's timeout.
        self.client = SchemaRegistryClient({"url": self.url, "timeout": 15})

    def close(self) -> None:
        self.client.close()

    def context(self, field: str = MessageField.VALUE) -> SerializationContext:
        return SerializationContext(self.topic, field)

    def avro(self, schema: dict[str, Any]) -> AvroSerializer:
        return AvroSerializer(self.client, json.dumps(schema))

    def avro_key(self, sku: str) -> bytes:
        return bytes(AvroSerializer(self.client, '"string"')(sku, self.context(MessageField.KEY)))

    def protobuf(self) -> ProtobufSerializer:
        return ProtobufSerializer(movement_proto_class(), self.client, {"use.deprecated.format": False})

    def json_schema(self) -> JSONSerializer:
        return JSONSerializer(json.dumps(JSON_SCHEMA), self.client)


def avro_movement(sku: str, qty: int = 1, kind: str = "RECEIPT", **extra: Any) -> dict[str, Any]:
    import decimal  # noqa: PLC0415 - only here

    return {"movement_id": str(uuid.uuid4()), "itemCode": sku, "qty": decimal.Decimal(qty), "kind": kind,
            "occurred_at": dt.datetime(2026, 11, 29, 9, 0, tzinfo=dt.UTC), "operator": "op-7"} | extra


def framed(schema_id: int, payload: bytes) -> bytes:
    """The Schema Registry wire format around `payload` (for poison records only: a real id, bad bytes)."""
    return b"\x00" + schema_id.to_bytes(4, "big") + payload


async def send_with_headers(bootstrap: str, topic: str,
                            records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]) -> None:
    """Send exactly these keys, values and headers (an idempotent producer: no broker-side duplicates)."""
    from aiokafka import AIOKafkaProducer  # noqa: PLC0415 - only here

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [await producer.send(topic, key=k, value=v, headers=h) for k, v, h in records]
        await producer.flush()
        for f in futures:
            await f
    finally:
        await producer.stop()
