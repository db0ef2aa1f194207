"""The deployment's own certificate authority and the certificates it issues (EC P-256).

Rules:

- One CA per deployment (``ca.pem``, ``ca-key.pem``), valid :data:`VALID_DAYS`; every
  certificate is issued by it: NATS nodes (server *and* client usage, since routes are
  mutual TLS), the components' NATS client certificates and their Incus client
  certificates (which Incus trusts by fingerprint, and which a host using the CA as its
  ``server.ca`` accepts by issuer).
- Names that parse as IP addresses become IP subject alternative names, others DNS names.
- Nothing here touches a file: :mod:`reconciler.deploy.credentials` decides what to keep.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["VALID_DAYS", "Authority", "Issued"]

VALID_DAYS = 3650
CA_NAME = "reconciler deployment CA"


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM-encoded (the key unencrypted)."""

    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _builder(
    subject: str, issuer: x509.Name, public: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
    )


def _alt_names(sans: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for san in sans:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            out.append(x509.DNSName(san))
    return out


@dataclass(frozen=True)
class Authority:
    """The deployment's CA: its certificate and signing key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        usage = x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True,
            content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, encipher_only=False, decipher_only=False,
        )  # fmt: skip
        cert = (
            _builder(CA_NAME, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(cert=cert, key=key)

    @classmethod
    def load(cls, cert_pem: bytes, key_pem: bytes) -> Authority:
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the CA key is not an EC private key")
        return cls(cert=x509.load_pem_x509_certificate(cert_pem), key=key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)

    def issue(self, name: str, *, sans: Sequence[str] = (), server: bool = False) -> Issued:
        """A certificate for ``name`` (client usage; server usage too when ``server``)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        builder = (
            _builder(name, self.cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        alt = _alt_names(sans)
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Issued(cert_pem=cert.public_bytes(serialization.Encoding.PEM), key_pem=_key_pem(key))
