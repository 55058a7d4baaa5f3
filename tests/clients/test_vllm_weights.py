"""The vLLM connector's weights identity (``clients/vllm/weights.py``), on real safetensors files.

New weights at the same path must change the namespace (issue 27 item 3): a fine-tune keeps
every header and size and changes the values; the identity sees it. The same files anywhere
give the same identity; a hub model gives its cached commit; nothing to go on is refused
unless the connector is told to run without one; an explicit ``model_fingerprint`` wins.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from statetier.clients.vllm.layout import CacheGroup, ConnectorConfig, EngineLayout, StateSpec, namespace_spec
from statetier.clients.vllm.weights import resolve_fingerprint, weights_identity
from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import Kind

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_model(directory, seed: int, *, shards: int = 2, hidden: int = 512) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for shard in range(shards):
        tensors = {f"model.layers.{shard}.mlp.weight": torch.randn(hidden, hidden, generator=gen),
                   f"model.layers.{shard}.norm.weight": torch.ones(hidden)}
        save_file(tensors, str(directory / f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"),
                  metadata={"format": "pt"})
    (directory / "config.json").write_text('{"model_type": "llama"}')


def namespace_of(fingerprint: str) -> bytes:
    layout = EngineLayout((CacheGroup(0, Kind.KV, 16, (("model.layers.0.attn", 0),),
                                      (StateSpec("kv", "bfloat16", (8, 128)),)),))
    cfg = ConnectorConfig(url="unix:///x", model_fingerprint=fingerprint)
    return namespace_spec(cfg, layout, model="/models/m", revision="", config_digest="c", weight_dtype="bfloat16",
                          tp_size=1, engine_tag="vllm-0.32/cpu").namespace().digest


def test_new_weights_of_the_same_shapes_at_the_same_path_change_the_identity(tmp_path) -> None:
    model = tmp_path / "model"
    write_model(model, seed=1)
    before = weights_identity(str(model))
    assert before is not None and before.value.startswith("files:") and "2 weight files" in before.source
    shutil.rmtree(model)
    write_model(model, seed=2)  # a fine-tune: same names, dtypes, shapes, sizes; other values
    after = weights_identity(str(model))
    assert after.value != before.value
    assert namespace_of(after.value) != namespace_of(before.value)


def test_the_same_weights_anywhere_have_the_same_identity_and_any_change_of_shape_or_file_shows(tmp_path) -> None:
    write_model(tmp_path / "a", seed=7)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert weights_identity(str(tmp_path / "a")).value == weights_identity(str(tmp_path / "copy")).value
    write_model(tmp_path / "wider", seed=7, hidden=520)
    write_model(tmp_path / "more", seed=7, shards=3)
    values = {weights_identity(str(tmp_path / name)).value for name in ("a", "wider", "more")}
    assert len(values) == 3


def test_a_hub_model_is_its_cached_commit_and_a_commit_revision_is_itself(tmp_path) -> None:
    refs = tmp_path / "hub" / "models--ibm-granite--granite-4.0-h-tiny" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(COMMIT + "\n")
    found = weights_identity("ibm-granite/granite-4.0-h-tiny", hub_cache=tmp_path / "hub")
    assert found.value == f"hub:{COMMIT}"
    assert weights_identity("ibm-granite/granite-4.0-h-tiny", "v2", hub_cache=tmp_path / "hub") is None
    other = "f" * 40
    assert weights_identity("org/never-downloaded", other, hub_cache=tmp_path / "hub").value == f"hub:{other}"


def test_without_an_identity_the_connector_refuses_to_start_unless_told(tmp_path, caplog) -> None:
    empty = tmp_path / "no-weights"
    empty.mkdir()
    cfg = ConnectorConfig.from_extra({"url": "unix:///x"})
    with pytest.raises(InvalidRequest, match="model_fingerprint"):
        resolve_fingerprint(cfg, str(empty), hub_cache=tmp_path / "hub")
    allowed = ConnectorConfig.from_extra({"url": "unix:///x", "allow_unidentified_weights": True})
    with caplog.at_level(logging.WARNING, logger="vllm.statetier"):
        assert resolve_fingerprint(allowed, str(empty), hub_cache=tmp_path / "hub") == ""
    assert "no weights identity" in caplog.text
    with pytest.raises(InvalidRequest, match="allow_unidentified_weights"):
        ConnectorConfig.from_extra({"url": "unix:///x", "allow_unidentified_weights": "yes"})


def test_an_explicit_fingerprint_wins_and_what_was_chosen_is_logged(tmp_path, caplog) -> None:
    write_model(tmp_path / "model", seed=3)
    with caplog.at_level(logging.INFO, logger="vllm.statetier"):
        derived = resolve_fingerprint(ConnectorConfig(url="unix:///x"), str(tmp_path / "model"))
        given = resolve_fingerprint(ConnectorConfig(url="unix:///x", model_fingerprint="release-42"),
                                    str(tmp_path / "model"))
    assert derived.startswith("files:") and given == "release-42"
    assert f"weights identity {derived}" in caplog.text and "weights identity release-42 (model_fingerprint)" in caplog.text


def test_a_file_that_is_not_safetensors_is_refused_by_name(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(InvalidRequest, match="not a safetensors file"):
        weights_identity(str(tmp_path))
