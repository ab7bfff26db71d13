"""The one settings object, built from the environment by a pure function.

Every variable is declared, with what it means, in `VARIABLES`; the configuration reference in
docs/configuration.md and README.md is generated from it. A bad value fails at start with the variable's name
(`ConfigError`, exit code 2), never later in the hot path.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, TypeVar
from urllib.parse import parse_qsl, urlsplit

from stock_ledger.errors import ConfigError
from stock_ledger.mapping import MessageMapping, load_mapping

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

OffsetReset = Literal["earliest", "latest", "none"]
LogFormat = Literal["auto", "json", "console"]
OnGap = Literal["halt", "record"]
# How DATABASE_URL's sessions are pooled: each connection a session of its own (directly, PgBouncer's session mode),
# or server sessions shared between clients per transaction (PgBouncer's transaction mode): docs/pgbouncer.md.
DatabasePooling = Literal["session", "transaction"]



# ------------------------------------------------------------------------------ security settings (issue 11)
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
SslMode = Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
# Weakest first: a URL whose mode sorts before STOCK_LEDGER_DATABASE_SSLMODE_MIN refuses to start.
SSLMODES: tuple[SslMode, ...] = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_NOT_SHOWN = "(the value is not shown: it may contain a password)"
# Query parameters whose values are shown when a URL is logged; any other value is masked (password,
# sslpassword, and whatever a mistyped password spilled into the query).
_SHOWN_PARAMS = frozenset({
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslcrl", "sslnegotiation", "ssl_min_protocol_version",
    "ssl_max_protocol_version", "target_session_attrs", "application_name", "host", "port", "user", "dbname",
    "database", "passfile", "service", "krbsrvname", "gsslib",
})
_PARAM_NAME = re.compile(r"^[a-z_][a-z0-9_.]*$")
_PORT = re.compile(r"^[0-9]{1,5}$")


def _check_database_url(url: str) -> None:
    """Raise ValueError (a message without any part of the URL) unless asyncpg reads `url` the way it looks.

    asyncpg splits the userinfo at the FIRST '@' and the password at the first ':'; urllib ends the authority at
    the first '/', '?' or '#'. A password holding any of these unencoded would be read as host, port, path or
    query, and could then be printed as such: all of these shapes are refused, with the fix.
    """
    if not url.startswith(("postgresql://", "postgres://")):
        raise ValueError("must start with postgresql:// (postgresql://user:password@host:5432/dbname)")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("is not a valid URL (postgresql://user:password@host:5432/dbname)") from None
    encode = "percent-encode '@', ':', '/', '?', '#' and '%' in the user name and password (e.g. '@' as %40)"
    if parts.netloc.count("@") > 1 or "@" in parts.path + parts.query + parts.fragment or parts.fragment:
        raise ValueError(f"has an unencoded special character in its user name or password: {encode}")
    for host in parts.netloc.rpartition("@")[2].split(","):
        port = host.rpartition("]")[2].partition(":")[2] if ":" in host.rpartition("]")[2] else None
        if port is not None and not (_PORT.match(port) and 0 < int(port) < 65536):
            raise ValueError(f"has a port that is not a number from 1 to 65535 (or {encode})")
    try:
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True) if parts.query else []
    except ValueError:
        raise ValueError(f"has a malformed query string: use ?name=value&name=value ({encode})") from None
    for key, value in query:
        if key == "sslmode" and value not in SSLMODES:
            raise ValueError(f"has an unknown sslmode: use one of {', '.join(SSLMODES)}")


def url_sslmode(url: str, environ: Mapping[str, str]) -> SslMode:
    """The sslmode asyncpg will use: the URL's, else PGSSLMODE's, else its default `prefer`."""
    query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    mode = query.get("sslmode") or environ.get("PGSSLMODE") or "prefer"
    return mode if mode in SSLMODES else "prefer"


def _mask(url: str | None) -> str | None:
    """The URL with every secret replaced by ***, rebuilt from its parts so that no shape can leak one.

    Only a URL that passed `_check_database_url` is shown at all; it keeps user, hosts, database and the known
    non-secret parameters, so an operator still sees where the worker connects.
    """
    if url is None:
        return None
    try:
        _check_database_url(url)
    except ValueError:
        return f"<malformed DATABASE_URL, not shown> {_NOT_SHOWN}"
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    params = [f"{k}={v}" if k in _SHOWN_PARAMS else f"{k}=***"
              for k, v in parse_qsl(parts.query, keep_blank_values=True) if _PARAM_NAME.match(k)]
    query = f"?{'&'.join(params)}" if params else ""
    return f"{parts.scheme}://{user}{':***' if colon else ''}{at}{hosts}{parts.path}{query}"


def _read_secret_file(name: str, path: str) -> str:
    """The content of a mounted secret, without the trailing newline editors and `kubectl create secret` add."""
    try:
        value = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(f"{name}={path!r} cannot be read: {exc.strerror or type(exc).__name__}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}={path!r} is not UTF-8 text") from None
    if not value:
        raise ConfigError(f"{name}={path!r} is empty")
    return value


def _with_secret_files(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with each secret read from its *_FILE variable (Kubernetes mounts secrets as files)."""
    merged = dict(environ)
    for name in ("DATABASE_URL", "KAFKA_SASL_PASSWORD", "SCHEMA_REGISTRY_PASSWORD"):
        path = environ.get(f"{name}_FILE", "").strip()
        if not path:
            continue
        if environ.get(name, "").strip():
            raise ConfigError(f"both {name} and {name}_FILE are set: set only one")
        merged[name] = _read_secret_file(f"{name}_FILE", path)
    return merged


def _verbatim_secrets(environ: Mapping[str, str]) -> dict[str, object]:
    """The SASL password exactly as given: unlike other values it is not stripped (it may end with a space)."""
    names = {"KAFKA_SASL_PASSWORD": "kafka_sasl_password", "SCHEMA_REGISTRY_PASSWORD": "schema_registry_password"}
    return {attr: environ[name] for name, attr in names.items() if environ.get(name)}


def _load_mapping(environ: Mapping[str, str]) -> MessageMapping:
    """STOCK_LEDGER_MAPPING, or the file STOCK_LEDGER_MAPPING_FILE names (a mounted ConfigMap); the contract's own
    plain JSON when neither is set."""
    inline, path = environ.get("STOCK_LEDGER_MAPPING", "").strip(), environ.get("STOCK_LEDGER_MAPPING_FILE", "").strip()
    if inline and path:
        raise ConfigError("both STOCK_LEDGER_MAPPING and STOCK_LEDGER_MAPPING_FILE are set: set only one")
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"STOCK_LEDGER_MAPPING_FILE={path!r} cannot be read: {exc}") from None
        return load_mapping(text, f"STOCK_LEDGER_MAPPING_FILE ({path})")
    return load_mapping(inline) if inline else MessageMapping()


def _check_registry(s: Settings) -> None:
    """A mapping that needs the registry has one; the registry's TLS and login settings hold together."""
    m = s.mapping
    if m.uses_registry and not s.schema_registry_url:
        what = f"value {m.value!r}" if m.value != "json" else 'key "registry"'
        raise ConfigError(f"STOCK_LEDGER_MAPPING declares {what}, read through a schema registry: set "
                          "SCHEMA_REGISTRY_URL (e.g. http://registry:8081, or Apicurio's .../apis/ccompat/v7)")
    url = s.schema_registry_url or ""
    if url and not url.startswith(("http://", "https://")):
        raise ConfigError(f"SCHEMA_REGISTRY_URL={url!r} must start with http:// or https://")
    files = {"SCHEMA_REGISTRY_SSL_CA_FILE": s.schema_registry_ssl_ca_file,
             "SCHEMA_REGISTRY_SSL_CERT_FILE": s.schema_registry_ssl_cert_file,
             "SCHEMA_REGISTRY_SSL_KEY_FILE": s.schema_registry_ssl_key_file}
    if any(files.values()) and not url.startswith("https://"):
        raise ConfigError("SCHEMA_REGISTRY_SSL_* is set but SCHEMA_REGISTRY_URL is not https://")
    if bool(s.schema_registry_ssl_cert_file) != bool(s.schema_registry_ssl_key_file):
        raise ConfigError("SCHEMA_REGISTRY_SSL_CERT_FILE and SCHEMA_REGISTRY_SSL_KEY_FILE go together: set both or "
                          "neither")
    for name, path in files.items():
        if path and not Path(path).is_file():
            raise ConfigError(f"{name}={path!r} is not a readable file")
    if bool(s.schema_registry_username) != bool(s.schema_registry_password):
        raise ConfigError("SCHEMA_REGISTRY_USERNAME and SCHEMA_REGISTRY_PASSWORD (or _FILE) go together")
    if 0 < s.retry_deadline_seconds <= s.schema_unknown_seconds and m.uses_registry:
        raise ConfigError(
            f"STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS={s.schema_unknown_seconds:g} must be shorter than "
            f"STOCK_LEDGER_RETRY_DEADLINE_SECONDS={s.retry_deadline_seconds:g}: else the worker exits before it "
            "quarantines a record whose schema id the registry does not know")


def _check_security(s: Settings, environ: Mapping[str, str]) -> None:
    """Combinations that would silently connect less securely than the operator asked for are refused."""
    sasl = s.kafka_security_protocol.startswith("SASL_")
    tls = s.kafka_security_protocol.endswith("SSL")
    if sasl:
        missing = [n for n, v in (("KAFKA_SASL_MECHANISM", s.kafka_sasl_mechanism),
                                  ("KAFKA_SASL_USERNAME", s.kafka_sasl_username),
                                  ("KAFKA_SASL_PASSWORD (or KAFKA_SASL_PASSWORD_FILE)", s.kafka_sasl_password))
                   if not v]
        if missing:
            raise ConfigError(f"KAFKA_SECURITY_PROTOCOL={s.kafka_security_protocol} needs {', '.join(missing)}")
    elif s.kafka_sasl_mechanism or s.kafka_sasl_username or s.kafka_sasl_password:
        raise ConfigError(f"KAFKA_SASL_* is set but KAFKA_SECURITY_PROTOCOL={s.kafka_security_protocol} does not "
                          "authenticate: set KAFKA_SECURITY_PROTOCOL=SASL_SSL (or unset the KAFKA_SASL_* variables)")
    files = {"KAFKA_SSL_CA_FILE": s.kafka_ssl_ca_file, "KAFKA_SSL_CERT_FILE": s.kafka_ssl_cert_file,
             "KAFKA_SSL_KEY_FILE": s.kafka_ssl_key_file}
    if not tls and any(files.values()):
        raise ConfigError(f"KAFKA_SSL_* is set but KAFKA_SECURITY_PROTOCOL={s.kafka_security_protocol} does not use "
                          "TLS: set KAFKA_SECURITY_PROTOCOL=SSL or SASL_SSL")
    if bool(s.kafka_ssl_cert_file) != bool(s.kafka_ssl_key_file):
        raise ConfigError("KAFKA_SSL_CERT_FILE and KAFKA_SSL_KEY_FILE go together (mutual TLS): set both or neither")
    for name, path in files.items():
        if path and not Path(path).is_file():
            raise ConfigError(f"{name}={path!r} is not a readable file")
    if s.database_url is not None:
        mode = url_sslmode(s.database_url, environ)
        if SSLMODES.index(mode) < SSLMODES.index(s.database_sslmode_min):
            raise ConfigError(
                f"DATABASE_URL uses sslmode={mode}, weaker than STOCK_LEDGER_DATABASE_SSLMODE_MIN="
                f"{s.database_sslmode_min}: add ?sslmode={s.database_sslmode_min}&sslrootcert=<CA file> to the URL"
            )


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}={raw!r} must be true or false")
# ------------------------------------------------------------------------------ end of security settings


@dataclass(frozen=True, slots=True)
class Settings:
    kafka_bootstrap_servers: str = "localhost:9092"
    database_url: str | None = field(default=None, repr=False)
    topic: str = "warehouse.movements"
    group_id: str = "stock-ledger"
    group_instance_id: str | None = None
    metrics_port: int = 9108
    session_timeout_ms: int = 10_000
    rebalance_timeout_ms: int = 30_000
    # How often the consumer refreshes the topic's metadata: partitions added at runtime are found (and the group
    # rebalances onto them) within about this long. aiokafka's default is 300000 (five minutes).
    metadata_max_age_ms: int = 5_000
    batch_max_records: int = 5_000
    batch_max_wait_ms: int = 200
    auto_offset_reset: OffsetReset = "earliest"
    # A hole in the log (stored offset below the log start, or past the log end): halt the partition, or record
    # the skipped range in ledger_gaps and move on (below the log start only).
    on_gap: OnGap = "halt"
    retry_deadline_seconds: float = 60.0
    lock_timeout_ms: int = 5_000
    idle_in_transaction_timeout_ms: int = 15_000
    # How long the worker waits for PostgreSQL to answer a statement (client side: a blackholed network sends no
    # error and no close, and neither the server's timeouts nor TCP keepalives through a proxy reach the client).
    database_reply_timeout_ms: int = 30_000
    shutdown_grace_seconds: float = 8.0
    stall_seconds: float = 60.0
    position_refresh_seconds: float = 5.0
    invariant_refresh_seconds: float = 60.0
    # The full pass of the invariants (a scan of stock_movements); the checks in between cost what changed.
    invariant_full_scan_seconds: float = 21_600.0
    # How often a running worker reads the topic's cleanup.policy (compaction switched on halts it): its own setting,
    # as an invariant refresh of an hour (the advice for large ledgers) would leave compaction unseen that long.
    compaction_check_seconds: float = 60.0
    # Closing balances (ledger/closings.py): how often the monitor's leader takes one (0: never), and after how many
    # days the old ones are thinned to the first of each UTC day.
    closing_seconds: float = 3_600.0
    closing_daily_after_days: int = 7
    log_level: str = "info"
    log_format: LogFormat = "auto"
    migrations_dir: str | None = None
    # `stock-ledger migrate`: how long to wait for the database and retry lock timeouts, and the DDL's timeouts.
    migrate_deadline_seconds: float = 240.0
    migrate_lock_timeout_ms: int = 2_000
    migrate_statement_timeout_ms: int = 600_000
    # `stock-ledger archive` (docs/operations.md, "Retention and archival"): where archives are written, and how many
    # days of movements stay online (None: archival is off; `archive run` refuses and says so).
    archive_dir: str | None = None
    retention_days: int | None = None
    # Test-only crash points, see faults.py. Never set in production.
    fault: str | None = None
    # Connection security (docs/security.md); secrets stay out of repr and are masked in loggable().
    kafka_security_protocol: SecurityProtocol = "PLAINTEXT"
    kafka_sasl_mechanism: SaslMechanism | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: str | None = field(default=None, repr=False)
    kafka_ssl_ca_file: str | None = None
    kafka_ssl_cert_file: str | None = None
    kafka_ssl_key_file: str | None = None
    kafka_ssl_check_hostname: bool = True
    database_sslmode_min: SslMode = "disable"
    # Declared formats (docs/formats.md): the mapping, and the schema registry that registry formats are read from.
    mapping: MessageMapping = field(default_factory=MessageMapping)
    schema_registry_url: str | None = None
    schema_registry_username: str | None = None
    schema_registry_password: str | None = field(default=None, repr=False)
    schema_registry_ssl_ca_file: str | None = None
    schema_registry_ssl_cert_file: str | None = None
    schema_registry_ssl_key_file: str | None = None
    schema_registry_ssl_check_hostname: bool = True
    schema_registry_timeout_ms: int = 5_000
    schema_unknown_seconds: float = 30.0
    database_pooling: DatabasePooling = "session"
    # The NOLOGIN roles `migrate` grants the worker's and the readers' privileges to (docs/security.md): one pair per
    # ledger where several ledgers share a PostgreSQL cluster (role names are cluster-wide).
    app_role: str = "stock_ledger_app"
    reader_role: str = "stock_ledger_reader"

    @property
    def database_url_masked(self) -> str | None:
        return _mask(self.database_url)

    def require_database_url(self) -> str:
        if not self.database_url:
            raise ConfigError(
                "DATABASE_URL is required for this command, e.g. postgresql://user:pass@host:5432/stock_ledger"
            )
        return self.database_url

    def loggable(self) -> dict[str, object]:
        values = dataclasses.asdict(self)
        values["database_url"] = self.database_url_masked
        values["kafka_sasl_password"] = "***" if self.kafka_sasl_password else None
        values["schema_registry_password"] = "***" if self.schema_registry_password else None
        values["mapping"] = self.mapping.describe()
        return values


_Number = TypeVar("_Number", int, float)


def _parse_number(name: str, raw: str, low: _Number, high: _Number, convert: Callable[[str], _Number]) -> _Number:
    """`convert` is int or float; the value must lie in [low, high]."""
    try:
        value = convert(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {'an integer' if convert is int else 'a number'}") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} is out of range [{low}, {high}]")
    return value


def _parse_choice(name: str, raw: str, choices: tuple[str, ...], case: Callable[[str], str] = str.lower) -> str:
    value = case(raw.strip())
    if value not in choices:
        raise ConfigError(f"{name}={raw!r} must be one of {', '.join(choices)}")
    return value


def _text(name: str, raw: str) -> str:
    if len(raw) > 1024:
        raise ConfigError(f"{name} is longer than 1024 characters")
    return raw


@dataclass(frozen=True, slots=True)
class Parser:
    """How a variable's text becomes a value, and what it accepts in words (for the configuration reference)."""

    accepts: str
    parse: Callable[[str, str], object]

    def __call__(self, name: str, raw: str) -> object:
        return self.parse(name, raw)


def _ints(low: int, high: int) -> Parser:
    return Parser(f"integer {low}..{high}", lambda name, raw: _parse_number(name, raw, low, high, int))


def _floats(low: float, high: float) -> Parser:
    return Parser(f"number {low:g}..{high:g}", lambda name, raw: _parse_number(name, raw, low, high, float))


def _choice(*choices: str) -> Parser:
    return Parser(", ".join(choices), lambda name, raw: _parse_choice(name, raw, choices))


def _upper(*choices: str) -> Parser:
    return Parser(", ".join(choices), lambda name, raw: _parse_choice(name, raw.upper(), choices, str.upper))


def _deadline(name: str, raw: str) -> float:
    """0 means retry forever; anything else is at least a second."""
    value = _parse_number(name, raw, 0.0, 86_400.0, float)
    if 0 < value < 1:
        raise ConfigError(f"{name}={value} must be 0 (retry forever) or between 1 and 86400 seconds")
    return value


def _parse_database_url(name: str, raw: str) -> str:
    try:
        _check_database_url(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} {exc} {_NOT_SHOWN}") from None
    return raw


_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def _parse_topic(name: str, raw: str) -> str:
    if not _TOPIC.match(raw):
        raise ConfigError(f"{name}={raw!r} is not a valid Kafka topic name ([A-Za-z0-9._-], 1-249 chars)")
    return raw


# Lower-case letters, digits and underscores: written the same as an identifier and inside a literal, so the name
# `migrate` puts into a migration's SQL can never change what that SQL says (migrate.Roles).
_ROLE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _parse_role(name: str, raw: str) -> str:
    if not _ROLE.match(raw):
        raise ConfigError(f"{name}={raw!r} is not a role name stock-ledger accepts: 1 to 63 lower-case letters, "
                          "digits and underscores, not starting with a digit")
    return raw


_TEXT = Parser("text, at most 1024 characters", _text)
_FILE = Parser("a file path", _text)


@dataclass(frozen=True, slots=True)
class Variable:
    """One environment variable: the Settings field it sets, how it is parsed, and what it means.

    `docs/configuration.md` and README.md ("Configuration") are generated from this table
    (`python -m stock_ledger.reference --write`), and a test keeps them in step.
    """

    name: str
    attr: str | None  # None: read by _with_secret_files / _verbatim_secrets, not by the loop in load_settings
    parse: Parser
    meaning: str
    shown_default: str | None = None  # instead of the Settings default, where that says too little


VARIABLES: Final[tuple[Variable, ...]] = (
    Variable("KAFKA_BOOTSTRAP_SERVERS", "kafka_bootstrap_servers", _TEXT, "the brokers, `host:port[,host:port...]`"),
    Variable("DATABASE_URL", "database_url", Parser("a postgresql:// URL", _parse_database_url),
             "`postgresql://user:pass@host:5432/db[?sslmode=...&target_session_attrs=read-write]`; several hosts "
             "allowed; never logged; percent-encode `@ : / ? # %` in the password",
             "required by run, migrate, verify"),
    Variable("DATABASE_URL_FILE", None, _FILE, "read `DATABASE_URL` from this file (a mounted Secret), trailing "
             "newline dropped; not together with `DATABASE_URL`"),
    Variable("STOCK_LEDGER_TOPIC", "topic", Parser("a topic name: A-Z a-z 0-9 . _ -, 1..249", _parse_topic),
             "the topic"),
    Variable("STOCK_LEDGER_GROUP_ID", "group_id", _TEXT, "consumer group; offsets in PostgreSQL are per group, "
             "one group per database"),
    Variable("STOCK_LEDGER_GROUP_INSTANCE_ID", "group_instance_id", _TEXT, "static membership id (the chart "
             "leaves it unset: measured slower for rollouts); a static member sends no LeaveGroup"),
    Variable("STOCK_LEDGER_METRICS_PORT", "metrics_port", _ints(0, 65535), "`/metrics`, `/healthz`, `/readyz`"),
    Variable("STOCK_LEDGER_SESSION_TIMEOUT_MS", "session_timeout_ms", _ints(1_000, 300_000),
             "Kafka session; heartbeats every third of it"),
    Variable("STOCK_LEDGER_REBALANCE_TIMEOUT_MS", "rebalance_timeout_ms", _ints(1_000, 600_000),
             "how long a rebalance waits for members (at least the session timeout); revocation waits half of "
             "it for the batch in flight"),
    Variable("STOCK_LEDGER_METADATA_MAX_AGE_MS", "metadata_max_age_ms", _ints(1_000, 3_600_000),
             "topic metadata refresh: partitions added at runtime are read within about this long"),
    Variable("STOCK_LEDGER_BATCH_MAX_RECORDS", "batch_max_records", _ints(1, 100_000),
             "records per batch transaction at most"),
    Variable("STOCK_LEDGER_BATCH_MAX_WAIT_MS", "batch_max_wait_ms", _ints(1, 60_000),
             "how long a fetch waits for records"),
    Variable("STOCK_LEDGER_AUTO_OFFSET_RESET", "auto_offset_reset", _choice("earliest", "latest", "none"),
             "where a partition with no stored offset starts (`none`: refuse)"),
    Variable("STOCK_LEDGER_ON_GAP", "on_gap", _choice("halt", "record"),
             "a stored offset outside the log: `halt` pauses the partition and says why; `record` writes the "
             "range to `ledger_gaps` and moves past it (below the log start only)"),
    # 0 = retry forever (the chart's default: stay alive and NotReady rather than crash-loop with back-off).
    Variable("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "retry_deadline_seconds",
             Parser("0, or a number 1..86400", _deadline),
             "each operation retries transient faults this long from its first fault, then the worker exits 1; "
             "`0` = retry forever while NotReady (the chart's setting)"),
    Variable("STOCK_LEDGER_LOCK_TIMEOUT_MS", "lock_timeout_ms", _ints(100, 600_000),
             "a claim or batch waiting on a row lock gives up and retries; after half of it a claim terminates "
             "the blocking sessions of this group (zombies)"),
    Variable("STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS", "idle_in_transaction_timeout_ms",
             _ints(1_000, 3_600_000), "the server ends a session frozen inside a transaction, freeing its locks"),
    Variable("STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS", "database_reply_timeout_ms", _ints(1_000, 3_600_000),
             "the worker gives up on a statement PostgreSQL leaves unanswered this long, drops the session and "
             "retries on a new one (a network blackhole sends no error and closes nothing); must exceed "
             "`STOCK_LEDGER_LOCK_TIMEOUT_MS`; keep it under `STOCK_LEDGER_STALL_SECONDS`"),
    Variable("STOCK_LEDGER_SHUTDOWN_GRACE_SECONDS", "shutdown_grace_seconds", _floats(0.1, 600),
             "bound on a graceful stop"),
    Variable("STOCK_LEDGER_STALL_SECONDS", "stall_seconds", _floats(1, 3_600),
             "`/healthz` turns 503 when the main loop made no progress for this long"),
    Variable("STOCK_LEDGER_POSITION_REFRESH_SECONDS", "position_refresh_seconds", _floats(0.1, 3_600),
             "lag, drift and negative-stock metrics; on a quiet topic, how often the worker checks its session "
             "and the stored offsets (a failover or restore)"),
    Variable("STOCK_LEDGER_INVARIANT_REFRESH_SECONDS", "invariant_refresh_seconds", _floats(0.1, 86_400),
             "incremental ledger invariant checks"),
    Variable("STOCK_LEDGER_INVARIANT_FULL_SCAN_SECONDS", "invariant_full_scan_seconds", _floats(1, 2_592_000),
             "the full invariant pass (a scan of `stock_movements`)"),
    Variable("STOCK_LEDGER_COMPACTION_CHECK_SECONDS", "compaction_check_seconds", _floats(0.1, 86_400),
             "how often each worker reads the topic's `cleanup.policy`: compaction switched on while it runs "
             "halts it (exit 1) within this long, before compaction deletes movements it has not applied"),
    Variable("STOCK_LEDGER_CLOSING_SECONDS", "closing_seconds", _floats(0, 2_592_000),
             "how often the monitor's leader takes a closing balance (`stock_levels` copied with the stored "
             "offsets), from which `stock show --at` reads: it then sums only the movements around T, about this "
             "long's worth. Each costs one row per nonzero (warehouse, SKU) level. At 100M movements a day, 900 read "
             "in p95 0.91 s cold, 3600 in 3.0 s (docs/performance.md). 0: none (`--at` sums the history)"),
    Variable("STOCK_LEDGER_CLOSING_DAILY_AFTER_DAYS", "closing_daily_after_days", _ints(1, 36_500),
             "closings older than this many days are thinned to the first of each UTC day (an `--at` that old then "
             "sums up to a day's movements)"),
    Variable("STOCK_LEDGER_LOG_LEVEL", "log_level", _choice("debug", "info", "warning", "error"),
             "`debug` adds one line per committed batch"),
    Variable("STOCK_LEDGER_LOG_FORMAT", "log_format", _choice("auto", "json", "console"),
             "`auto`: JSON off a terminal, console on one. Logs go to stdout; a command given `--json` logs to stderr, "
             "so its stdout is the document alone"),
    Variable("STOCK_LEDGER_MIGRATIONS_DIR", "migrations_dir", _FILE, "where `migrate` finds its SQL",
             "the repository's `migrations/` (the image: `/app/migrations`)"),
    Variable("STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS", "migrate_deadline_seconds", _floats(1, 86_400),
             "`migrate` waits this long for the database, the migration lock and its DDL's locks, then exits 1"),
    Variable("STOCK_LEDGER_MIGRATE_LOCK_TIMEOUT_MS", "migrate_lock_timeout_ms", _ints(10, 600_000),
             "each migration's `lock_timeout`: a try that waits longer rolls back and is retried"),
    Variable("STOCK_LEDGER_MIGRATE_STATEMENT_TIMEOUT_MS", "migrate_statement_timeout_ms",
             _ints(1_000, 86_400_000), "each migration's `statement_timeout`"),
    Variable("STOCK_LEDGER_ARCHIVE_DIR", "archive_dir", _TEXT,
             "`archive`: the directory archived segments are written to (Parquet and a manifest each; the chart's "
             "volume); one ledger per directory"),
    Variable("STOCK_LEDGER_RETENTION_DAYS", "retention_days", _ints(0, 36_500),
             "`archive run`: a segment whose newest movement was applied more than this many days ago (and that "
             "nothing still needs) is archived and leaves the database; unset: nothing is archived"),
    Variable("STOCK_LEDGER_FAULT", "fault", _TEXT, "**tests only**: crash points (`src/stock_ledger/faults.py`)"),
    Variable("STOCK_LEDGER_DATABASE_SSLMODE_MIN", "database_sslmode_min", _choice(*SSLMODES),
             "weakest `sslmode` accepted; a URL without one counts as `prefer` (or `PGSSLMODE`); production: "
             "`verify-full`"),
    Variable("STOCK_LEDGER_DATABASE_POOLING", "database_pooling", _choice("session", "transaction"),
             "how `DATABASE_URL`'s sessions are pooled: `session` (directly, or PgBouncer's session mode; a pooler "
             "sharing sessions is refused at start) or `transaction` (PgBouncer's transaction mode: settings per "
             "transaction, the monitor lease in a table; `run` only): docs/pgbouncer.md"),
    Variable("STOCK_LEDGER_APP_ROLE", "app_role", Parser("a role name: a-z 0-9 _, 1..63", _parse_role),
             "`migrate` grants the worker's privileges to this NOLOGIN role (created if absent); give each ledger "
             "of a shared cluster its own (docs/security.md); fixed once a ledger is migrated"),
    Variable("STOCK_LEDGER_READER_ROLE", "reader_role", Parser("a role name: a-z 0-9 _, 1..63", _parse_role),
             "`migrate` grants SELECT on every table to this NOLOGIN role (created if absent); one per ledger, "
             "like `STOCK_LEDGER_APP_ROLE`"),
    Variable("KAFKA_SECURITY_PROTOCOL", "kafka_security_protocol",
             _upper("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"), "how the worker talks to the brokers"),
    Variable("KAFKA_SASL_MECHANISM", "kafka_sasl_mechanism", _upper("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
             "required with `SASL_*`"),
    Variable("KAFKA_SASL_USERNAME", "kafka_sasl_username", _TEXT, "required with `SASL_*`"),
    Variable("KAFKA_SASL_PASSWORD", None, Parser("text, taken verbatim", _text),
             "the SASL password (or `KAFKA_SASL_PASSWORD_FILE`); never logged"),
    Variable("KAFKA_SASL_PASSWORD_FILE", None, _FILE, "read the SASL password from this file; not together with "
             "`KAFKA_SASL_PASSWORD`"),
    Variable("KAFKA_SSL_CA_FILE", "kafka_ssl_ca_file", _FILE,
             "PEM bundle of the CA(s) that signed the brokers' certificates", "the system's CAs"),
    Variable("KAFKA_SSL_CERT_FILE", "kafka_ssl_cert_file", _FILE,
             "client certificate (PEM) for mutual TLS; with `KAFKA_SSL_KEY_FILE`"),
    Variable("KAFKA_SSL_KEY_FILE", "kafka_ssl_key_file", _FILE,
             "the client certificate's unencrypted key (PEM); with `KAFKA_SSL_CERT_FILE`"),
    Variable("KAFKA_SSL_CHECK_HOSTNAME", "kafka_ssl_check_hostname", Parser("true, false", _parse_bool),
             "verify that the broker's certificate names the host connected to"),
    Variable("STOCK_LEDGER_MAPPING", None, Parser("a JSON object (docs/formats.md)", _text),
             "the declared mapping: the value's and the key's format, field names, time and quantity forms, kind "
             "values, header fields (docs/formats.md); validated at start", "plain JSON, the contract"),
    Variable("STOCK_LEDGER_MAPPING_FILE", None, _FILE, "read the mapping from this file (a mounted ConfigMap); not "
             "together with `STOCK_LEDGER_MAPPING`"),
    Variable("SCHEMA_REGISTRY_URL", "schema_registry_url", _TEXT,
             "a Confluent-compatible schema registry (Apicurio: `.../apis/ccompat/v7`); required by a mapping that "
             "reads Avro, Protobuf, JSON Schema or a registry-framed key"),
    Variable("SCHEMA_REGISTRY_USERNAME", "schema_registry_username", _TEXT, "basic auth to the registry; with "
             "`SCHEMA_REGISTRY_PASSWORD`"),
    Variable("SCHEMA_REGISTRY_PASSWORD", None, Parser("text, taken verbatim", _text),
             "the registry's basic-auth password (or `SCHEMA_REGISTRY_PASSWORD_FILE`); never logged"),
    Variable("SCHEMA_REGISTRY_PASSWORD_FILE", None, _FILE, "read the registry password from this file; not "
             "together with `SCHEMA_REGISTRY_PASSWORD`"),
    Variable("SCHEMA_REGISTRY_SSL_CA_FILE", "schema_registry_ssl_ca_file", _FILE,
             "PEM bundle of the CA(s) that signed the registry's certificate (`https://` only)", "the system's CAs"),
    Variable("SCHEMA_REGISTRY_SSL_CERT_FILE", "schema_registry_ssl_cert_file", _FILE,
             "client certificate (PEM) for mutual TLS to the registry; with `SCHEMA_REGISTRY_SSL_KEY_FILE`"),
    Variable("SCHEMA_REGISTRY_SSL_KEY_FILE", "schema_registry_ssl_key_file", _FILE,
             "its unencrypted key (PEM); with `SCHEMA_REGISTRY_SSL_CERT_FILE`"),
    Variable("SCHEMA_REGISTRY_SSL_CHECK_HOSTNAME", "schema_registry_ssl_check_hostname",
             Parser("true, false", _parse_bool), "verify that the registry's certificate names its host"),
    Variable("SCHEMA_REGISTRY_TIMEOUT_MS", "schema_registry_timeout_ms", _ints(100, 120_000),
             "one request to the registry; a timeout is a transient fault (the records wait and are retried)"),
    Variable("STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS", "schema_unknown_seconds", _floats(0, 3_600),
             "a schema id the registry answers 404 for is retried this long (it may have been registered a moment "
             "ago), then its records are quarantined as `unknown_schema`; shorter than the retry deadline"),
)


def check_worker_timeouts(settings: Settings) -> None:
    """Refuse a reply timeout that would give up on a statement before the server's own lock timeout answers it:
    every wait on a lock would end as a dropped session, and a claim would never wait long enough to end a zombie's
    session (after half the lock timeout)."""
    if settings.database_reply_timeout_ms <= settings.lock_timeout_ms:
        raise ConfigError(
            f"STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS ({settings.database_reply_timeout_ms}) must be greater than "
            f"STOCK_LEDGER_LOCK_TIMEOUT_MS ({settings.lock_timeout_ms}): the worker would give up on a statement "
            "waiting for a lock before the server's lock timeout answers it. Raise the first or lower the second"
        )


def load_settings(environ: Mapping[str, str]) -> Settings:
    """Build `Settings` from an environment mapping; raise `ConfigError` naming the first bad variable.

    Pure over `environ` except for reading the files it names: the *_FILE secrets, and a check that the
    KAFKA_SSL_*_FILE paths exist (their content is parsed when a client is built, see clients.kafka_options).
    """
    environ = _with_secret_files(environ)
    values: dict[str, object] = {}
    for v in VARIABLES:
        raw = environ.get(v.name)
        if v.attr is not None and raw is not None and raw.strip() != "":
            values[v.attr] = v.parse(v.name, raw.strip())
    values.update(_verbatim_secrets(environ))
    values["mapping"] = _load_mapping(environ)

    settings = Settings(**values)  # type: ignore[arg-type]
    if settings.rebalance_timeout_ms < settings.session_timeout_ms:
        raise ConfigError(
            "STOCK_LEDGER_REBALANCE_TIMEOUT_MS must be >= STOCK_LEDGER_SESSION_TIMEOUT_MS "
            f"({settings.rebalance_timeout_ms} < {settings.session_timeout_ms})"
        )
    if settings.app_role == settings.reader_role:
        raise ConfigError(f"STOCK_LEDGER_APP_ROLE and STOCK_LEDGER_READER_ROLE are both {settings.app_role!r}: the "
                          "worker's role and the read-only role must differ")
    _check_security(settings, environ)
    _check_registry(settings)
    return settings
