"""Config: defaults ← TOML ← environment ← overrides, and errors that name the field and its source."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pydantic
import pytest

from statetier.daemon.config import Config, HostTierConfig
from statetier.daemon.client_env import client_url_from_env
from statetier.daemon.config_loading import load_config, parse_setting
from statetier.daemon.config_values import GiB, MiB
from statetier.protocol.errors import ConfigError

TOML = """
log_level = "DEBUG"
producer_id = "from-file"

[disk]
directory = "/srv/statetier"
capacity_bytes = "2GiB"
fsync = false
segment_bytes = 1048576

[redis]
url = "redis://127.0.0.1:7001/0"
ttl_seconds = 60

[listen]
socket_mode = 0o600
allowed_uids = [1000, 1001]

[metrics]
port = 9000

[[tenants]]
name = "default"

[[tenants]]
name = "team-a"
uids = [1001]
token_sha256 = "%s"
quota_bytes = { disk = "1GiB", redis = 5000 }
""" % hashlib.sha256(b"secret-token").hexdigest()


@pytest.fixture
def toml_file(tmp_path: Path) -> Path:
    path = tmp_path / "statetier.toml"
    path.write_text(TOML)
    return path


def test_defaults_without_any_source() -> None:
    config = load_config(env={})
    assert config == Config()
    assert config.disk.directory == Path("./statetier-data")
    assert config.disk.capacity_bytes == 16 * GiB
    assert config.disk.segment_bytes == 64 * MiB
    assert config.limits.max_frame_bytes == 65 * MiB
    assert config.redis.url is None and config.redis.ttl_seconds == 3600 and config.redis.chunk_bytes == 2 * MiB
    assert config.listen.socket_path == Path("./statetier.sock") and config.listen.socket_mode == 0o660
    assert [t.name for t in config.tenants] == ["default"]
    assert config.metrics.port == 9464 and config.log_level == "info"
    assert config.keyring_path() == Path("./statetier-data/keyring.json")


def test_each_layer_overrides_the_one_before(toml_file: Path) -> None:
    env = {
        "STATETIER_DISK__CAPACITY_BYTES": "3221225472",  # env beats the file's 2GiB
        "STATETIER_REDIS__TTL_SECONDS": "120",
        "STATETIER_METRICS__PORT": "9100",
        "STATETIER_LOG_LEVEL": "warning",
        "STATETIER_PRODUCER_ID": "42",  # a text field keeps the raw string, not the JSON number
        "STATETIER_URL": "unix:///elsewhere.sock",  # the client's variable, not config
        "STATETIER_REDIS_SERVER": "/usr/bin/redis-server",  # the test suite's, not config
    }
    overrides = {"metrics.port": 9200, "disk.directory": "/override/dir"}
    config = load_config(toml_file, env=env, overrides=overrides)

    assert config.disk.directory == Path("/override/dir")  # override beats the file
    assert config.disk.capacity_bytes == 3 * GiB  # env beats the file
    assert config.disk.fsync is False and config.disk.segment_bytes == MiB  # file beats defaults
    assert config.disk.encrypt is False  # default survives beside file values
    assert config.redis.url == "redis://127.0.0.1:7001/0"
    assert config.redis.ttl_seconds == 120
    assert config.metrics.port == 9200  # override beats env beats file
    assert config.log_level == "warning"
    assert config.producer_id == "42"
    assert config.listen.socket_mode == 0o600
    assert config.listen.allowed_uids == (1000, 1001)
    team = config.tenant_named("team-a")
    assert team is not None and team.uids == (1001,) and team.quota_bytes == {"disk": GiB, "redis": 5000}


def test_config_file_named_by_the_environment(toml_file: Path) -> None:
    config = load_config(env={"STATETIER_CONFIG": str(toml_file)})
    assert config.disk.directory == Path("/srv/statetier")
    assert config.log_level == "debug"


def test_env_values_parse_as_json_else_text() -> None:
    env = {
        "STATETIER_LISTEN__ALLOWED_GIDS": "[10, 20]",
        "STATETIER_DISK__FSYNC": "false",
        "STATETIER_DISK__DIRECTORY": "/data/st",
        "STATETIER_HOST__CAPACITY_BYTES": "512MiB",
        "STATETIER_LISTEN__SOCKET_MODE": "0640",
        "STATETIER_TENANTS": '[{"name": "only", "uids": [7]}]',
    }
    config = load_config(env=env)
    assert config.listen.allowed_gids == (10, 20)
    assert config.disk.fsync is False
    assert config.disk.directory == Path("/data/st")
    assert config.host.capacity_bytes == 512 * MiB
    assert config.listen.socket_mode == 0o640
    assert [(t.name, t.uids) for t in config.tenants] == [("only", (7,))]
    assert parse_setting("redis.url", "null") is None
    assert parse_setting("producer_id", "007") == "007"
    assert parse_setting("redis.ttl_seconds", "null") is None
    assert parse_setting("disk.fsync", "true") is True


def test_bad_toml_value_names_the_field_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[disk]\ncapacity_bytes = -1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert str(caught.value) == f"disk.capacity_bytes: Input should be greater than 0 (from config file {path})"


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("[disk]\ndirectry = '/x'\n\n[cache]\nsize = 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    message = str(caught.value)
    assert f"disk.directry: Extra inputs are not permitted (from config file {path})" in message
    assert f"cache: Extra inputs are not permitted (from config file {path})" in message


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(env={"STATETIER_METRICS__PORT": "http"})
    assert str(caught.value) == (
        "metrics.port: Input should be a valid integer, unable to parse string as an integer "
        "(from environment STATETIER_METRICS__PORT)"
    )
    with pytest.raises(ConfigError, match=r"^disk\.nope: Extra inputs are not permitted \(from environment STATETIER_DISK__NOPE\)$"):
        load_config(env={"STATETIER_DISK__NOPE": "1"})


def test_override_errors_name_the_override() -> None:
    with pytest.raises(ConfigError, match=r"^listen\.tcp: expected \"host:port\", got 'localhost' \(from override listen\.tcp\)$"):
        load_config(env={}, overrides={"listen.tcp": "localhost"})


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match=r"^host\.low_watermark: must be below high_watermark \(0\.5\) "):
        load_config(env={}, overrides={"host.high_watermark": 0.5, "host.low_watermark": 0.6})
    with pytest.raises(ConfigError, match=r"^disk\.high_watermark: Input should be less than or equal to 1 "):
        load_config(env={}, overrides={"disk.high_watermark": 1.5})
    with pytest.raises(ConfigError, match=r"^listen\.tls_key: tls_cert and tls_key go together "):
        load_config(env={}, overrides={"listen.tcp": "127.0.0.1:7000", "listen.tls_cert": "/etc/cert.pem"})
    with pytest.raises(ConfigError, match=r"^listen\.tls_key: TLS applies to TCP only"):
        load_config(env={}, overrides={"listen.tls_cert": "/c.pem", "listen.tls_key": "/k.pem"})
    with pytest.raises(ConfigError, match=r"^tenants: tenant name 'a' appears twice \(from override tenants\)$"):
        load_config(env={}, overrides={"tenants": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ConfigError, match=r"^tenants\[1\]\.quota_bytes: unknown tier 'ram'"):
        load_config(env={}, overrides={"tenants": [{"name": "a"}, {"name": "b", "quota_bytes": {"ram": 1}}]})
    with pytest.raises(ConfigError, match=r"^redis\.url: must start with redis://, rediss:// or unix://"):
        load_config(env={}, overrides={"redis.url": "http://x"})

    tls = load_config(env={}, overrides={
        "listen.tcp": "[::1]:7443", "listen.tls_cert": "/c.pem", "listen.tls_key": "/k.pem", "listen.tls_client_ca": "/ca.pem",
    })
    assert tls.listen.tcp_address() == ("::1", 7443)
    assert tls.listen.tls_client_ca == Path("/ca.pem")


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[disk\n")
    with pytest.raises(ConfigError, match=f"^config file {broken}: "):
        load_config(broken, env={})


def test_config_is_frozen() -> None:
    config = load_config(env={})
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.disk = None  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.disk.fsync = False  # type: ignore[misc]


def test_host_capacity_sized_from_free_memory() -> None:
    auto = HostTierConfig()
    assert auto.resolved_capacity(mem_available=8 * GiB) == 2 * GiB
    assert auto.resolved_capacity(mem_available=100 * MiB) == 64 * MiB  # clamped up
    assert auto.resolved_capacity(mem_available=1024 * GiB) == 64 * GiB  # clamped down
    assert 64 * MiB <= auto.resolved_capacity() <= 64 * GiB  # this machine's /proc/meminfo
    assert HostTierConfig(capacity_bytes=123456).resolved_capacity(mem_available=8 * GiB) == 123456


def test_tenant_resolution(toml_file: Path) -> None:
    config = load_config(toml_file, env={})
    assert config.tenant_for_uid(1001) == "team-a"
    assert config.tenant_for_uid(4242) == "default"  # allowed, unmapped → default
    assert config.tenant_for_token("secret-token") == "team-a"
    assert config.tenant_for_token("wrong") is None
    assert config.tenant_for_token("\udc80") is None  # not text: matches nothing, raises nothing
    assert config.is_unix_peer_allowed(1000, 1000, own_uid=500)
    assert not config.is_unix_peer_allowed(4242, 4242, own_uid=500)

    no_default = load_config(env={}, overrides={"tenants": [{"name": "solo", "uids": [5]}]})
    assert no_default.tenant_for_uid(6) is None
    assert no_default.is_unix_peer_allowed(500, 1, own_uid=500)  # own uid
    assert no_default.is_unix_peer_allowed(0, 0, own_uid=500)  # root
    assert no_default.is_unix_peer_allowed(5, 5, own_uid=500)  # listed by a tenant
    assert not no_default.is_unix_peer_allowed(6, 6, own_uid=500)


def test_client_url_from_env() -> None:
    assert client_url_from_env({}) == "unix://./statetier.sock"
    assert client_url_from_env({"STATETIER_URL": "tcp://10.0.0.1:7000"}) == "tcp://10.0.0.1:7000"


def test_a_file_mode_given_as_660_is_octal_everywhere_and_printed_in_octal(tmp_path: Path) -> None:
    """Regression: ``--set listen.socket_mode=660`` and ``STATETIER_LISTEN__SOCKET_MODE=660`` were
    read as JSON's decimal 660, a socket of mode 0o1224, and ``statetier config`` printed 432."""
    assert load_config(env={"STATETIER_LISTEN__SOCKET_MODE": "660"}).listen.socket_mode == 0o660
    assert parse_setting("listen.socket_mode", "660") == "660"
    assert load_config(overrides={"listen.socket_mode": parse_setting("listen.socket_mode", "660")}).listen.socket_mode == 0o660
    toml = tmp_path / "decimal.toml"
    toml.write_text("[listen]\nsocket_mode = 660\n")
    with pytest.raises(ConfigError) as refused:
        load_config(toml, env={})
    assert refused.value.message == (f"listen.socket_mode: 660 is not a file mode (0 to 0o777); if you meant octal 660, "
                                     f"write 0o660 (TOML) or \"660\" (text) (from config file {toml})")
    with pytest.raises(ConfigError, match="not an octal file mode"):
        load_config(env={"STATETIER_LISTEN__SOCKET_MODE": "4777"})
    assert '"socket_mode": "0o640"' in load_config(env={"STATETIER_LISTEN__SOCKET_MODE": "640"}).model_dump_json(indent=1)
