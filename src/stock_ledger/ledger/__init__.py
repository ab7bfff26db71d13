"""The database half of the guarantee: what PostgreSQL holds and every statement that changes it.

- `transaction`: THE batch transaction (rows, quarantine, levels and the next offsets in one commit).
- `offsets`: every statement on `consumer_offsets` and `ledger_gaps` (positions, epochs, holes).
- `movements`: every write to `stock_movements`, `rejected_movements` and `stock_levels`.
- `claims`: the epoch bump that fences every other writer, and the zombie sessions that block it.
- `batch`: the rows one transaction writes, built from Kafka records by a pure function; `pgtime`: their
  timestamps in PostgreSQL's binary form.
- `stock`: the read-only warehouse queries (`stock show`, `movements`).

May import: clients (sessions), and the flat modules (config, domain, errors, faults, gaps). Never Kafka: the
consumer half calls this one, not the other way round.
"""
