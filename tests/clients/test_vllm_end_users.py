"""Issue 41 (4, 5): what the vLLM connector shows end users and operators, without vLLM.

- A ``kv_both`` instance serves end users: a finished request's ``kv_transfer_params`` carry
  no statetier handoff (refs, digests, prefix hashes), although its saves were scheduled and
  vLLM keeps the blocks for them; a ``kv_producer`` returns it, as a PD proxy needs, and
  ``return_handoff`` opts a ``kv_both`` instance in (or a producer out).
- The namespace the connector logs is the one ``statetier ls`` lists for its saves, and the
  one ``statetier purge --namespace`` takes.
"""

from __future__ import annotations

import pytest

from statetier.clients import Client
from statetier.clients.vllm.contract import returns_handoff
from statetier.clients.vllm.jobs import handoff_from_params
from statetier.clients.vllm.layout import ConnectorConfig, stored_namespace
from statetier.daemon.cli import main
from statetier.protocol.errors import InvalidRequest
from tests.support.daemons import daemon_fixture
from tests.support.vllm_connector import PRODUCER_BLOCKS, FakeRequest, prefill, tokens


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, metrics=False, name="vllm-end-users")


def config(**extra) -> ConnectorConfig:
    return ConnectorConfig.from_extra({"url": "unix:///nowhere.sock", **extra})


def test_only_a_producer_returns_the_handoff_unless_configured() -> None:
    assert [returns_handoff(config(), role) for role in ("kv_producer", "kv_both", "kv_consumer")] == [
        True, False, False]
    assert returns_handoff(config(return_handoff=True), "kv_both") is True
    assert returns_handoff(config(return_handoff=False), "kv_producer") is False
    with pytest.raises(InvalidRequest, match="return_handoff"):
        config(return_handoff="yes")


@pytest.mark.parametrize("role, extra, handed", [("both", {}, False), ("producer", {}, True),
                                                 ("both", {"return_handoff": True}, True)])
def test_a_kv_both_completion_carries_no_statetier_params(engines, role, extra, handed) -> None:
    seed = {"both": 61, "producer": 62}[role] + len(extra)
    engine = engines(role=role, seed=seed, extra=extra)
    request = FakeRequest(f"p-{seed}", tokens(seed, 40))
    prefill(engine, request, PRODUCER_BLOCKS)
    delay_free, params = engine.scheduler.request_finished(request)
    assert delay_free  # its saves still keep their blocks until the workers report them sent
    if handed:
        assert handoff_from_params(params).tokens == 32
    else:
        assert params is None


def test_the_connectors_namespace_is_the_one_ls_lists_and_purge_takes(engines, daemon, capsys) -> None:
    engine = engines(role="producer", seed=70)
    prefill(engine, FakeRequest("p-70", tokens(70, 40)), PRODUCER_BLOCKS)
    logged = stored_namespace(engine.scheduler.cfg, engine.scheduler.spec)
    with Client(daemon.url) as client:
        listed = {row["namespace"] for row in client.list_objects()["namespaces"]}
    assert logged in listed and engine.scheduler.spec.namespace().hex() not in listed
    assert main(["purge", "--namespace", logged[:16] + "…", "--url", daemon.url]) == 0  # as the log abbreviates it
    assert logged in capsys.readouterr().out


def test_the_tiny_model_of_the_recipe_is_written_by_a_module_offline(tmp_path) -> None:
    """Issue 41 (6): docs/integration.md's vLLM recipe runs on it; nothing is downloaded."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "tiny-granite"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}  # an empty cache
    done = subprocess.run([sys.executable, "-m", "statetier.clients.vllm.tiny_models", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert len(config["layer_types"]) == 4 and config["mamba_n_heads"] == 8  # Mamba2, attention, Mamba2, attention
    assert (out / "model.safetensors").is_file() and "--skip-tokenizer-init" in done.stdout
