"""TCP listeners: bearer tokens, TLS and mutual TLS, with certificates made in tmp_path."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from pathlib import Path

import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from statetier.daemon.config import ListenConfig, TenantConfig
from statetier.daemon.server.auth import server_ssl_context, token_sha256
from statetier.protocol.errors import ConfigError
from statetier.protocol.frames import Op
from tests.support.server_harness import metric, running_daemon

TOKEN = "tenant-a-token"
TENANTS = (TenantConfig(name="a", token_sha256=token_sha256(TOKEN)), TenantConfig(name="default"))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, issuer_key, issuer_name: x509.Name | None, *, ca: bool, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name or _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(directory: Path, stem: str, key, cert) -> tuple[Path, Path]:
    key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.pem"
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server cert and a client cert it signed, and a rogue self-signed client cert."""
    ca_key, ca_cert = _issue("statetier test CA", None, None, ca=True)
    _, ca_pem = _write(tmp_path, "ca", ca_key, ca_cert)
    server_key, server_pem = _write(tmp_path, "server", *_issue("localhost", ca_key, ca_cert.subject, ca=False, server=True))
    client_key, client_pem = _write(tmp_path, "client", *_issue("client", ca_key, ca_cert.subject, ca=False))
    rogue_key, rogue_pem = _write(tmp_path, "rogue", *_issue("client", None, None, ca=False))
    return {"ca": ca_pem, "server": server_pem, "server_key": server_key, "client": client_pem,
            "client_key": client_key, "rogue": rogue_pem, "rogue_key": rogue_key}


def client_context(pki: dict[str, Path], cert: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if cert is not None:
        context.load_cert_chain(str(pki[cert]), str(pki[f"{cert}_key"]))
    return context


async def test_tcp_without_tls_needs_the_right_token() -> None:
    async with running_daemon(listen={"tcp": "127.0.0.1:0"}, tenants=TENANTS) as daemon:
        good = await daemon.tcp_client()
        ok = await good.hello(token=TOKEN)
        assert ok.op is Op.HELLO_OK and ok.meta["tenant"] == "a" and ok.meta["shm"] is None
        assert (await good.request(Op.PING)).op is Op.PONG

        bad = await daemon.tcp_client()
        error = await bad.hello(token="not-the-token")
        assert error.is_error and error.meta["code"] == 420
        assert await bad.recv() is None

        anonymous = await daemon.tcp_client()
        error = await anonymous.hello(shm=True)
        assert error.is_error and error.meta["code"] == 420 and "bearer token" in error.meta["message"]
        assert metric(daemon.metrics, "statetier_auth_failures_total", reason="token") == 2
        assert (await good.request(Op.PING)).op is Op.PONG


async def scenario_tls_with_a_token(pki: dict[str, Path]) -> None:
    listen = {"tcp": "127.0.0.1:0", "tls_cert": pki["server"], "tls_key": pki["server_key"]}
    async with running_daemon(listen=listen, tenants=TENANTS) as daemon:
        client = await daemon.tcp_client(ssl=client_context(pki), server_hostname="localhost")
        ok = await client.hello(token=TOKEN)
        assert ok.op is Op.HELLO_OK and ok.meta["tenant"] == "a"
        payload = b"\x07" * (3 << 20)  # a large frame through TLS and flow control
        error = await client.request(Op.PUT, {"key": "x"}, payload)
        assert error.is_error and error.meta["code"] == 410
        assert (await client.request(Op.PING)).op is Op.PONG
        await client.close()


async def test_tls_with_a_token(pki: dict[str, Path]) -> None:
    await scenario_tls_with_a_token(pki)


def test_tls_with_a_token_on_uvloop(pki: dict[str, Path]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario_tls_with_a_token(pki))


async def test_mutual_tls_admits_a_signed_client_and_refuses_others(pki: dict[str, Path]) -> None:
    listen = {"tcp": "127.0.0.1:0", "tls_cert": pki["server"], "tls_key": pki["server_key"],
              "tls_client_ca": pki["ca"]}
    async with running_daemon(listen=listen, tenants=TENANTS) as daemon:
        signed = await daemon.tcp_client(ssl=client_context(pki, "client"), server_hostname="localhost")
        ok = await signed.hello()  # the verified certificate stands in for a token: "default"
        assert ok.op is Op.HELLO_OK and ok.meta["tenant"] == "default"
        assert (await signed.request(Op.PING)).op is Op.PONG

        for cert in ("rogue", None):
            try:
                refused = await daemon.tcp_client(ssl=client_context(pki, cert), server_hostname="localhost")
                answer = await refused.hello(token=TOKEN)
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
                continue  # the handshake itself failed: refused
            assert answer is None, f"client cert {cert!r} was answered {answer}"
        assert (await signed.request(Op.PING)).op is Op.PONG


def test_the_tls_context_requires_client_certificates_only_with_a_client_ca(pki: dict[str, Path]) -> None:
    plain = server_ssl_context(ListenConfig(tcp="127.0.0.1:0", tls_cert=pki["server"], tls_key=pki["server_key"]))
    assert plain.verify_mode is ssl.CERT_NONE
    mutual = server_ssl_context(ListenConfig(tcp="127.0.0.1:0", tls_cert=pki["server"],
                                             tls_key=pki["server_key"], tls_client_ca=pki["ca"]))
    assert mutual.verify_mode is ssl.CERT_REQUIRED
    assert server_ssl_context(ListenConfig()) is None


def test_an_unreadable_certificate_is_a_config_error(pki: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(ConfigError, match="cannot load the TLS certificate"):
        server_ssl_context(ListenConfig(tcp="127.0.0.1:0", tls_cert=missing, tls_key=pki["server_key"]))
