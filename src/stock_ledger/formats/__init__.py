"""Declared formats: records that are not the contract's plain JSON read as the contract (docs/formats.md).

- `decode`: `RecordDecoder`, one record -> Movement | Rejection under the mapping (`stock_ledger.mapping`) and the
  schemas already fetched; pure and total, so the batch builder (ledger/batch.py) calls it in the hot path;
  `schema_ids` lists the ids a batch names.
- `avro`, `protobuf`: a registry schema made into a reader of the contract's fields (Avro writer/reader resolution
  with fastavro; a Protobuf descriptor pool from .proto text or a FileDescriptorProto); `fields`: what they share.
- `resolver`: the one part that does I/O: fetches each schema id once from the registry (clients/registry.py),
  tells a registry that is down (transient: the caller retries) from an id it does not know (retried for
  STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS, then quarantined naming the id), and keeps what it fetched.

May import: clients (the resolver only), the foundation. The pure modules do no I/O (pyproject's contracts).
"""
