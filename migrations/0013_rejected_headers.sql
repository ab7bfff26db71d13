-- A quarantined record keeps its headers beside its key and value: a declared mapping may take a field of the
-- contract from a header (docs/formats.md), and `rejected replay` decodes the record again as it came. A JSON array
-- of [name, value] pairs, each value base64 (a header is bytes) or null; NULL when the record had none.
ALTER TABLE rejected_movements ADD COLUMN IF NOT EXISTS headers jsonb;
