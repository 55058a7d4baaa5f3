"""Probe 6, security: wrong tokens, certificates our CA did not sign, a uid the socket does
not admit, a writer with Redis access but no key forging and replaying objects, one tenant
naming another's state, and a Redis writer rolling the version registry back — each attempt
repeated, every refusal counted by the daemon.

- wrong: any attempt that is served (a connection admitted, an object's bytes handed out,
  another tenant's object deleted); an attempt refused but not counted in the daemon's
  metrics (``statetier_auth_failures_total``, ``statetier_rejections_total``,
  ``statetier_errors_total``).
- lost: the legitimate owner's object no longer served byte-exact after the attacks.
- The registry rollback (``_registry_rollback``): a prefill daemon puts versions 1 and 2 of a
  stream (published), a decode daemon loads version 2, then a Redis writer writes version 1's
  head back. Wrong: that decode daemon serving version 1 by its ref, or version 1's bytes by
  key; the prefill daemon's next put claiming a second version 2. What a daemon that never
  saw version 2 does with version 1's ref is reported, not judged: the registry is its only
  witness (``registry_rollback_served_by_a_daemon_that_never_saw_v2``).
- Not probed here: another tenant's files and mappings (tests/daemon/test_e2e_worker_view.py,
  with real uids).
"""

from __future__ import annotations

import datetime
import ipaddress
import random
import ssl
import tempfile
from pathlib import Path

from harness import (Budget, DaemonProcess, ProbeResult, Promise, RedisServer, internal_errors, key_prefix,
                     note_failures, payload)
from statetier.daemon.server.auth import token_sha256
from statetier.protocol.errors import Forbidden, StatetierError
from statetier.protocol.keyring import Keyring
from statetier.protocol.messages import ref_from_wire
from statetier.protocol.sealed import decode_header, layout_payload, seal
from statetier.launch.processes import free_port
from wire import Wire

PROBE = "security"
PROMISE = Promise(
    "wrong tokens, foreign certificates and uids, objects forged or replayed in Redis by a keyless "
    "writer, and another tenant's state ids are all refused and counted; none is served",
    lost_means="the legitimate owner's object not served byte-exact after the attacks",
    wrong_means="any attempt served; a superseded version served by key; a refusal the daemon did not count",
)
TOKENS = {"a": "token-of-tenant-a", "b": "token-of-tenant-b"}


def _pki(directory: Path) -> dict:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def issue(subject, issuer=None, *, ca=False, server=False):
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer[1].subject if issuer else name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return key, builder.sign(issuer[0] if issuer else key, hashes.SHA256())

    def write(stem, key, cert):
        key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.pem"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert_path, key_path

    ca, rogue_ca = issue("statetier CA", ca=True), issue("rogue CA", ca=True)
    return {"ca": write("ca", *ca), "server": write("server", *issue("localhost", ca, server=True)),
            "client": write("client", *issue("worker", ca)), "rogue": write("rogue", *issue("worker", rogue_ca))}


def _client_tls(pki: dict, cert: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"][0]))
    if cert:
        context.load_cert_chain(*(str(p) for p in pki[cert]))
    return context


async def _attempt(result: ProbeResult, name: str, attack) -> bool:
    """Run one attack; True if it was refused with a statetier error."""
    result.inputs += 1
    try:
        await attack()
    except (StatetierError, ssl.SSLError, ConnectionError, OSError) as exc:
        result.add(f"{name}_refused")
        result.add(f"{name}_refused_as_{getattr(exc, 'reason', type(exc).__name__)}")
        return True
    result.wrong += 1
    result.fail(f"{name}: the attempt was served")
    return False


async def _tls_and_tenants(rounds: int, result: ProbeResult, directory: Path) -> None:
    pki = _pki(directory)
    port = free_port()
    config = {"listen": {"tcp": f"127.0.0.1:{port}", "tls_cert": pki["server"][0], "tls_key": pki["server"][1],
                         "tls_client_ca": pki["ca"][0]},
              "tenants": [{"name": n, "token_sha256": token_sha256(t)} for n, t in TOKENS.items()]}
    daemon = DaemonProcess(config, name="sec-tls", host_capacity="64MiB")
    url = f"tcp://127.0.0.1:{port}"
    try:
        daemon.start()
        owner = await Wire.open(url, model="tenant-a", token=TOKENS["a"], ssl=_client_tls(pki, "client"))
        data = payload(1, 8192)
        ref = (await owner.put(owner.key(0, key_prefix(PROBE, 1)), data, request_id="a1"))["ref"]
        before = daemon.scrape()
        for i in range(rounds):
            async def wrong_token():
                wire = await Wire.open(url, token=f"guess-{i}", ssl=_client_tls(pki, "client"))
                await wire.close()
            await _attempt(result, "wrong_token", wrong_token)

            async def rogue_certificate():
                wire = await Wire.open(url, token=TOKENS["a"], ssl=_client_tls(pki, "rogue"), timeout=5.0)
                await wire.close()
            await _attempt(result, "rogue_certificate", rogue_certificate)

            intruder = await Wire.open(url, model="tenant-a", token=TOKENS["b"], ssl=_client_tls(pki, "client"))
            try:
                await _attempt(result, "other_tenants_ref", lambda: intruder.load(ref=ref))
                await _attempt(result, "other_tenants_key", lambda: intruder.load(key=intruder.key(0, key_prefix(PROBE, 1))))
                await _attempt(result, "other_tenants_delete", lambda: _must_delete(intruder, ref))
            finally:
                await intruder.close()
            result.faults += 5
        after = daemon.scrape()
        counted = {"wrong_token": after.delta(before, "statetier_auth_failures_total", reason="token"),
                   "rogue_certificate": after.delta(before, "statetier_auth_failures_total", reason="tls"),
                   # its own namespace holds nothing (a miss); a's ref is another namespace's object;
                   # deleting it is forbidden
                   "other_tenant": sum(after.delta(before, "statetier_errors_total", reason=reason)
                                       for reason in ("not_found", "namespace", "forbidden"))}
        result.notes["counted_by_daemon"] = {k: int(v) for k, v in counted.items()}
        for name, expected in (("wrong_token", rounds), ("rogue_certificate", rounds), ("other_tenant", 3 * rounds)):
            if counted[name] < expected:
                result.wrong += 1
                result.fail(f"{name}: {expected} refused, the daemon counted {int(counted[name])}")
        if await owner.load(ref=ref) != data:
            result.lost += 1
            result.fail("tenant a's object changed under the attacks")
        await owner.close()
        result.internal_errors += internal_errors(daemon)
    finally:
        daemon.close()


async def _must_delete(wire: Wire, ref: dict) -> None:
    if not await wire.delete(ref):
        raise Forbidden("nothing deleted")  # refused without an error: not served either


async def _foreign_uid(rounds: int, result: ProbeResult) -> None:
    daemon = DaemonProcess({"listen": {"allowed_uids": [65534]}}, name="sec-uid", host_capacity="16MiB")
    try:
        daemon.start()
        before = daemon.scrape()
        for _ in range(rounds):
            async def connect_as_stranger():
                wire = await Wire.open(daemon.url, timeout=5.0)
                await wire.close()
            await _attempt(result, "foreign_uid", connect_as_stranger)
            result.faults += 1
        counted = daemon.scrape().delta(before, "statetier_auth_failures_total", reason="peer_credentials")
        result.notes.setdefault("counted_by_daemon", {})["foreign_uid"] = int(counted)
        if counted < rounds:
            result.wrong += 1
            result.fail(f"foreign uid: {rounds} refused, the daemon counted {int(counted)}")
    finally:
        daemon.close()


async def _redis_forgery(rounds: int, result: ProbeResult, rng: random.Random) -> None:
    with RedisServer() as redis:
        daemon = DaemonProcess(name="sec-redis", host_capacity=None, redis_url=redis.url,
                               settings={"host.enabled": "false", "disk.enabled": "false"})
        try:
            daemon.start()
            wire = await Wire.open(daemon.url, model=PROBE)
            client = redis.client()
            before = daemon.scrape()
            attacks = ("replayed_old_version_by_ref", "forged_identity_bytes", "forged_payload_bytes",
                       "forged_with_another_key", "replayed_old_bytes_under_new_id")
            for i in range(rounds * len(attacks)):  # each attack on a fresh pair: a refusal drops the object
                name = attacks[i % len(attacks)]
                key = wire.key(1, key_prefix("forge", i))
                old_data, new_data = payload(10 + i, 4096), payload(20 + i, 4096)
                old = (await wire.put(key, old_data, request_id=f"f{i}"))["ref"]
                new = (await wire.put(key, new_data, request_id=f"f{i}"))["ref"]  # supersedes old
                new_name = f"st:{{{new['state_id']}}}:c:0"
                genuine = client.get(new_name)
                tamper = {
                    "forged_identity_bytes": _forge_identity(client, new_name, genuine, rng),
                    "forged_payload_bytes": _forge_payload(client, new_name, genuine, rng),
                    "forged_with_another_key": _forge_signature(client, new_name, genuine, new_data),
                    "replayed_old_bytes_under_new_id": _replay(client, new_name,
                                                               client.get(f"st:{{{old['state_id']}}}:c:0")),
                }.get(name)
                await _attempt(result, name, _then_load(wire, new, tamper) if tamper else (lambda: wire.load(ref=old)))
                result.faults += 1
                try:  # by key: the newest genuine object or nothing, never the old bytes
                    if await wire.load(key=key) == old_data:
                        result.wrong += 1
                        result.fail("a load by key served the superseded version")
                except StatetierError:
                    pass
            after = daemon.scrape()
            result.notes.setdefault("counted_by_daemon", {})["rejections"] = {
                reason: int(after.delta(before, "statetier_rejections_total", reason=reason))
                for reason in ("bad_signature", "unknown_key", "corrupt_payload", "stale", "misrouted", "fingerprint", "truncated",
                               "malformed") if after.delta(before, "statetier_rejections_total", reason=reason)}
            counted = sum(result.notes["counted_by_daemon"]["rejections"].values())
            if counted < rounds * len(attacks):
                result.wrong += 1
                result.fail(f"Redis forgery: {rounds * len(attacks)} refused, the daemon counted {counted} rejections")
            client.close()
            await wire.close()
            result.internal_errors += internal_errors(daemon)
        finally:
            daemon.close()


async def _registry_rollback(rounds: int, result: ProbeResult, directory: Path) -> None:
    keyring = directory / "rollback-keyring.json"
    Keyring.generate().save(keyring)  # one keyring: the daemons share Redis
    with RedisServer() as redis:
        daemons = {role: DaemonProcess(name=f"sec-{role}", host_capacity="16MiB", redis_url=redis.url,
                                       keyring=keyring, metrics=False)
                   for role in ("prefill", "decode", "fresh")}
        try:
            for daemon in daemons.values():
                daemon.start()
            wires = {role: await Wire.open(daemon.url, model=PROBE) for role, daemon in daemons.items()}
            client = redis.client()
            for i in range(rounds):
                await _roll_back_once(i, wires, client, result)
            result.notes["registry_heads_behind_seen_by_decode"] = (await wires["decode"].stats())["registry_heads_behind"]
            client.close()
            for wire in wires.values():
                await wire.close()
            result.internal_errors += sum(internal_errors(daemon) for daemon in daemons.values())
        finally:
            for daemon in daemons.values():
                daemon.close()


async def _roll_back_once(i: int, wires: dict, client, result: ProbeResult) -> None:
    prefill, decode, fresh = wires["prefill"], wires["decode"], wires["fresh"]
    key = prefill.key(2, key_prefix("rollback", i))
    old_data, new_data = payload(40 + i, 4096), payload(60 + i, 4096)
    old = (await prefill.put(key, old_data, request_id=f"rb{i}", publish=True))["ref"]
    new = (await prefill.put(key, new_data, request_id=f"rb{i}", publish=True))["ref"]
    if await decode.load(ref=new) != new_data:  # the decode daemon reads version 2's head
        result.lost += 1
        result.fail(f"round {i}: version 2 not served before the rollback")
    stream = ref_from_wire(old).stream_id
    client.hset(f"st:v:{{{stream.hex()}}}", mapping={"version": old["version"],
                                                     "state_id": bytes.fromhex(old["state_id"])})
    result.faults += 1
    await _attempt(result, "registry_rollback_old_ref_on_the_decode_daemon", lambda: decode.load(ref=old))
    result.inputs += 2
    if await decode.load(ref=new) != new_data:
        result.lost += 1
        result.fail(f"round {i}: version 2 not served after the rollback")
    if await decode.load(key=key) == old_data:
        result.wrong += 1
        result.fail(f"round {i}: a load by key served version 1 after the rollback")
    try:
        served = await fresh.load(ref=old) == old_data
    except StatetierError:
        served = False
    result.add("registry_rollback_served_by_a_daemon_that_never_saw_v2" if served
               else "registry_rollback_refused_by_a_daemon_that_never_saw_v2")
    again = (await prefill.put(key, payload(80 + i, 4096), request_id=f"rb{i}", publish=True))["ref"]
    result.inputs += 1
    if again["version"] <= new["version"]:
        result.wrong += 1
        result.fail(f"round {i}: the put after the rollback claimed version {again['version']} again")
    else:
        result.add("registry_rollback_healed_by_the_next_put")


def _then_load(wire: Wire, ref: dict, tamper):
    async def attack():
        tamper()
        await wire.load(ref=ref)
    return attack


def _forge_identity(client, name: str, genuine: bytes, rng: random.Random):
    def tamper():
        header = decode_header(genuine)
        forged = bytearray(genuine)
        forged[rng.randrange(16, header.header_len - 64)] ^= 0x01  # inside the signed header, before the signature
        client.set(name, bytes(forged))
    return tamper


def _forge_payload(client, name: str, genuine: bytes, rng: random.Random):
    def tamper():
        header = decode_header(genuine)
        forged = bytearray(genuine)
        forged[header.header_len + rng.randrange(header.payload_len)] ^= 0x80
        client.set(name, bytes(forged))
    return tamper


def _forge_signature(client, name: str, genuine: bytes, data: bytes):
    def tamper():
        header = decode_header(genuine)
        layout = layout_payload([t.spec for t in header.tensors])
        body = bytes(genuine[header.header_len:])
        forged = seal(header.key, header.provenance, layout, body, keyring=Keyring.generate(),
                      state_id=header.state_id, version=header.version)
        client.set(name, bytes(forged) + body)
    return tamper


def _replay(client, name: str, old_chunk: bytes):
    def tamper():
        client.set(name, old_chunk)
    return tamper


async def run(budget: Budget, result: ProbeResult) -> None:
    rounds = budget.scale(100, 8)
    rng = random.Random(66)
    with tempfile.TemporaryDirectory(prefix="st-pki-") as directory:
        with note_failures(result, "tls and tenants"):
            await _tls_and_tenants(rounds, result, Path(directory))
        with note_failures(result, "foreign uid"):
            await _foreign_uid(rounds, result)
        with note_failures(result, "redis forgery"):
            await _redis_forgery(rounds, result, rng)
        with note_failures(result, "registry rollback"):
            await _registry_rollback(budget.scale(20, 3), result, Path(directory))
