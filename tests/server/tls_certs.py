"""A throwaway certificate authority for the HTTPS tests (the `cryptography` package).

`make_pki(folder)` writes, as PEM files: the CA, a server certificate (for 127.0.0.1 and
localhost unless told otherwise), a client certificate, and a second CA with a client
certificate of its own (a client that trusts only that CA must refuse the server; a server that
trusts only ours must refuse its client). EC P-256 keys: made in milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class PKI:
    ca: str              # the CA's certificate: what clients (and the server, for client certs) trust
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str        # a CA that signed none of the above
    stranger_cert: str   # a client certificate that other CA signed
    stranger_key: str
    ca_pem: bytes = b""
    server_cert_pem: bytes = b""
    server_key_pem: bytes = b""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _ca(common_name: str):
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(ca_cert, ca_key, common_name: str, usage, sans: list[x509.GeneralName] | None = None):
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _cert_pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(folder: str | Path, server_names: tuple[str, ...] = ("localhost",),
             server_ips: tuple[str, ...] = ("127.0.0.1",)) -> PKI:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca("quire test CA")
    other_cert, other_key = _ca("some other CA")
    sans = [x509.DNSName(n) for n in server_names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in server_ips]
    server_cert, server_key = _leaf(ca_cert, ca_key, server_names[0], ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_cert, client_key = _leaf(ca_cert, ca_key, "a client", ExtendedKeyUsageOID.CLIENT_AUTH)
    stranger_cert, stranger_key = _leaf(other_cert, other_key, "a stranger", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = {"ca": _cert_pem(ca_cert), "server_cert": _cert_pem(server_cert), "server_key": _key_pem(server_key),
             "client_cert": _cert_pem(client_cert), "client_key": _key_pem(client_key),
             "other_ca": _cert_pem(other_cert), "stranger_cert": _cert_pem(stranger_cert),
             "stranger_key": _key_pem(stranger_key)}
    paths = {}
    for name, data in files.items():
        path = folder / f"{name}.pem"
        path.write_bytes(data)
        paths[name] = str(path)
    return PKI(**paths, ca_pem=files["ca"], server_cert_pem=files["server_cert"],
               server_key_pem=files["server_key"])
