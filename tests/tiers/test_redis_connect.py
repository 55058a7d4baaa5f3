"""How the Redis tier reaches its server: what a URL can say, ACL users, unix sockets, TLS.

Each test stores through a tier built from one URL and reads the object back: a URL that
states the deployment (``?cluster=no``), an ACL user (wrong credentials are
``Unauthorized`` without the password in the message, an ACL that keeps the user off the
tier's keys is ``Forbidden``), a unix socket, and ``rediss://`` with a CA of its own.
Parsing and redaction of URLs, and the constructor's refusals, are checked without a server.
"""

from __future__ import annotations

import datetime
import ipaddress

import pytest

from statetier.launch.redis_servers import RedisServer, TlsFiles
from statetier.protocol.errors import ConfigError, Forbidden, Unauthorized
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.redis.connect import redact, take_cluster_option
from tests.support.redis_tier import KEYRING, make_object  # noqa: F401  (fixtures are used by name)
from tests.support.tier_contract import load, store


async def test_the_url_can_state_the_deployment(redis_server, make_tier) -> None:
    tier = await make_tier(redis_server.url + "?cluster=no")
    assert tier.is_cluster is False
    meta, blob = make_object(1000)
    await store(tier, meta, blob)
    assert await load(tier, meta.object_id) == blob


async def test_an_acl_user_from_the_url_works_and_bad_credentials_are_unauthorized(make_tier) -> None:
    rules = ["alice on >s3cret ~* &* +@all", "bob on >hunter2 ~elsewhere:* +@all"]
    with RedisServer(acl_users=rules) as server:
        base = f"127.0.0.1:{server.port}/0"
        tier = await make_tier(f"redis://alice:s3cret@{base}")
        meta, blob = make_object(1000)
        await store(tier, meta, blob)
        assert await load(tier, meta.object_id) == blob

        wrong = RedisTier(RedisTierOptions(f"redis://alice:not-her-password@{base}", retries=0), keyring=KEYRING)
        with pytest.raises(Unauthorized) as caught:
            await wrong.start()
        assert "not-her-password" not in str(caught.value)
        assert wrong.stats().extra["available"] is True  # it answered; it said no
        await wrong.close()

        confined = RedisTier(RedisTierOptions(f"redis://bob:hunter2@{base}", cluster=False), keyring=KEYRING)
        with pytest.raises(Forbidden):  # its ACL keeps it off the tier's keys
            await confined.start()
        await confined.close()


async def test_a_unix_socket_url(tmp_path, make_tier) -> None:
    socket_path = tmp_path / "redis.sock"
    with RedisServer().start(extra_args=["--unixsocket", str(socket_path), "--unixsocketperm", "700"]) as server:
        tier = await make_tier(f"unix://{socket_path}")
        assert tier.is_cluster is False
        meta, blob = make_object(1000)
        await store(tier, meta, blob)
        assert await load(tier, meta.object_id) == blob
        server.stop()


def test_url_options_are_parsed_and_passwords_redacted() -> None:
    assert take_cluster_option("redis://h:1/0?cluster=yes&ssl_ca_certs=/ca.pem") == (
        "redis://h:1/0?ssl_ca_certs=%2Fca.pem", True)
    assert take_cluster_option("redis://h:1/0?cluster=no") == ("redis://h:1/0", False)
    assert take_cluster_option("rediss://h:1") == ("rediss://h:1", None)
    with pytest.raises(ConfigError):
        take_cluster_option("redis://h:1?cluster=maybe")
    assert redact("redis://alice:s3cret@h:1/0") == "redis://alice:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    for bad in ({"chunk_bytes": 0}, {"ttl_seconds": 0}, {"capacity_bytes": 0},
                {"high_watermark": 0.5, "low_watermark": 0.6}, {"key_prefix": "a{b}"}):
        with pytest.raises(ConfigError):
            RedisTier(RedisTierOptions("redis://h:1", **bad), keyring=KEYRING)


def _write_tls_files(folder) -> TlsFiles:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("statetier test CA")).issuer_name(name("statetier test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
              .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                          x509.DNSName("localhost")]), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    files = TlsFiles(folder / "server.crt", folder / "server.key", folder / "ca.crt")
    files.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert_file.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files.key_file.write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return files


async def test_tls_from_a_rediss_url(tmp_path, make_tier) -> None:
    tls = _write_tls_files(tmp_path)
    server = RedisServer(tls=tls)
    try:
        server.start(extra_args=["--tls-auth-clients", "no"])
    except RuntimeError as exc:
        server.close()
        if any(sign in str(exc) for sign in ("Bad directive", "not supported", "TLS support")):
            pytest.skip(f"this redis-server binary was built without TLS: {str(exc)[-300:]}")
        raise
    with server:
        assert server.url.startswith("rediss://")
        tier = await make_tier(f"{server.url}?ssl_ca_certs={tls.ca_file}")
        meta, blob = make_object(3 << 20)
        await store(tier, meta, blob)
        assert await load(tier, meta.object_id) == blob
