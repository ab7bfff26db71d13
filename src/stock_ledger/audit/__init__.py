"""The audit tools: the topic compared with the ledger, by people (`verify`), to fix it (`repair`) and on a timer
(the invariant checks the worker's monitor runs).

- `compare`: the one comparison they share: the topic's committed records and the ledger's offsets as runs, and
  what is missing, repeated or foreign; offsets that held no data record (transaction markers, aborted records) are
  never holes.
- `ranges`: sets of offsets as runs of consecutive offsets (memory grows with the breaks, not the ledger).
- `verify`, `repair`, `invariants`: the three users.

May import: ledger, clients and the flat modules; never the worker or the consumer half.
"""
