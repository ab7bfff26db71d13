"""Security settings without services: secrets stay out of every output, unsafe combinations are refused at start,
and the options every Kafka client receives match the settings."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stock_ledger.clients.database import check_sslmode
from stock_ledger.clients.kafka import kafka_options
from stock_ledger.config import Settings, load_settings
from stock_ledger.errors import ConfigError
from tests.unit.test_config import _assert_config_exit, _cli

# Passwords are drawn from Greek capitals plus every character that confuses URL parsing, and the URL templates
# below hold no Greek letter: so any Greek letter (or its UTF-8 percent-encoding, %CE / %CF) in an output is a
# leaked piece of the password, however the parser split it.
GREEK = "ΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ"
password = st.text(alphabet=GREEK + "@:/?#&=%+ ;,[]", min_size=1, max_size=24).filter(
    lambda p: any(c in GREEK for c in p))

WELL_FORMED = [
    "postgresql://worker:{pw}@db.internal:5432/stock_ledger",
    "postgres://worker:{pw}@db.internal/stock_ledger?sslmode=verify-full&sslrootcert=/etc/ca.crt",
    "postgresql://worker:{pw}@10.0.0.1:5432,10.0.0.2:5433/stock_ledger",
    "postgresql://worker@db.internal/stock_ledger?password={pw}",
    "postgresql://db.internal/stock_ledger?user=worker&password={pw}&sslmode=require",
    "postgresql://worker@db.internal/stock_ledger?sslmode=verify-full&sslkey=/k&sslcert=/c&sslpassword={pw}",
]
NO_HOST = "postgresql://worker:{pw}"
MISTYPED = [
    "postgres:/worker:{pw}@db.internal/stock_ledger",
    "postgresql//worker:{pw}@db.internal/stock_ledger",
    "postgresql:worker:{pw}@db.internal",
    "worker:{pw}@db.internal:5432/stock_ledger",
    NO_HOST,
    "postgresql://worker:{pw}@db.internal:{pw}/stock_ledger",
    "postgresql://worker:{pw}@db.internal/stock_ledger?sslmode={pw}",
    "postgresql://worker:{pw}@db.internal/stock_ledger#{pw}",
    "postgresql://worker:{pw}@db.internal/stock_ledger?sslmode=verify_everything",
    "mysql://worker:{pw}@db.internal/stock_ledger",
    " postgresql://worker:{pw}@db.internal/stock_ledger",
]


def _leaks(text: str) -> bool:
    return any(c in GREEK for c in text) or "%CE" in text.upper() or "%CF" in text.upper()


def _everything_shown(url: str) -> str:
    """All a user can see of DATABASE_URL: the error if it is refused, else repr, loggable() and the masked URL."""
    try:
        s = load_settings({"DATABASE_URL": url})
    except ConfigError as exc:
        return f"error: {exc}"
    return f"{s!r} {s.loggable()!r} {s.database_url_masked}"


class TestDatabaseUrlNeverShowsItsPassword:
    """No shape of DATABASE_URL prints its password: not well-formed ones (raw or percent-encoded password, in
    the userinfo, `password=` or `sslpassword=`), not typos, not a password whose '@', ':', '/', '?', '#' or '&'
    changes how the URL parses."""

    @settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(password, st.sampled_from(WELL_FORMED + MISTYPED), st.booleans())
    def test_no_output_contains_any_piece_of_the_password(self, pw: str, template: str, encode: bool) -> None:
        # One shape is ambiguous by construction: with the host left out, `worker:ab@cd` IS a well-formed URL with
        # password `ab` and host `cd`; no parser can tell, and the host is shown. (Percent-encoding avoids it.)
        assume(encode or "@" not in pw or template != NO_HOST)
        url = template.replace("{pw}", quote(pw, safe="") if encode else pw)
        shown = _everything_shown(url)
        assert not _leaks(shown), f"{url!r} showed {shown!r}"

    @settings(max_examples=100)
    @given(password, st.sampled_from(WELL_FORMED))
    def test_a_well_formed_url_with_an_encoded_password_is_accepted_and_still_says_where(
        self, pw: str, template: str,
    ) -> None:
        """The masking is not bought by refusing good URLs: these load, and the log keeps host and database."""
        url = template.replace("{pw}", quote(pw, safe=""))
        s = load_settings({"DATABASE_URL": url})
        assert s.database_url == url
        assert "stock_ledger" in str(s.database_url_masked)
        assert "***" in str(s.database_url_masked)

    @pytest.mark.parametrize("template", MISTYPED)
    def test_a_malformed_url_is_refused_naming_the_variable(self, template: str) -> None:
        with pytest.raises(ConfigError, match="DATABASE_URL") as caught:
            load_settings({"DATABASE_URL": template.replace("{pw}", "S3cr3t/x")})
        assert "S3cr3t" not in str(caught.value)
        assert "not shown" in str(caught.value)

    @pytest.mark.parametrize(
        ("url", "says"),
        [
            ("postgres:/worker:S3cr3t@db.internal/stock_ledger", "must start with postgresql://"),
            ("postgresql://worker:S3cr3t@db.internal/stock_ledger?sslmode=strict", "unknown sslmode"),
            ("postgresql://worker:S3:cr@t@db.internal/stock_ledger", "percent-encode"),
        ],
        ids=["typo", "bad-sslmode", "unencoded-at"],
    )
    def test_the_command_line_exits_2_with_one_line(self, url: str, says: str) -> None:
        done = _cli("run", DATABASE_URL=url)
        _assert_config_exit(done, "DATABASE_URL")
        assert says in done.stderr
        assert "S3" not in done.stderr


class TestSecretFiles:
    """KAFKA_SASL_PASSWORD_FILE and DATABASE_URL_FILE: how Kubernetes mounts secrets."""

    def test_secrets_are_read_from_files_without_the_trailing_newline(self, tmp_path: Path) -> None:
        (tmp_path / "pw").write_text("s3cret with spaces \n")
        (tmp_path / "url").write_text("postgresql://worker:pw@db/stock_ledger\n")
        s = load_settings({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                           "KAFKA_SASL_USERNAME": "svc", "KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw"),
                           "DATABASE_URL_FILE": str(tmp_path / "url")})
        assert s.kafka_sasl_password == "s3cret with spaces "  # noqa: S105 - a test value
        assert s.database_url == "postgresql://worker:pw@db/stock_ledger"

    @pytest.mark.parametrize("name", ["DATABASE_URL", "KAFKA_SASL_PASSWORD"])
    def test_a_missing_or_empty_file_is_refused_naming_the_variable(self, name: str, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match=rf"{name}_FILE=.*cannot be read"):
            load_settings({f"{name}_FILE": str(tmp_path / "absent")})
        (tmp_path / "empty").write_text("\n")
        with pytest.raises(ConfigError, match=rf"{name}_FILE=.*is empty"):
            load_settings({f"{name}_FILE": str(tmp_path / "empty")})

    def test_a_secret_set_twice_is_refused(self, tmp_path: Path) -> None:
        (tmp_path / "pw").write_text("a")
        with pytest.raises(ConfigError, match="both KAFKA_SASL_PASSWORD and KAFKA_SASL_PASSWORD_FILE"):
            load_settings({"KAFKA_SASL_PASSWORD": "b", "KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw")})

    def test_a_file_secret_is_masked_like_any_other(self, tmp_path: Path) -> None:
        (tmp_path / "pw").write_text("Z9-sasl-secret")
        s = load_settings({"KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KAFKA_SASL_MECHANISM": "PLAIN",
                           "KAFKA_SASL_USERNAME": "svc", "KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw")})
        assert "Z9-sasl-secret" not in repr(s)
        assert s.loggable()["kafka_sasl_password"] == "***"  # noqa: S105 - the mask, not a password


SASL = {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "KAFKA_SASL_USERNAME": "svc", "KAFKA_SASL_PASSWORD": "pw"}


class TestCombinations:
    """Settings that would connect less securely than the operator asked for never start."""

    @pytest.mark.parametrize("missing", ["KAFKA_SASL_MECHANISM", "KAFKA_SASL_USERNAME", "KAFKA_SASL_PASSWORD"])
    def test_sasl_needs_a_mechanism_a_user_and_a_password(self, missing: str) -> None:
        env = {k: v for k, v in SASL.items() if k != missing}
        with pytest.raises(ConfigError, match=f"KAFKA_SECURITY_PROTOCOL=SASL_SSL needs {missing}"):
            load_settings(env)

    def test_sasl_credentials_without_a_sasl_protocol_are_refused(self) -> None:
        """Forgetting KAFKA_SECURITY_PROTOCOL must not send the credentials' traffic in the clear."""
        with pytest.raises(ConfigError, match="KAFKA_SECURITY_PROTOCOL=PLAINTEXT does not authenticate"):
            load_settings({k: v for k, v in SASL.items() if k != "KAFKA_SECURITY_PROTOCOL"})

    def test_tls_files_without_a_tls_protocol_are_refused(self, tmp_path: Path) -> None:
        (tmp_path / "ca.crt").write_text("x")
        with pytest.raises(ConfigError, match=r"KAFKA_SSL_.*does not use TLS"):
            load_settings({"KAFKA_SSL_CA_FILE": str(tmp_path / "ca.crt")})

    def test_a_client_certificate_needs_its_key(self, tmp_path: Path) -> None:
        (tmp_path / "c.crt").write_text("x")
        with pytest.raises(ConfigError, match="KAFKA_SSL_CERT_FILE and KAFKA_SSL_KEY_FILE go together"):
            load_settings({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CERT_FILE": str(tmp_path / "c.crt")})

    def test_a_missing_ca_file_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match=r"KAFKA_SSL_CA_FILE=.*not a readable file"):
            load_settings({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CA_FILE": str(tmp_path / "none")})

    @pytest.mark.parametrize(
        ("variable", "raw"),
        [("KAFKA_SECURITY_PROTOCOL", "TLS"), ("KAFKA_SASL_MECHANISM", "GSSAPI"),
         ("KAFKA_SSL_CHECK_HOSTNAME", "maybe"), ("STOCK_LEDGER_DATABASE_SSLMODE_MIN", "verify-all")],
    )
    def test_unknown_values_are_refused_naming_the_variable(self, variable: str, raw: str) -> None:
        with pytest.raises(ConfigError, match=variable):
            load_settings({**SASL, variable: raw})

    @pytest.mark.parametrize(
        ("url_mode", "minimum", "ok"),
        [("disable", "disable", True), ("require", "verify-full", False), ("verify-ca", "verify-full", False),
         ("verify-full", "verify-full", True), ("verify-full", "require", True), (None, "prefer", True),
         (None, "require", False), ("allow", "prefer", False)],
    )
    def test_the_sslmode_minimum(self, url_mode: str | None, minimum: str, ok: bool) -> None:
        """Order disable < allow < prefer < require < verify-ca < verify-full; a URL without sslmode is what
        asyncpg makes of it: `prefer`. Below the minimum: refused, naming both variables."""
        url = "postgresql://worker:S3cret@db/stock_ledger" + (f"?sslmode={url_mode}" if url_mode else "")
        env = {"DATABASE_URL": url, "STOCK_LEDGER_DATABASE_SSLMODE_MIN": minimum}
        if ok:
            assert load_settings(env).database_sslmode_min == minimum
            return
        with pytest.raises(ConfigError, match=r"DATABASE_URL .*STOCK_LEDGER_DATABASE_SSLMODE_MIN") as caught:
            load_settings(env)
        assert "S3cret" not in str(caught.value)

    def test_pgsslmode_counts_when_the_url_has_none(self) -> None:
        """asyncpg falls back to PGSSLMODE: so does the minimum check."""
        env = {"DATABASE_URL": "postgresql://w:p@db/x", "STOCK_LEDGER_DATABASE_SSLMODE_MIN": "verify-full"}
        assert load_settings({**env, "PGSSLMODE": "verify-full"}).database_sslmode_min == "verify-full"

    def test_connect_database_checks_the_minimum_too(self) -> None:
        """Settings built by hand (not through load_settings) are refused before any connection is tried."""
        s = Settings(database_url="postgresql://w:p@127.0.0.1:1/x?sslmode=disable", database_sslmode_min="require")
        with pytest.raises(ConfigError, match="STOCK_LEDGER_DATABASE_SSLMODE_MIN=require"):
            check_sslmode(s, {})


def _ca_and_client(tmp: Path) -> tuple[Path, Path, Path]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-new", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA",
        "-keyout", str(tmp / "ca.key"), "-out", str(tmp / "ca.crt"))
    run("req", "-x509", "-new", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=client",
        "-keyout", str(tmp / "client.key"), "-out", str(tmp / "client.crt"))
    return tmp / "ca.crt", tmp / "client.crt", tmp / "client.key"


class TestKafkaOptions:
    """The keyword arguments every aiokafka client gets."""

    def test_plaintext_adds_nothing_but_the_protocol(self) -> None:
        assert kafka_options(load_settings({})) == {"security_protocol": "PLAINTEXT"}

    def test_sasl_ssl_verifies_the_broker_and_presents_a_client_certificate(self, tmp_path: Path) -> None:
        ca, cert, key = _ca_and_client(tmp_path)
        options = kafka_options(load_settings({**SASL, "KAFKA_SSL_CA_FILE": str(ca), "KAFKA_SSL_CERT_FILE": str(cert),
                                               "KAFKA_SSL_KEY_FILE": str(key)}))
        context = options.pop("ssl_context")
        assert options == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                           "sasl_plain_username": "svc", "sasl_plain_password": "pw"}
        assert isinstance(context, ssl.SSLContext)
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.check_hostname
        assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "test CA"),),)]

    def test_the_hostname_check_can_be_turned_off_explicitly(self, tmp_path: Path) -> None:
        ca, _, _ = _ca_and_client(tmp_path)
        s = load_settings({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CA_FILE": str(ca),
                           "KAFKA_SSL_CHECK_HOSTNAME": "false"})
        context = kafka_options(s)["ssl_context"]
        assert not context.check_hostname
        assert context.verify_mode == ssl.CERT_REQUIRED

    def test_a_ca_file_that_is_not_pem_is_a_config_error(self, tmp_path: Path) -> None:
        (tmp_path / "ca.crt").write_text("not a certificate")
        s = load_settings({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CA_FILE": str(tmp_path / "ca.crt")})
        with pytest.raises(ConfigError, match="KAFKA_SSL_CA_FILE"):
            kafka_options(s)
