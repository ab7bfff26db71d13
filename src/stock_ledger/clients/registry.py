"""The Schema Registry's HTTP client (the Confluent-compatible API: Confluent, Apicurio's `/apis/ccompat/v7`,
Karapace, Redpanda), with the TLS and basic-auth settings applied here and nowhere else.

Three answers matter, and are kept apart: a registry that is down, slow or failing (refused, timeout, 5xx, 429, an
answer that is not JSON) raises `RegistryUnavailableError`, which the worker retries like any transient fault; an
id the registry does not know (404) raises `SchemaNotFound`, which the resolver retries for a bounded time and then
quarantines; credentials it refuses (401, 403) and a certificate we cannot verify raise `ConnectionSecurityError`,
fatal at once. A request is a few hundred bytes, once per schema id per process: the standard library's client in
a thread is enough, and no new dependency.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from stock_ledger.clients.tls import certificate_problem
from stock_ledger.errors import ConfigError, ConnectionSecurityError, RegistryUnavailableError

if TYPE_CHECKING:
    from stock_ledger.config import Settings

_ACCEPT: Final = "application/vnd.schemaregistry.v1+json, application/json"
_MAX_BODY: Final = 4 * 1024 * 1024


class SchemaNotFound(Exception):
    """The registry answered 404 for this schema id (or subject version)."""


def registry_ssl_context(settings: Settings) -> ssl.SSLContext:
    """Verify the registry against SCHEMA_REGISTRY_SSL_CA_FILE (else the system CAs); present a client certificate
    if one is set."""
    s = settings
    try:
        context = ssl.create_default_context(cafile=s.schema_registry_ssl_ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"SCHEMA_REGISTRY_SSL_CA_FILE={s.schema_registry_ssl_ca_file!r} holds no usable PEM "
                          f"certificate: {exc}") from None
    context.check_hostname = s.schema_registry_ssl_check_hostname
    if s.schema_registry_ssl_cert_file:
        try:
            context.load_cert_chain(s.schema_registry_ssl_cert_file, s.schema_registry_ssl_key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError("SCHEMA_REGISTRY_SSL_CERT_FILE / SCHEMA_REGISTRY_SSL_KEY_FILE are not a matching PEM "
                              f"certificate and unencrypted key: {type(exc).__name__}") from None
    return context


@dataclass(frozen=True, slots=True)
class RegistryClient:
    url: str  # the base, e.g. http://registry:8081 or https://apicurio/apis/ccompat/v7
    timeout: float
    authorization: str | None
    context: ssl.SSLContext | None
    username: str | None = None

    @classmethod
    def of(cls, settings: Settings) -> RegistryClient:
        s = settings
        if not s.schema_registry_url:
            raise ConfigError("SCHEMA_REGISTRY_URL is required by STOCK_LEDGER_MAPPING (a registry format)")
        auth = None
        if s.schema_registry_username:
            token = f"{s.schema_registry_username}:{s.schema_registry_password or ''}".encode()
            auth = "Basic " + base64.b64encode(token).decode()
        context = registry_ssl_context(s) if s.schema_registry_url.startswith("https://") else None
        return cls(s.schema_registry_url.rstrip("/"), s.schema_registry_timeout_ms / 1000, auth, context,
                   s.schema_registry_username)

    async def schema(self, schema_id: int) -> dict[str, Any]:
        """GET /schemas/ids/{id}: {"schema": text, "schemaType": AVRO (when absent) | PROTOBUF | JSON,
        "references": [{"name", "subject", "version"}]}."""
        return await self._get(f"/schemas/ids/{int(schema_id)}")

    async def version(self, subject: str, version: int) -> dict[str, Any]:
        """GET /subjects/{subject}/versions/{version}: a referenced schema."""
        return await self._get(f"/subjects/{urllib.parse.quote(subject, safe='')}/versions/{int(version)}")

    async def check(self) -> None:
        """One request that any Confluent-compatible registry answers (GET /schemas/types): a URL that lacks the
        API's path (Apicurio's /apis/ccompat/v7) would otherwise answer 404 for every id, and quarantine all."""
        try:
            await self._get("/schemas/types")
        except SchemaNotFound:
            raise ConfigError(f"SCHEMA_REGISTRY_URL={self.url} does not answer as a Confluent-compatible schema "
                              "registry (GET /schemas/types: 404); for Apicurio Registry add /apis/ccompat/v7") \
                from None

    async def _get(self, path: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._get_blocking, path)

    def _get_blocking(self, path: str) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, headers={"Accept": _ACCEPT})  # noqa: S310 - http(s) only
        if self.authorization:
            request.add_unredirected_header("Authorization", self.authorization)
        where = f"the schema registry at {self.url}"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as answer:  # noqa: S310
                body = answer.read(_MAX_BODY)
        except urllib.error.HTTPError as exc:
            self._refused(exc, where, path)
            raise AssertionError("unreachable") from exc  # pragma: no cover - _refused always raises
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise ConnectionSecurityError(certificate_problem(
                    "the schema registry", self.url, reason, "SCHEMA_REGISTRY_SSL_CA_FILE",
                    "set SCHEMA_REGISTRY_SSL_CHECK_HOSTNAME=false")) from None
            raise RegistryUnavailableError(f"{where} did not answer GET {path}: {reason}") from None
        except (OSError, TimeoutError) as exc:
            raise RegistryUnavailableError(f"{where} did not answer GET {path}: {type(exc).__name__}: {exc}") \
                from None
        try:
            document = json.loads(body)
        except ValueError:
            raise RegistryUnavailableError(f"{where} answered GET {path} with something that is not JSON (a proxy's "
                                           f"page?): {body[:80]!r}") from None
        if not isinstance(document, dict | list):
            raise RegistryUnavailableError(f"{where} answered GET {path} with {body[:80]!r}")
        return document if isinstance(document, dict) else {"items": document}

    def _refused(self, exc: urllib.error.HTTPError, where: str, path: str) -> None:
        detail = exc.read(2048).decode("utf-8", "replace").strip()
        if exc.code == 404:
            raise SchemaNotFound(f"{where}: GET {path}: 404 {detail}")
        if exc.code in {401, 403}:
            who = f"user {self.username!r}" if self.username else "anonymous requests (no SCHEMA_REGISTRY_USERNAME)"
            raise ConnectionSecurityError(
                f"{where} refused {who} ({exc.code}): check SCHEMA_REGISTRY_USERNAME and SCHEMA_REGISTRY_PASSWORD "
                "(or SCHEMA_REGISTRY_PASSWORD_FILE)")
        raise RegistryUnavailableError(f"{where} answered GET {path} with {exc.code}: {detail[:200]}")
