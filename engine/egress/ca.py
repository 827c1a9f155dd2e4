"""The egress CA: made once per host, it signs the certificates the proxy shows a guest
for the destinations whose TLS it terminates (those bound to a secret).

Files, in a private directory (default ``<secrets dir>/ca``, see secrets.py):
``ca-key.pem`` (the EC P-256 key, mode 0600: it never leaves the host and is never
given to a guest) and ``ca-cert.pem`` (the certificate a guest image trusts; also
0600 here: copy it out with ``EgressCA.cert_pem``). The CA is valid for 10 years and may
sign only end-entity certificates (path length 0). Leaf certificates are minted in
memory per destination host (SAN = that host), valid from one hour ago for 7 days,
cached per process; their key is never written to disk.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import threading
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from forkd.errors import InvalidInput
from forkd.private import create_private_file, private_dir, read_private_file

KEY_FILE, CERT_FILE = "ca-key.pem", "ca-cert.pem"
CA_DAYS, LEAF_DAYS = 3650, 7
MAX_CACHED_LEAVES = 1024
MAX_PEM = 64 << 10


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _ca_cert(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "forkd egress CA")])
    now = _now()
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )


class EgressCA:
    """The CA key and certificate, and the leaf TLS contexts it signs."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self.cert = cert
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaves: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EgressCA({self.cert.subject.rfc4514_string()!r})"

    @classmethod
    def load_or_create(cls, directory: Path) -> EgressCA:
        """The CA kept in ``directory`` (a private directory), made on first use."""
        root = private_dir(directory)
        key_path, cert_path = root / KEY_FILE, root / CERT_FILE
        if not os.path.lexists(key_path):
            create_private_file(key_path, _key_pem(ec.generate_private_key(ec.SECP256R1())))
        key = serialization.load_pem_private_key(read_private_file(key_path, MAX_PEM), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InvalidInput(f"{key_path} is not an EC key; remove {root} to make a new CA")
        if not os.path.lexists(cert_path):
            cert_pem = _ca_cert(key).public_bytes(serialization.Encoding.PEM)
            create_private_file(cert_path, cert_pem)
        cert = x509.load_pem_x509_certificate(read_private_file(cert_path, MAX_PEM))
        if cert.public_key() != key.public_key():
            raise InvalidInput(f"{cert_path} does not match {key_path}; remove {root} and retry")
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate (public) that a guest's trust store holds."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def leaf_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for ``host`` (cached)."""
        with self._lock:
            ctx = self._leaves.get(host)
            if ctx is not None:
                self._leaves.move_to_end(host)
                return ctx
        ctx = self._mint(host)
        with self._lock:
            self._leaves[host] = ctx
            while len(self._leaves) > MAX_CACHED_LEAVES:
                self._leaves.popitem(last=False)
        return ctx

    def _mint(self, host: str) -> ssl.SSLContext:
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        now = _now()
        public = self._leaf_key.public_key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self.cert.subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return server_context(
            cert.public_bytes(serialization.Encoding.PEM)
            + self.cert.public_bytes(serialization.Encoding.PEM),
            _key_pem(self._leaf_key),
        )


def server_context(chain_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A TLS 1.2+ server context speaking HTTP/1.1, loaded from memory (a memfd, so the
    key touches no file system)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    fd = os.memfd_create("forkd-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, chain_pem + key_pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return ctx
