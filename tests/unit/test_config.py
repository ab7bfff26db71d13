"""Configuration: one frozen settings object from the environment; a bad value fails at start, naming the variable."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from stock_ledger.config import Settings, check_worker_timeouts, load_settings
from stock_ledger.errors import ConfigError

PASSWORD = "s3cr3t-Pa55word"  # noqa: S105 - a fake, looked for in the output
DATABASE_URL = f"postgresql://stock_ledger_worker:{PASSWORD}@db.internal:5432/stock_ledger"


class TestDefaults:
    """With nothing set, the settings are the contract's defaults."""

    def test_an_empty_environment_gives_the_contract_defaults(self) -> None:
        """The defaults an operator reads in the README are the ones the worker uses."""
        s = load_settings({})
        assert s.kafka_bootstrap_servers == "localhost:9092"
        assert s.database_url is None
        assert s.topic == "warehouse.movements"
        assert s.group_id == "stock-ledger"
        assert s.group_instance_id is None
        assert s.metrics_port == 9108
        assert s.session_timeout_ms == 10_000
        assert s.rebalance_timeout_ms == 30_000
        assert s.metadata_max_age_ms == 5_000  # new partitions within seconds, not aiokafka's five minutes
        assert s.batch_max_records == 5_000
        assert s.batch_max_wait_ms == 200
        assert s.auto_offset_reset == "earliest"  # a ledger must not skip history when no offset is stored
        assert s.retry_deadline_seconds == 60
        assert s.lock_timeout_ms == 5_000
        assert s.idle_in_transaction_timeout_ms == 15_000
        assert s.database_reply_timeout_ms == 30_000
        assert s.shutdown_grace_seconds == 8
        assert s.stall_seconds == 60
        assert s.invariant_refresh_seconds == 60
        assert s.compaction_check_seconds == 60  # its own: an hourly invariant refresh must not make it hourly
        assert s.log_level == "info"
        assert s.log_format == "auto"
        assert s.fault is None

    def test_the_defaults_fit_in_kubernetes_grace_period(self) -> None:
        """Graceful shutdown must finish well inside terminationGracePeriodSeconds (30 s)."""
        assert load_settings({}).shutdown_grace_seconds <= 10

    def test_the_default_reply_timeout_lies_between_the_lock_timeout_and_the_stall_limit(self) -> None:
        """A statement waiting on a lock hears the server's lock timeout before the worker gives up on it, and a
        blackholed session is given up before /healthz calls the worker stalled (and Kubernetes restarts it)."""
        s = load_settings({})
        check_worker_timeouts(s)
        assert s.lock_timeout_ms < s.database_reply_timeout_ms < s.stall_seconds * 1000

    def test_settings_are_frozen(self) -> None:
        """One immutable object: nothing can change the configuration after start."""
        s = load_settings({})
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.topic = "other"  # type: ignore[misc]

    def test_unrelated_variables_are_ignored(self) -> None:
        """The process environment holds much else; only our variables matter."""
        assert load_settings({"PATH": "/bin", "HOME": "/root", "STOCK_LEDGER_UNKNOWN": "x"}) == load_settings(
            {}
        )

    @pytest.mark.parametrize("blank", ["", "   "])
    def test_a_blank_variable_means_the_default(self, blank: str) -> None:
        """Helm renders unset values as empty strings: empty means 'use the default', not 'invalid'."""
        s = load_settings(
            {
                "STOCK_LEDGER_METRICS_PORT": blank,
                "STOCK_LEDGER_TOPIC": blank,
                "STOCK_LEDGER_GROUP_INSTANCE_ID": blank,
            }
        )
        assert (s.metrics_port, s.topic, s.group_instance_id) == (9108, "warehouse.movements", None)


class TestEachVariable:
    """Every variable is read into its typed attribute."""

    @pytest.mark.parametrize(
        ("name", "raw", "attr", "expected"),
        [
            (
                "KAFKA_BOOTSTRAP_SERVERS",
                "kafka-0:9092,kafka-1:9092",
                "kafka_bootstrap_servers",
                "kafka-0:9092,kafka-1:9092",
            ),
            ("DATABASE_URL", DATABASE_URL, "database_url", DATABASE_URL),
            ("DATABASE_URL", "postgres://u@h/d", "database_url", "postgres://u@h/d"),
            (
                "STOCK_LEDGER_TOPIC",
                "staging.warehouse-movements_v2",
                "topic",
                "staging.warehouse-movements_v2",
            ),
            ("STOCK_LEDGER_GROUP_ID", "ledger-eu", "group_id", "ledger-eu"),
            ("STOCK_LEDGER_GROUP_INSTANCE_ID", "stock-ledger-0", "group_instance_id", "stock-ledger-0"),
            ("STOCK_LEDGER_METRICS_PORT", "9200", "metrics_port", 9200),
            ("STOCK_LEDGER_METRICS_PORT", " 9200 ", "metrics_port", 9200),
            ("STOCK_LEDGER_SESSION_TIMEOUT_MS", "6000", "session_timeout_ms", 6000),
            ("STOCK_LEDGER_REBALANCE_TIMEOUT_MS", "45000", "rebalance_timeout_ms", 45000),
            ("STOCK_LEDGER_METADATA_MAX_AGE_MS", "10000", "metadata_max_age_ms", 10000),
            ("STOCK_LEDGER_BATCH_MAX_RECORDS", "1000", "batch_max_records", 1000),
            ("STOCK_LEDGER_BATCH_MAX_WAIT_MS", "50", "batch_max_wait_ms", 50),
            ("STOCK_LEDGER_AUTO_OFFSET_RESET", "latest", "auto_offset_reset", "latest"),
            ("STOCK_LEDGER_AUTO_OFFSET_RESET", "none", "auto_offset_reset", "none"),
            ("STOCK_LEDGER_AUTO_OFFSET_RESET", "EARLIEST", "auto_offset_reset", "earliest"),
            ("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "90.5", "retry_deadline_seconds", 90.5),
            ("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "0", "retry_deadline_seconds", 0.0),  # 0: retry forever
            ("STOCK_LEDGER_ON_GAP", "record", "on_gap", "record"),
            ("STOCK_LEDGER_ON_GAP", "HALT", "on_gap", "halt"),
            ("STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS", "30", "migrate_deadline_seconds", 30.0),
            ("STOCK_LEDGER_MIGRATE_LOCK_TIMEOUT_MS", "500", "migrate_lock_timeout_ms", 500),
            ("STOCK_LEDGER_MIGRATE_STATEMENT_TIMEOUT_MS", "60000", "migrate_statement_timeout_ms", 60000),
            ("STOCK_LEDGER_LOCK_TIMEOUT_MS", "2000", "lock_timeout_ms", 2000),
            ("STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS", "20000", "idle_in_transaction_timeout_ms", 20000),
            ("STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS", "2000", "database_reply_timeout_ms", 2000),
            ("STOCK_LEDGER_SHUTDOWN_GRACE_SECONDS", "5", "shutdown_grace_seconds", 5.0),
            ("STOCK_LEDGER_STALL_SECONDS", "120", "stall_seconds", 120.0),
            ("STOCK_LEDGER_POSITION_REFRESH_SECONDS", "1.5", "position_refresh_seconds", 1.5),
            ("STOCK_LEDGER_INVARIANT_REFRESH_SECONDS", "30", "invariant_refresh_seconds", 30.0),
            ("STOCK_LEDGER_INVARIANT_FULL_SCAN_SECONDS", "3600", "invariant_full_scan_seconds", 3600.0),
            ("STOCK_LEDGER_COMPACTION_CHECK_SECONDS", "15", "compaction_check_seconds", 15.0),
            ("STOCK_LEDGER_LOG_LEVEL", "DEBUG", "log_level", "debug"),
            ("STOCK_LEDGER_LOG_LEVEL", "warning", "log_level", "warning"),
            ("STOCK_LEDGER_LOG_FORMAT", "json", "log_format", "json"),
            ("STOCK_LEDGER_LOG_FORMAT", "console", "log_format", "console"),
            ("STOCK_LEDGER_MIGRATIONS_DIR", "/opt/migrations", "migrations_dir", "/opt/migrations"),
            ("STOCK_LEDGER_FAULT", "after_rows@2:kill", "fault", "after_rows@2:kill"),
        ],
    )
    def test_a_variable_sets_its_attribute(self, name: str, raw: str, attr: str, expected: object) -> None:
        """The value is parsed to the attribute's type (case-insensitive for choices, trimmed)."""
        assert getattr(load_settings({name: raw}), attr) == expected

    def test_port_0_asks_for_an_ephemeral_port(self) -> None:
        """Tests run several workers on one host: port 0 is allowed."""
        assert load_settings({"STOCK_LEDGER_METRICS_PORT": "0"}).metrics_port == 0


class TestBadValues:
    """A bad value raises ConfigError whose message names the variable (and shows the bad value)."""

    @pytest.mark.parametrize(
        ("name", "raw"),
        [
            ("STOCK_LEDGER_METRICS_PORT", "abc"),
            ("STOCK_LEDGER_METRICS_PORT", "9108.0"),
            ("STOCK_LEDGER_METRICS_PORT", "-1"),
            ("STOCK_LEDGER_METRICS_PORT", "65536"),
            ("STOCK_LEDGER_SESSION_TIMEOUT_MS", "ten seconds"),
            ("STOCK_LEDGER_SESSION_TIMEOUT_MS", "0"),
            ("STOCK_LEDGER_REBALANCE_TIMEOUT_MS", "999"),
            ("STOCK_LEDGER_METADATA_MAX_AGE_MS", "999"),  # a metadata request per client more than once a second
            ("STOCK_LEDGER_BATCH_MAX_RECORDS", "0"),
            ("STOCK_LEDGER_BATCH_MAX_RECORDS", "1e3"),
            ("STOCK_LEDGER_BATCH_MAX_WAIT_MS", "-5"),
            ("STOCK_LEDGER_AUTO_OFFSET_RESET", "sometimes"),
            ("STOCK_LEDGER_AUTO_OFFSET_RESET", "smallest"),
            ("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "forever"),
            ("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "0.5"),
            ("STOCK_LEDGER_ON_GAP", "skip"),
            ("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "-1"),
            ("STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS", "0"),
            ("STOCK_LEDGER_MIGRATE_LOCK_TIMEOUT_MS", "1"),
            ("STOCK_LEDGER_MIGRATE_STATEMENT_TIMEOUT_MS", "ten"),
            ("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "nan"),
            ("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "inf"),
            ("STOCK_LEDGER_LOCK_TIMEOUT_MS", "1"),
            ("STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS", "x"),
            ("STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS", "999"),
            ("STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS", "30s"),
            ("STOCK_LEDGER_SHUTDOWN_GRACE_SECONDS", "-1"),
            ("STOCK_LEDGER_STALL_SECONDS", "0.5"),
            ("STOCK_LEDGER_POSITION_REFRESH_SECONDS", "never"),
            ("STOCK_LEDGER_INVARIANT_REFRESH_SECONDS", "0"),
            ("STOCK_LEDGER_INVARIANT_FULL_SCAN_SECONDS", "0"),
            ("STOCK_LEDGER_COMPACTION_CHECK_SECONDS", "0"),
            ("STOCK_LEDGER_LOG_LEVEL", "verbose"),
            ("STOCK_LEDGER_LOG_FORMAT", "xml"),
            ("STOCK_LEDGER_TOPIC", "warehouse movements"),
            ("STOCK_LEDGER_TOPIC", "warehouse/movements"),
            ("STOCK_LEDGER_TOPIC", "t" * 250),
            ("DATABASE_URL", "mysql://u:p@h/d"),
            ("DATABASE_URL", "db.internal:5432"),
            ("KAFKA_BOOTSTRAP_SERVERS", "k" * 1025),
            ("STOCK_LEDGER_GROUP_ID", "g" * 1025),
        ],
    )
    def test_a_bad_value_names_the_variable(self, name: str, raw: str) -> None:
        """The operator sees which variable to fix."""
        with pytest.raises(ConfigError) as caught:
            load_settings({name: raw})
        assert name in str(caught.value)
        assert "\n" not in str(caught.value)

    def test_a_rebalance_timeout_below_the_session_timeout_names_both(self) -> None:
        """A rebalance must outlast a session, else members are evicted mid-rebalance."""
        with pytest.raises(ConfigError) as caught:
            load_settings(
                {"STOCK_LEDGER_SESSION_TIMEOUT_MS": "40000", "STOCK_LEDGER_REBALANCE_TIMEOUT_MS": "20000"}
            )
        assert "STOCK_LEDGER_REBALANCE_TIMEOUT_MS" in str(caught.value)
        assert "STOCK_LEDGER_SESSION_TIMEOUT_MS" in str(caught.value)

    @pytest.mark.parametrize("reply", ["1000", "5000"])
    def test_a_reply_timeout_not_above_the_lock_timeout_names_both(self, reply: str) -> None:
        """The worker would drop every session that waits on a lock (and never wait long enough for a claim to
        end a zombie's session): refused, naming both variables and the fix."""
        settings = load_settings({"STOCK_LEDGER_LOCK_TIMEOUT_MS": "5000",
                                  "STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS": reply})
        with pytest.raises(ConfigError) as caught:
            check_worker_timeouts(settings)
        assert "STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS" in str(caught.value)
        assert "STOCK_LEDGER_LOCK_TIMEOUT_MS" in str(caught.value)
        assert "Raise the first or lower the second" in str(caught.value)
        check_worker_timeouts(dataclasses.replace(settings, database_reply_timeout_ms=5001))

    def test_a_bad_database_url_does_not_echo_its_password(self) -> None:
        """The error shows the URL to help the operator, but never the password."""
        with pytest.raises(ConfigError) as caught:
            load_settings({"DATABASE_URL": f"mysql://app:{PASSWORD}@db/ledger"})
        assert "DATABASE_URL" in str(caught.value)
        assert PASSWORD not in str(caught.value)

    def test_require_database_url_names_the_variable(self) -> None:
        """run, migrate and verify need a database; without one the error says which variable to set."""
        with pytest.raises(ConfigError, match="DATABASE_URL"):
            load_settings({}).require_database_url()
        assert load_settings({"DATABASE_URL": DATABASE_URL}).require_database_url() == DATABASE_URL


class TestSecrets:
    """Settings are logged at start; the database password must never reach the logs."""

    @pytest.mark.parametrize(
        "url",
        [
            DATABASE_URL,
            f"postgres://stock_ledger_worker:{PASSWORD}@db.internal/stock_ledger?sslmode=require",
            f"postgresql://stock_ledger_worker:{PASSWORD}@10.0.0.1:5432,10.0.0.2:5432/stock_ledger",
            f"postgresql://stock_ledger_worker@db.internal:5432/stock_ledger?password={PASSWORD}",
            f"postgresql://db.internal/stock_ledger?user=stock_ledger_worker&password={PASSWORD}&sslmode=require",
        ],
        ids=["userinfo", "userinfo-query", "multi-host", "query-password", "query-password-middle"],
    )
    def test_the_password_appears_in_neither_repr_nor_loggable(self, url: str) -> None:
        """asyncpg (like libpq) takes the password from the userinfo or from a `password=` query parameter; neither
        may leak through repr(settings), str(settings) or settings.loggable(), which the worker logs at start."""
        s = load_settings({"DATABASE_URL": url})
        assert s.database_url == url
        assert PASSWORD not in repr(s)
        assert PASSWORD not in str(s)
        assert PASSWORD not in repr(s.loggable())
        assert PASSWORD not in str(s.database_url_masked)

    def test_loggable_keeps_the_rest_of_the_url(self) -> None:
        """The masked URL still says which host, port and database the worker uses."""
        logged = load_settings({"DATABASE_URL": DATABASE_URL}).loggable()
        assert logged["database_url"] == "postgresql://stock_ledger_worker:***@db.internal:5432/stock_ledger"
        assert set(logged) == {f.name for f in dataclasses.fields(Settings)}


# ----------------------------------------------------------------------------------------------------- CLI


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m stock_ledger ARGS` with only our variables set (none inherited from the test's environment)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("STOCK_LEDGER_") and k not in {"DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS"}
    }
    return subprocess.run(
        [sys.executable, "-m", "stock_ledger", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _assert_config_exit(done: subprocess.CompletedProcess[str], variable: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, f"expected one line on stderr, got:\n{done.stderr}"
    assert variable in lines[0]
    assert "Traceback" not in done.stderr


class TestCommandLine:
    """Bad configuration stops the process at once: exit code 2 and one line on stderr naming the variable."""

    @pytest.mark.parametrize(
        ("variable", "raw"),
        [
            ("STOCK_LEDGER_METRICS_PORT", "abc"),
            ("STOCK_LEDGER_AUTO_OFFSET_RESET", "sometimes"),
            ("STOCK_LEDGER_TOPIC", "no spaces allowed"),
        ],
    )
    def test_run_with_a_bad_variable_exits_2_naming_it(self, variable: str, raw: str) -> None:
        """The pod's log shows exactly which variable is wrong, no traceback."""
        done = _cli("run", **{variable: raw, "DATABASE_URL": DATABASE_URL})
        _assert_config_exit(done, variable)
        assert PASSWORD not in done.stderr

    @pytest.mark.parametrize("command", ["run", "verify"])
    def test_a_command_that_needs_the_database_exits_2_without_database_url(self, command: str) -> None:
        """run and verify without DATABASE_URL: exit 2, naming DATABASE_URL, before touching any service."""
        done = _cli(command, KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
        _assert_config_exit(done, "DATABASE_URL")

    def test_run_with_a_reply_timeout_below_the_lock_timeout_exits_2_naming_both(self) -> None:
        """Only the worker waits on replies with a deadline: `run` refuses before it touches any service."""
        done = _cli("run", DATABASE_URL=DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1",
                    STOCK_LEDGER_LOCK_TIMEOUT_MS="10000", STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS="8000")
        _assert_config_exit(done, "STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS")
        assert "STOCK_LEDGER_LOCK_TIMEOUT_MS (10000)" in done.stderr

    def test_verify_with_a_bad_variable_exits_2_naming_it(self) -> None:
        """verify reads the same settings and fails the same way."""
        done = _cli("verify", STOCK_LEDGER_LOG_LEVEL="loud", DATABASE_URL=DATABASE_URL)
        _assert_config_exit(done, "STOCK_LEDGER_LOG_LEVEL")
