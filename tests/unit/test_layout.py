"""The layout keeps its promises (docs/design.md#layout): every SQL statement is written once in src/, and each
table is written from one module only, so a reader auditing a table's writes reads one file. (The import layering
is `lint-imports`' contract in pyproject.toml, run by `make lint`.)"""

from __future__ import annotations

import ast
import re
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "stock_ledger"
# Our SQL is written in upper-case keywords; a log message or a docstring never starts so.
_SQL = re.compile(r"^\s*(SELECT|INSERT INTO|UPDATE|DELETE FROM|WITH|CREATE|ALTER|SET|GRANT|REVOKE)\s")
_WRITES = r"(?:INSERT INTO|UPDATE|DELETE FROM)\s+{table}\b"
_COPY = r"copy_records_to_table\(\s*\"{table}\""


def _not_statements(tree: ast.AST) -> set[int]:
    """Docstrings, and the pieces of f-strings (an f-string is read whole, its fields as `{}`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
        if isinstance(node, ast.JoinedStr):
            found |= {id(v) for v in node.values}
    return found


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def statements() -> list[tuple[str, str]]:
    """(module, statement with whitespace collapsed) for every SQL string literal in src/."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        skip = _not_statements(tree)
        for node in ast.walk(tree):
            text = _text(node)
            if text is not None and id(node) not in skip and _SQL.match(text):
                found.append((str(path.relative_to(SRC)), " ".join(text.split())))
    return found


def tables() -> set[str]:
    return set(re.findall(r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)", "\n".join(
        p.read_text() for p in (ROOT / "migrations").glob("*.sql")))) | {"schema_migrations"}


def test_the_statements_are_found() -> None:
    """The scan sees the statements it guards (else the next test could pass by finding nothing)."""
    found = statements()
    assert len(found) > 60
    assert any(m == "ledger/offsets.py" and s.startswith("WITH locked AS") for m, s in found)


def test_no_sql_statement_is_written_twice() -> None:
    counts = Counter(s for _, s in statements())
    twice = {s: sorted({m for m, x in statements() if x == s}) for s, n in counts.items() if n > 1}
    assert twice == {}, f"written more than once (one owner, the others call it): {twice}"


def test_each_table_is_written_from_one_module() -> None:
    """INSERT, UPDATE, DELETE and COPY of a table all live in one module: consumer_offsets and ledger_gaps in
    ledger/offsets.py, the movement tables in ledger/movements.py."""
    writers: dict[str, set[str]] = defaultdict(set)
    for table in tables():
        for module, statement in statements():
            if re.search(_WRITES.format(table=table), statement):
                writers[table].add(module)
        for path in sorted(SRC.rglob("*.py")):
            if re.search(_COPY.format(table=table), path.read_text()):
                writers[table].add(str(path.relative_to(SRC)))
    assert {t: sorted(w) for t, w in writers.items() if len(w) > 1} == {}
    assert writers["consumer_offsets"] == writers["ledger_gaps"] == {"ledger/offsets.py"}
    assert writers["stock_movements"] == writers["rejected_movements"] == writers["stock_levels"] == {
        "ledger/movements.py"}


def test_kafka_clients_and_database_sessions_are_made_in_clients_only() -> None:
    """Every Kafka client and every database session comes from clients/kafka.py or clients/database.py, where the
    security settings are applied: a client built anywhere else could forget them."""
    makers = re.compile(r"\b(AIOKafkaConsumer|AIOKafkaProducer|AIOKafkaAdminClient|create_conn|asyncpg\.connect|"
                        r"asyncpg\.create_pool)\(")
    found = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if makers.search(p.read_text())}
    assert found == {"clients/kafka.py", "clients/database.py"}


def test_nothing_edits_the_import_path() -> None:
    """Scripts import the installed package and the test support (`python -m scripts.<tool>` from the repository
    root), the tests the same: no module is reachable under two names."""
    edits = [str(p.relative_to(ROOT)) for d in ("src", "scripts", "tests") for p in (ROOT / d).rglob("*.py")
             if re.search(r"sys\.path\.(insert|append)", p.read_text())]
    assert edits == []
