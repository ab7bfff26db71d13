"""A certificate that failed verification, as one line naming the service, the cause and the fix (Kafka and
PostgreSQL alike)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import ssl

# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, as reported in SSLCertVerificationError.verify_code.
_HOSTNAME_MISMATCH: Final = 62


def certificate_problem(service: str, where: str, exc: ssl.SSLCertVerificationError, ca_var: str,
                        skip_hostname: str) -> str:
    if exc.verify_code == _HOSTNAME_MISMATCH:
        return (f"TLS hostname mismatch: the certificate of {service} at {where} is not valid for that name "
                f"({exc.verify_message}). Connect by a name the certificate lists, or (not recommended) "
                f"{skip_hostname}")
    return (f"untrusted certificate: {service} at {where} presented a certificate that no CA in {ca_var} signed "
            f"({exc.verify_message}). Point {ca_var} at the CA that issued the server's certificate")
