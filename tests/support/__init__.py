"""What the tests and the benchmark tool share.

- `services`: the project's own Kafka and PostgreSQL (started by scripts/kafka.sh and scripts/postgres.sh), the
  worker's least-privileged role, URLs, scratch databases and topics, worker processes, free ports, the load
  generator pointed at a broker and topic.
- `helpers`: test tools (worker pools, raw producers) and an independent check of the ledger that deliberately
  does not reuse the product's verifier.

Imported as `tests.support` from the repository root: the test suite (pytest puts the root on the path) and the
scripts, run as modules (`python -m scripts.bench ...`).
"""
