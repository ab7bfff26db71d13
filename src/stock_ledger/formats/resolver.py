"""Schema ids -> the schemas the registry holds, each fetched once per process and kept (a schema id never changes
its schema). The one module of formats/ that does I/O, through clients/registry.py.

`resolve(ids)` returns once every id is known or given up on. A registry that is down raises
`RegistryUnavailableError` (nothing is decided: the caller retries, the records wait). An id the registry answers
404 for raises `SchemaPendingError` until `unknown_seconds` have passed since its first 404 (a producer may have
registered it a moment ago, and a registry cluster may not have replicated it yet); then it is given up on: its
records are quarantined as `unknown_schema`, naming the id, and the registry is asked again at most once per
`unknown_seconds` (no waiting), so a schema registered later is used from then on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog

from stock_ledger.clients.registry import RegistryClient, SchemaNotFound
from stock_ledger.errors import RegistryUnavailableError, SchemaPendingError
from stock_ledger.formats.decode import RecordDecoder, Registered, schema_ids

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)


class SchemaResolver:
    def __init__(self, client: RegistryClient, unknown_seconds: float,
                 counted: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.unknown_seconds = unknown_seconds
        self._counted = counted or (lambda _outcome: None)
        self._clock = clock
        self.known: dict[int, Registered | None] = {}  # None: given up on (the registry does not know it)
        self._first_404: dict[int, float] = {}
        self._given_up_at: dict[int, float] = {}
        self.fetches = 0
        self.problem: str | None = None  # why the last resolve failed; None once one succeeds (readiness says it)

    async def resolve(self, ids: Iterable[int]) -> None:
        now = self._clock()
        pending = []
        try:
            for schema_id in sorted(ids):
                if not self._due(schema_id, now):
                    continue
                try:
                    self.known[schema_id] = await self._fetch(schema_id)
                    self._first_404.pop(schema_id, None)
                    self._given_up_at.pop(schema_id, None)
                except SchemaNotFound:
                    if self._not_found(schema_id, now):
                        pending.append(schema_id)
        except RegistryUnavailableError as exc:
            self.problem = f"schema registry unavailable: {exc}"
            raise
        if pending:
            waited = max(now - self._first_404[i] for i in pending)
            message = (f"schema id(s) {', '.join(map(str, pending))} not in the schema registry at {self.client.url} "
                       f"(yet): waiting {waited:.0f}s of STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS={self.unknown_seconds:g} "
                       "before quarantining their records as unknown_schema")
            self.problem = message
            raise SchemaPendingError(pending, message)
        self.problem = None

    def _due(self, schema_id: int, now: float) -> bool:
        if schema_id not in self.known:
            return True
        given_up = self._given_up_at.get(schema_id)
        return given_up is not None and now - given_up >= self.unknown_seconds

    def _not_found(self, schema_id: int, now: float) -> bool:
        """A 404: True while the id is still waited for; False once it is (or stays) given up on."""
        if schema_id in self._given_up_at:
            self._given_up_at[schema_id] = now
            return False
        first = self._first_404.setdefault(schema_id, now)
        if now - first < self.unknown_seconds:
            return True
        log.warning("schema.unknown", schema_id=schema_id, registry=self.client.url, waited_seconds=round(now - first),
                    detail="its records are quarantined as unknown_schema; `rejected replay` applies them once the "
                    "schema is registered")
        self.known[schema_id] = None
        self._given_up_at[schema_id] = now
        self._first_404.pop(schema_id, None)
        return False

    async def _fetch(self, schema_id: int) -> Registered:
        try:
            document = await self.client.schema(schema_id)
        except SchemaNotFound:
            self._counted("not_found")
            raise
        except RegistryUnavailableError:
            self._counted("error")
            raise
        self.fetches += 1
        self._counted("fetched")
        references = await self._references(document.get("references") or [], set())
        log.debug("schema.fetched", schema_id=schema_id, schema_type=document.get("schemaType") or "AVRO",
                 references=[name for name, _ in references])
        return Registered(schema_id, str(document.get("schemaType") or "AVRO"), str(document.get("schema", "")),
                          tuple(references))

    async def _references(self, refs: list[Any], seen: set[str]) -> list[tuple[str, str]]:
        """Every schema referenced, directly or not, as (import name, text), each after the ones it imports."""
        out: list[tuple[str, str]] = []
        for ref in refs:
            name = str(ref.get("name", ""))
            if name in seen or not ref.get("subject"):
                continue
            seen.add(name)
            try:
                document = await self.client.version(str(ref["subject"]), int(ref.get("version", 1)))
            except SchemaNotFound:
                continue  # the schema then fails to compile, naming the missing import: quarantined, said so
            out += await self._references(document.get("references") or [], seen)
            out.append((name, str(document.get("schema", ""))))
        return out


class Formats:
    """A command's view of the declared formats (`rejected replay`, `repair`): the mapping's decoder, with every
    schema id of the records it is about to decode fetched first. No waiting for an unknown id (it is decided now:
    still unknown, still quarantined); a registry that is down fails the command (exit 1, saying so)."""

    def __init__(self, settings: Settings) -> None:
        mapping = settings.mapping
        self.mapping = mapping
        self.resolver = SchemaResolver(RegistryClient.of(settings), 0) if mapping.uses_registry else None
        self.decoder = None if mapping.is_default else RecordDecoder(
            mapping, self.resolver.known if self.resolver else {},
            registry=f"the schema registry at {settings.schema_registry_url}")

    async def decoder_for(self, records: Iterable[Any]) -> RecordDecoder | None:
        """The decoder for these records (None: the contract's plain JSON, `domain.parse`)."""
        if self.resolver is not None:
            await self.resolver.resolve(schema_ids(self.mapping, records))
        return self.decoder
