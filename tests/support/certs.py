"""A test CA and the certificates it signs, made with `cryptography` (no openssl CLI): a
server certificate for 127.0.0.1 and localhost, client certificates with names of the
test's choosing, and a second CA that the daemon does not trust."""
from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: Path
    key: Path
    serial: int


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


class TestCA:
    """A CA in `folder` (ca.crt, ca.key) that signs server and client certificates."""

    __test__ = False  # not a pytest class

    def __init__(self, folder: Path, name: str = "ac-observe test CA"):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder()
                     .subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=2))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), True)
                     .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                                  False, False), True)
                     .sign(self.key, hashes.SHA256()))
        self.path = folder / "ca.crt"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self.key, folder / "ca.key")

    def issue(self, name: str, *, server: bool, dns: tuple[str, ...] = (),
              ips: tuple[str, ...] = (), uris: tuple[str, ...] = (),
              cert_path: Path | None = None, key_path: Path | None = None) -> Issued:
        """A leaf certificate and its key, written (by default) as NAME.crt, NAME.key."""
        key = _key()
        serial = x509.random_serial_number()
        now = datetime.datetime.now(datetime.timezone.utc)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        names += [x509.UniformResourceIdentifier(u) for u in uris]
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(self.cert.subject)
                   .public_key(key.public_key())
                   .serial_number(serial)
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), False))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path = cert_path or self.folder / f"{name}.crt"
        key_path = key_path or self.folder / f"{name}.key"
        # The key first: a reader that sees the new certificate finds its key ready.
        _write_key(key, key_path)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Issued(cert_path, key_path, serial)

    def server(self, name: str = "server", **kwargs) -> Issued:
        return self.issue(name, server=True, dns=("localhost",), ips=("127.0.0.1",), **kwargs)

    def client(self, name: str, **kwargs) -> Issued:
        return self.issue(name, server=False, **kwargs)

    def client_context(self, client: Issued | None = None) -> ssl.SSLContext:
        """What a client that trusts this CA (and presents `client`) connects with."""
        context = ssl.create_default_context(cafile=str(self.path))
        if client is not None:
            context.load_cert_chain(str(client.cert), str(client.key))
        return context


def served_serial(host: str, port: int, ca: TestCA, client: Issued | None = None) -> int:
    """The serial number of the certificate a server presents to a new connection."""
    import socket
    context = ca.client_context(client)
    with socket.create_connection((host, port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number
