"""Certificates made by a test, for servers it starts with TLS (the shared Redis store).

``make_pki(folder)`` writes a certificate authority, a server certificate it signs (for
``127.0.0.1`` and ``localhost``, or the names given), a client certificate it signs, and a
second, unrelated authority with a server and a client certificate of its own (what a
mis-configured or hostile party presents). PEM files, keys unencrypted and readable by the
owner only. Built with ``cryptography`` (a dependency of LMCache, in the test environment).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path             # the authority the server and the client trust
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path       # an authority nobody trusts, and what it signed:
    rogue_server_cert: Path
    rogue_server_key: Path
    rogue_client_cert: Path
    rogue_client_key: Path


def pki_files(folder: Path) -> Pki:
    """Where ``make_pki(folder)`` writes (or wrote) each file."""
    out: dict[str, Path] = {}
    for prefix in ("", "rogue_"):
        out[prefix + "ca"] = folder / f"{prefix}ca.pem"
        for role in ("server", "client"):
            out[f"{prefix}{role}_cert"] = folder / f"{prefix}{role}.pem"
            out[f"{prefix}{role}_key"] = folder / f"{prefix}{role}-key.pem"
    return Pki(**out)


def make_pki(folder: Path, server_names: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    pki = pki_files(folder)
    for prefix, label in (("", "semkv test CA"), ("rogue_", "rogue CA")):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _certificate(label, ca_key, None, ca_key, is_ca=True)
        _write(getattr(pki, prefix + "ca"), ca)
        for role in ("server", "client"):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _certificate(f"{prefix}{role}", key, (ca, ca_key), None, role=role,
                                names=server_names if role == "server" else ())
            _write(getattr(pki, f"{prefix}{role}_cert"), cert)
            _write_key(getattr(pki, f"{prefix}{role}_key"), key)
    return pki


def _certificate(name: str, key: ec.EllipticCurvePrivateKey,
                 issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
                 self_key: ec.EllipticCurvePrivateKey | None, *, is_ca: bool = False,
                 role: str = "", names: tuple[str, ...] = ()) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer = self_key if issuer is None else issuer[1]
    assert signer is not None
    builder = (x509.CertificateBuilder()
               .subject_name(subject)
               .issuer_name(subject if issuer is None else issuer[0].subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(now + dt.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if is_ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        builder = builder.add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        usage = (ExtendedKeyUsageOID.SERVER_AUTH if role == "server"
                 else ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        assert issuer is not None
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[1].public_key()),
            critical=False)
    if names:
        alt: list[x509.GeneralName] = []
        for n in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                alt.append(x509.DNSName(n))
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
