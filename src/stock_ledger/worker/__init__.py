"""The worker: one process's life (start, main loop, stop) around the two halves of the guarantee.

- `worker`: the Worker (start -> main loop -> stop), signals and health answers.
- `session`: the worker's one database session; `intake` and `commit`: the pipeline (a batch fetched and built
  while the one before it commits); `checks`: what is checked before the first batch.
- `monitor` and `lease`: the timers one pod of the group runs (lag, drift, negative stock, invariant checks).
- `retry`: which faults are transient and the one retry path; `health`: the /metrics, /healthz, /readyz server.

May import: consumer, ledger, audit (the invariant checks the monitor runs), clients and the flat modules.
"""

from stock_ledger.worker.worker import Worker, serve

__all__ = ["Worker", "serve"]
