#!/usr/bin/env python3
"""Make the certificates and NKeys of a secured deployment, offline.

Writes into ``--out`` (default ``compose/secrets``):

- ``ca.pem`` / ``ca-key.pem``: a private certificate authority (EC P-256, 10 years);
- ``nats-1.pem`` … ``nats-3.pem`` and their ``-key.pem``: the NATS nodes' certificates,
  each valid for its node name, ``localhost``, ``127.0.0.1`` and every ``--san``, for
  both server and client use (routes between nodes are mutual TLS);
- ``<component>.pem`` / ``<component>-key.pem`` for every component (``admin``,
  ``replica``, ``bridge``, ``executor``, ``producer``): client certificates;
- ``<component>.nk``: the component's NKey user seed (what ``--nats-nkey`` reads);
- ``nkeys.conf``: the public keys as nats-server variables (``REPLICA_NKEY: "U…"``),
  included by ``compose/nats/accounts.conf``.

Private keys and seeds are written ``0600``. Existing files are kept (run again after
adding a component) unless ``--force``. Nothing here needs the network.

Usage: ``python scripts/make_credentials.py [--out DIR] [--san NAME]… [--force]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from pathlib import Path

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NODES = ("nats-1", "nats-2", "nats-3")
COMPONENTS = ("admin", "replica", "bridge", "executor", "producer")
VALID_DAYS = 3650


def _private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


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


def make_ca(out: Path, force: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = out / "ca.pem", out / "ca-key.pem"
    if cert_path.exists() and key_path.exists() and not force:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "reconciler deployment CA")])
    cert = (
        _builder("reconciler deployment CA", name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    _private(key_path, _key_pem(key))
    cert_path.write_bytes(_cert_pem(cert))
    return cert, key


def make_leaf(
    out: Path,
    name: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    *,
    sans: list[str],
    server: bool,
    force: bool,
) -> bool:
    cert_path, key_path = out / f"{name}.pem", out / f"{name}-key.pem"
    if cert_path.exists() and key_path.exists() and not force:
        return False
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    alt: list[x509.GeneralName] = []
    for san in sans:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            alt.append(x509.DNSName(san))
    builder = (
        _builder(name, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _private(key_path, _key_pem(key))
    cert_path.write_bytes(_cert_pem(cert))
    return True


def make_nkey(out: Path, component: str, force: bool) -> str:
    """The component's public NKey, its seed in ``<component>.nk``."""
    path = out / f"{component}.nk"
    if path.exists() and not force:
        seed = path.read_bytes().strip()
    else:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        _private(path, seed + b"\n")
    public: bytes = nkeys.from_seed(bytearray(seed)).public_key
    return public.decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=root / "compose" / "secrets")
    parser.add_argument("--san", action="append", default=[], help="extra node name or IP")
    parser.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    ca = make_ca(out, args.force)
    made = []
    for node in NODES:
        sans = [node, "localhost", "127.0.0.1", *args.san]
        if make_leaf(out, node, ca, sans=sans, server=True, force=args.force):
            made.append(node)
    for component in COMPONENTS:
        if make_leaf(out, component, ca, sans=[], server=False, force=args.force):
            made.append(component)
    lines = ["# NKey public keys of the components (made by scripts/make_credentials.py)"]
    for component in COMPONENTS:
        lines.append(f'{component.upper()}_NKEY: "{make_nkey(out, component, args.force)}"')
    (out / "nkeys.conf").write_text("\n".join(lines) + "\n")
    print(f"credentials in {out}: new certificates for {', '.join(made) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
