"""Peer credentials and tenant resolution (the socket-level refusals are in test_server_protocol)."""

from __future__ import annotations

import os
import socket

import pytest

from statetier.daemon.server.auth import (
    PeerCredentials,
    TenantDirectory,
    check_peer,
    peer_credentials,
    token_sha256,
)
from statetier.daemon.config import ListenConfig, TenantConfig
from statetier.protocol.errors import Forbidden, InvalidRequest, Unauthorized

ME = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
STRANGER_UID = os.getuid() + 12345


def test_peer_credentials_of_a_real_unix_socket_pair() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        assert peer_credentials(left) == ME


def test_default_allows_the_daemons_own_uid_and_root() -> None:
    listen = ListenConfig()
    check_peer(ME, listen)
    check_peer(PeerCredentials(1, 0, 0), listen)
    with pytest.raises(Forbidden) as refused:
        check_peer(PeerCredentials(1, STRANGER_UID, STRANGER_UID), listen)
    assert refused.value.detail["auth"] == "peer_credentials"


def test_allowed_uids_replace_the_default() -> None:
    listen = ListenConfig(allowed_uids=(STRANGER_UID,))
    check_peer(PeerCredentials(1, STRANGER_UID, STRANGER_UID), listen)
    with pytest.raises(Forbidden, match=f"peer uid {ME.uid}"):
        check_peer(ME, listen)


def test_an_allowed_gid_admits_a_peer_whose_uid_is_not_listed() -> None:
    listen = ListenConfig(allowed_uids=(STRANGER_UID,), allowed_gids=(ME.gid,))
    check_peer(ME, listen)


ALICE_TOKEN, BOB_TOKEN = "alice-secret", "bob-secret"
TENANTS = (
    TenantConfig(name="alice", token_sha256=token_sha256(ALICE_TOKEN), uids=(ME.uid,)),
    TenantConfig(name="bob", token_sha256=token_sha256(BOB_TOKEN).upper()),
    TenantConfig(name="default"),
)


def test_a_token_names_its_tenant_on_any_transport() -> None:
    directory = TenantDirectory(TENANTS)
    assert directory.resolve({"token": BOB_TOKEN}, peer=None) == "bob"  # digest compared case-free
    assert directory.resolve({"token": BOB_TOKEN, "tenant": "bob"}, peer=ME) == "bob"
    assert directory.resolve({"token": ALICE_TOKEN}, peer=None) == "alice"
    # "default" is what SDK clients send unless told otherwise: the token decides.
    assert directory.resolve({"token": ALICE_TOKEN, "tenant": "default"}, peer=ME) == "alice"


def test_a_wrong_token_is_unauthorized() -> None:
    with pytest.raises(Unauthorized) as refused:
        TenantDirectory(TENANTS).resolve({"token": "guess"}, peer=None)
    assert refused.value.detail["auth"] == "token"


def test_a_token_for_another_tenant_than_the_one_named_is_forbidden() -> None:
    with pytest.raises(Forbidden, match="belong to tenant 'bob', not 'alice'"):
        TenantDirectory(TENANTS).resolve({"token": BOB_TOKEN, "tenant": "alice"}, peer=None)


def test_unix_peers_map_by_uid_and_fall_back_to_default() -> None:
    directory = TenantDirectory(TENANTS)
    assert directory.resolve({}, peer=ME) == "alice"
    assert directory.resolve({"tenant": "alice"}, peer=ME) == "alice"
    assert directory.resolve({"tenant": "default"}, peer=ME) == "default"  # any allowed peer may
    assert TenantDirectory(TENANTS[:2]).resolve({"tenant": "default"}, peer=ME) == "alice"
    stranger = PeerCredentials(1, STRANGER_UID, STRANGER_UID)
    assert directory.resolve({}, peer=stranger) == "default"
    with pytest.raises(Forbidden):
        directory.resolve({"tenant": "alice"}, peer=stranger)


def test_a_unix_peer_with_no_tenant_and_no_default_is_unauthorized() -> None:
    directory = TenantDirectory(TENANTS[:2])
    with pytest.raises(Unauthorized, match=f"no tenant is configured for uid {STRANGER_UID}"):
        directory.resolve({}, peer=PeerCredentials(1, STRANGER_UID, STRANGER_UID))


def test_no_tenants_configured_means_one_default_tenant() -> None:
    assert TenantDirectory(()).resolve({}, peer=ME) == "default"


def test_tcp_needs_a_token_unless_mutual_tls_verified_the_client() -> None:
    directory = TenantDirectory(TENANTS)
    with pytest.raises(Unauthorized, match="bearer token is required"):
        directory.resolve({}, peer=None)
    assert directory.resolve({}, peer=None, tls_verified=True) == "default"
    with pytest.raises(Unauthorized):
        TenantDirectory(TENANTS[:2]).resolve({}, peer=None, tls_verified=True)


@pytest.mark.parametrize("hello", [{"token": 7}, {"tenant": ["alice"]}])
def test_hello_credentials_of_the_wrong_type_are_invalid(hello: dict) -> None:
    with pytest.raises(InvalidRequest):
        TenantDirectory(TENANTS).resolve(hello, peer=ME)


def test_a_token_that_is_not_utf8_text_is_unauthorized_not_an_encoding_error() -> None:
    with pytest.raises(Unauthorized):
        TenantDirectory(TENANTS).resolve({"token": "\udc80"}, peer=None)
    with pytest.raises(Unauthorized):
        token_sha256("ok\ud800")


def test_a_requested_tenant_name_is_quoted_bounded_and_escaped_in_the_refusal() -> None:
    with pytest.raises(Forbidden) as refused:
        TenantDirectory(TENANTS).resolve({"tenant": "y" * 5000 + "\n\udc80"}, peer=ME)
    assert len(refused.value.message) < 300 and "\n" not in refused.value.message
    refused.value.message.encode("ascii")
    with pytest.raises(Forbidden) as refused:
        TenantDirectory(TENANTS).resolve({"tenant": "evil\n\udc80"}, peer=ME)
    assert "'evil\\n\\udc80'" in refused.value.message
