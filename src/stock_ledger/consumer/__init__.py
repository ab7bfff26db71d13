"""The consumer half of the guarantee: which partitions this worker may write, and from which offset.

- `assignment`: the state (assigned, claimed, fenced, halted, positions), pure and synchronous.
- `rebalance`: aiokafka's listener (pause on assignment, wait for the batch in flight on revocation).
- `claims`: a claim on the Kafka side: the generation, the reset and seek positions, holes in the log.
- `advice`: Kafka's committed offsets, told after PostgreSQL's, for dashboards only.

May import: ledger (a claim is stored there), clients and the flat modules.
"""
