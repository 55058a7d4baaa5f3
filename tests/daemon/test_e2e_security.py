"""End to end, daemon in a subprocess: who may not in, and what may not be served.

- TCP with mutual TLS (CA, server and client certificates made with ``cryptography`` in
  tmp_path; configured through a TOML file) and per-tenant bearer tokens
  (``token_sha256``): a wrong token is ``Unauthorized`` and counted in
  ``statetier_auth_failures_total{reason="token"}``; a client certificate from another CA,
  or none, never completes the handshake and is counted as
  ``statetier_auth_failures_total{reason="tls"}``; the right ones are served.
- The Unix socket with ``listen.allowed_uids = [65534]``: this process's uid is refused
  (``Forbidden``, counted as ``reason="peer_credentials"``); a uid that a tenant lists is
  admitted, as that tenant (``Config.is_unix_peer_allowed``).
- Redis written by someone without the signing key: an object sealed under the daemon's key
  id with a guessed secret, laid out in Redis the way the tier lays it out
  (``tiers/redis/layout.py``), is refused with ``BadSignature`` by ref and by key, counted
  in ``statetier_rejections_total{reason="bad_signature"}``, and removed from Redis; one
  sealed under another keyring's key id is refused too (``UnknownKey``, a ``BadSignature``,
  counted as ``reason="unknown_key"``) but left in Redis: a daemon configured with another
  keyring must not delete what the daemons holding that keyring can read.
- After every refusal the daemon keeps serving (a genuine client round-trips).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from statetier.clients import AsyncClient
from statetier.clients.tensors import tensor_to_spec_and_view
from statetier.daemon.server.auth import token_sha256
from statetier.launch.processes import free_port
from statetier.protocol.errors import BadSignature, Forbidden, Unauthorized, Unavailable, UnknownKey
from statetier.protocol.identity import Provenance, StateKey, StateRef, new_state_id
from statetier.protocol.keyring import Keyring, SigningKey
from statetier.protocol.ownership import owned_key
from statetier.protocol.sealed import decode_header, layout_payload, seal
from statetier.tiers.base import ObjectMeta
from statetier.tiers.redis.layout import Manifest, RedisKeys
from tests.support.daemons import daemon_fixture
from tests.support.jamba import assert_same_tensors, jamba_namespace, kv_page, snapshot

TOKEN = "tenant-a-secret-token"
NOBODY = 65534


# -- certificates ----------------------------------------------------------------------


def _issue(subject: str, issuer: tuple | None, *, ca: bool = False, server: bool = False):
    """(key, cert) for ``subject``, signed by ``issuer`` = (key, cert), or self-signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer[1].subject if issuer else name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return key, builder.sign(issuer[0] if issuer else key, hashes.SHA256())


def _write_pem(directory: Path, stem: str, key, cert) -> tuple[Path, Path]:
    key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Our CA, a server and a client certificate it signed; a rogue CA and its client."""
    directory = tmp_path_factory.mktemp("pki")
    ca = _issue("statetier e2e CA", None, ca=True)
    rogue_ca = _issue("rogue CA", None, ca=True)
    return {
        "ca": _write_pem(directory, "ca", *ca),
        "server": _write_pem(directory, "server", *_issue("localhost", ca, server=True)),
        "client": _write_pem(directory, "client", *_issue("worker-1", ca)),
        "rogue": _write_pem(directory, "rogue", *_issue("worker-1", rogue_ca)),
    }


def client_tls(pki, cert: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"][0]))
    if cert is not None:
        context.load_cert_chain(*(str(p) for p in pki[cert]))
    return context


# -- daemons -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_daemon(request, pki):
    port = free_port()
    config = {
        "listen": {"tcp": f"127.0.0.1:{port}", "tls_cert": pki["server"][0], "tls_key": pki["server"][1],
                   "tls_client_ca": pki["ca"][0]},
        "tenants": [{"name": "a", "token_sha256": token_sha256(TOKEN)}, {"name": "default"}],
    }
    daemon = daemon_fixture(request, config=config, name="tls")
    daemon.tcp_url = f"tcp://127.0.0.1:{port}"
    return daemon


@pytest.fixture(scope="module")
def uid_daemon(request):
    """Unix peers: only uid 65534 (not us). TCP with a token, so that someone can get in."""
    port = free_port()
    config = {"listen": {"allowed_uids": [NOBODY], "tcp": f"127.0.0.1:{port}"},
              "tenants": [{"name": "default", "token_sha256": token_sha256(TOKEN)}]}
    daemon = daemon_fixture(request, config=config, name="uid")
    daemon.tcp_url = f"tcp://127.0.0.1:{port}"
    return daemon


@pytest.fixture(scope="module")
def tenant_uid_daemon(request):
    """Unix peers: uid 65534, and ours, listed by tenant "local"."""
    config = {"listen": {"allowed_uids": [NOBODY]}, "tenants": [{"name": "local", "uids": [os.getuid()]}]}
    return daemon_fixture(request, config=config, name="tenant-uid")


@pytest.fixture(scope="module")
def redis_daemon(request, redis_server):
    return daemon_fixture(request, name="sec-redis", redis_url=redis_server.url)


async def round_trip(url: str, model: str, **client_options) -> str:
    """A put and a load through a fresh client; the tenant the daemon gave it."""
    async with AsyncClient(url, namespace=jamba_namespace(model), **client_options) as client:
        page = kv_page(1, 16)
        ref = await client.put_kv(0, bytes(32), 0, 16, page, request_id="probe")
        assert_same_tensors(await client.load(ref), page)
        return client.server_info["tenant"]


# -- tokens and certificates ---------------------------------------------------------------


async def test_a_wrong_token_is_unauthorized_and_counted(tls_daemon, pki) -> None:
    before = tls_daemon.scrape()
    with pytest.raises(Unauthorized):
        await AsyncClient(tls_daemon.tcp_url, token="not-the-token", ssl=client_tls(pki, "client")).connect()
    after = tls_daemon.scrape()
    assert after.delta(before, "statetier_auth_failures_total", reason="token") == 1
    assert await round_trip(tls_daemon.tcp_url, "sec-a", token=TOKEN, ssl=client_tls(pki, "client")) == "a"


@pytest.mark.parametrize("cert", ["rogue", None], ids=["other-ca", "no-cert"])
async def test_a_client_certificate_our_ca_did_not_sign_is_refused(tls_daemon, pki, cert) -> None:
    before = tls_daemon.scrape()
    with pytest.raises(Unavailable):  # TLS 1.3: the client's handshake ends first, then the alert
        await AsyncClient(tls_daemon.tcp_url, token=TOKEN, ssl=client_tls(pki, cert)).connect()
    after = tls_daemon.scrape()
    assert after.delta(before, "statetier_auth_failures_total", reason="tls") == 1
    assert await round_trip(tls_daemon.tcp_url, "sec-default", ssl=client_tls(pki, "client")) == "default"


async def test_tls_connections_are_flow_controlled_from_their_first_byte(tls_daemon, pki) -> None:
    """Regression: the TLS transport paused writing (session tickets still unsent) while the
    connection's frame writer was being built, and the daemon logged the AttributeError."""
    async with AsyncClient(tls_daemon.tcp_url, token=TOKEN, ssl=client_tls(pki, "client"),
                           namespace=jamba_namespace("sec-tls-flow")) as client:
        pages = [kv_page(seed, 256) for seed in range(4)]  # 1 MiB each, inline both ways
        refs = [await client.put_kv(seed, bytes(32), 0, 256, page, request_id="tls-flow")
                for seed, page in enumerate(pages)]
        for got, want in zip(await client.load_many(refs), pages):
            assert_same_tensors(got, want)
    assert "pause_writing() failed" not in tls_daemon.log_text()


# -- Unix-socket peers ---------------------------------------------------------------------


async def test_a_unix_peer_outside_the_allowed_uids_is_refused_and_counted(uid_daemon) -> None:
    assert os.getuid() != NOBODY
    before = uid_daemon.scrape()
    with pytest.raises(Forbidden, match=f"peer uid {os.getuid()}"):
        await AsyncClient(uid_daemon.url).connect()
    after = uid_daemon.scrape()
    assert after.delta(before, "statetier_auth_failures_total", reason="peer_credentials") == 1
    assert await round_trip(uid_daemon.tcp_url, "sec-uid", token=TOKEN) == "default"


async def test_a_uid_a_tenant_lists_is_admitted_as_that_tenant(tenant_uid_daemon) -> None:
    """Regression: the socket refused uids that only a tenant listed (``auth.check_peer``
    ignored ``tenants[].uids``, which ``Config.is_unix_peer_allowed`` admits)."""
    assert await round_trip(tenant_uid_daemon.url, "sec-local", tenant="local") == "local"
    assert tenant_uid_daemon.scrape().matching("statetier_auth_failures_total") == {}


# -- Redis written without the key -----------------------------------------------------


def forge_into_redis(redis_client, key: StateKey, tensors: dict, signer: Keyring, tenant: str = "default") -> StateRef:
    """Seal ``tensors`` under ``signer`` and store them the way the Redis tier would (one
    chunk, the manifest, the key index), in the namespace ``tenant`` owns (anyone can derive
    it) — what someone with write access to Redis but without the daemon's key can do."""
    key = owned_key(tenant, key)
    views = [tensor_to_spec_and_view(name, tensor) for name, tensor in tensors.items()]
    layout = layout_payload([spec for spec, _ in views])
    payload = bytearray(layout.payload_len)
    for (spec, view), offset in zip(views, layout.offsets):
        payload[offset : offset + spec.nbytes] = view
    state_id = new_state_id()
    provenance = Provenance("forged-req", 0, "intruder", time.time_ns())
    header = seal(key, provenance, layout, payload, keyring=signer, state_id=state_id, version=1)
    blob = header + bytes(payload)
    meta = ObjectMeta.from_header(decode_header(blob))
    keys = RedisKeys("st")
    redis_client.set(keys.chunk(state_id, 0), blob)
    redis_client.set(keys.manifest(state_id), Manifest(meta, len(blob), 1, 2 << 20, False).encode())
    redis_client.hset(keys.key_index(meta.key_digest), state_id.hex(), 1)
    return StateRef(key, "forged-req", 0, state_id, 1)


@pytest.mark.parametrize("forger", ["another-keyring", "our-key-id-guessed-secret"])
async def test_an_object_written_into_redis_without_the_key_is_refused(redis_daemon, redis_server, forger) -> None:
    async with AsyncClient(redis_daemon.url, namespace=jamba_namespace(f"sec-forged-{forger}")) as client:
        genuine = await client.put_ssm(0, bytes(32), 64, snapshot(1), request_id="genuine", publish=True)
        if forger == "another-keyring":
            signer = Keyring.generate()
        else:  # the key id is in every header; the secret is not
            key_id = bytes.fromhex((await client.inspect(genuine.state_id))["header"]["key_id"])
            impostor = SigningKey.from_secret(key_id, os.urandom(32))
            signer = Keyring([impostor], impostor.key_id)
        keys = RedisKeys("st")
        with redis_server.client() as redis_client:
            by_ref = forge_into_redis(redis_client, client.ssm_key(1, bytes(32), 64), snapshot(2), signer)
            by_key = forge_into_redis(redis_client, client.ssm_key(2, bytes(32), 64), snapshot(3), signer)
            before = redis_daemon.scrape()
            refusal, reason = (UnknownKey, "unknown_key") if forger == "another-keyring" else (BadSignature, "bad_signature")
            with pytest.raises(refusal):
                await client.load(by_ref)
            with pytest.raises(refusal):
                await client.load(by_key.key)  # planted for prefix reuse: found by key, then refused
            after = redis_daemon.scrape()
            assert after.delta(before, "statetier_rejections_total", reason=reason) == 2
            left = 2 if forger == "another-keyring" else 0
            for forged in (by_ref, by_key):
                assert redis_client.exists(keys.manifest(forged.state_id), keys.chunk(forged.state_id, 0)) == left

        assert_same_tensors(await client.load(genuine), snapshot(1))
    assert await round_trip(redis_daemon.url, f"sec-after-{forger}") == "default"
