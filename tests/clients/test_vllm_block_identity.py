"""A block's identity through the vLLM connector is the one vLLM gives it (issue 32), against a
real daemon, without vLLM: besides its token ids, the request's ``cache_salt``, LoRA adapter,
multimodal inputs and prompt embeddings. Two requests of equal token ids and another value of
one of these never share a block; equal values still do; a handoff of another value is refused
by its name; what cannot be keyed is a counted miss, never saved, never served. And
``request_finished`` asks the daemon nothing: the handoff comes from the refs the workers report.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from statetier.clients.vllm.extra_keys import AdapterIdentities, request_keys
from statetier.clients.vllm.jobs import handoff_from_params
from statetier.protocol.identity import prefix_hashes
from tests.support.daemons import daemon_fixture
from tests.support.vllm_connector import (
    ATTN,
    BLOCK,
    CONSUMER_BLOCKS,
    MAMBA,
    PRODUCER_BLOCKS,
    FakeRequest,
    ask,
    prefill,
    restore,
    tokens,
)

FIELDS = ("cache_salt", "lora", "mm", "prompt_embeds")


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, metrics=True, name="vllmident")


@dataclass(frozen=True)
class LoRARequest:  # vLLM's vllm.lora.request.LoRARequest, the fields the connector reads
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class PlaceholderRange:
    offset: int
    length: int


@dataclass(frozen=True)
class Feature:  # vLLM's MultiModalFeatureSpec: a content hash and where its placeholders are
    identifier: str
    mm_position: PlaceholderRange
    modality: str = "image"


def adapter_dir(root: Path, name: str, seed: int) -> Path:
    """A PEFT adapter folder: ``adapter_model.safetensors`` (a real safetensors file)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    data = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    header = json.dumps({"lora_A": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, len(data)]}}).encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    return folder


def embeds(seed: int, n: int = 40) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


def with_field(field: str, value: int, tmp_path: Path) -> dict:
    """The request fields carrying value ``value`` of ``field`` (token ids equal for every value)."""
    if field == "cache_salt":
        return {"cache_salt": f"tenant-{value}"}
    if field == "lora":
        return {"lora_request": LoRARequest(f"adapter-{value}", value, str(adapter_dir(tmp_path, f"a{value}", value)))}
    if field == "mm":  # the same placeholder ids, another image
        return {"mm_features": [Feature(f"image-hash-{value}", PlaceholderRange(4, 20))]}
    return {"prompt_token_ids": None, "prompt_embeds": embeds(value)}


def request(rid: str, prompt: list[int], field: str, value: int, tmp_path: Path, **kwargs) -> FakeRequest:
    fields = {"prompt_token_ids": prompt, **with_field(field, value, tmp_path), **kwargs}
    return FakeRequest(rid, **fields)


@pytest.mark.parametrize("field", FIELDS)
def test_equal_token_ids_with_another_value_never_share_a_block_and_equal_values_do(engines, field, tmp_path) -> None:
    producer, consumer = engines(role="producer", seed=31), engines(role="consumer", seed=None)
    prompt = tokens(31, 40)
    prefill(producer, request(f"p-{field}", prompt, field, 1, tmp_path), PRODUCER_BLOCKS, seed=31)
    other = request(f"c-{field}-other", prompt, field, 2, tmp_path)
    assert ask(consumer.scheduler, other) == 0  # the producer's blocks are of another prefix
    if field != "prompt_embeds":  # (an embeddings prompt has no token ids of its own to ask plainly with)
        assert ask(consumer.scheduler, FakeRequest(f"c-{field}-plain", prompt)) == 0
    same = request(f"c-{field}-same", prompt, field, 1, tmp_path)
    assert restore(consumer, same, CONSUMER_BLOCKS) == 32
    for name in ATTN:
        for src, dst in ((1, 5), (2, 7)):
            assert torch.equal(consumer.buffers[name][dst], producer.buffers[name][src])
    for name in MAMBA:
        want = producer.snapshots[(f"p-{field}", 32, name)]
        assert all(torch.equal(consumer.worker.states(name, 2)[k], want[k]) for k in want)
    assert consumer.worker.take_results().failed == set()


@pytest.mark.parametrize("field", FIELDS)
def test_a_handoff_of_another_value_is_refused_by_its_name_and_one_of_the_same_loads(engines, field,
                                                                                       tmp_path) -> None:
    producer, consumer = engines(role="producer", seed=32), engines(role="consumer", seed=None)
    prompt = tokens(32, 40)
    produced = request(f"p-{field}", prompt, field, 1, tmp_path)
    prefill(producer, produced, PRODUCER_BLOCKS, seed=32)
    _, params = producer.scheduler.request_finished(produced)
    assert handoff_from_params(params).refs  # by ref: the workers reported every save
    consumer.scheduler.counts.take()
    other = request(f"c-{field}-other", prompt, field, 2, tmp_path, kv_transfer_params=params)
    assert consumer.scheduler.matched_tokens(other, 0) == 0  # refused at once: no daemon call, no load
    assert consumer.scheduler.counts.take() == {"lookups": 1, f"misses.handoff_{field}": 1}
    same = request(f"c-{field}-same", prompt, field, 1, tmp_path, kv_transfer_params=params)
    assert restore(consumer, same, CONSUMER_BLOCKS) == 32
    for name in ATTN:
        assert torch.equal(consumer.buffers[name][7], producer.buffers[name][2])


def test_a_handoff_of_another_salt_with_its_name_forged_is_refused_by_the_daemon(engines, tmp_path) -> None:
    """The names in a handoff are a courtesy: each load states the consumer's own prefix hash."""
    producer, consumer = engines(role="producer", seed=33), engines(role="consumer", seed=None)
    prompt = tokens(33, 40)
    produced = FakeRequest("p-forged", prompt, cache_salt="tenant-a")
    prefill(producer, produced, PRODUCER_BLOCKS, seed=33)
    _, params = producer.scheduler.request_finished(produced)
    theirs = FakeRequest("c-forged", prompt, cache_salt="tenant-b", kv_transfer_params=params)
    params["statetier"]["keys"] = request_keys(theirs, AdapterIdentities()).digests
    assert consumer.scheduler.matched_tokens(theirs, 0) == 32
    consumer.scheduler.after_alloc(theirs, CONSUMER_BLOCKS, 32)
    consumer.worker.start_loads(consumer.scheduler.build_meta([]).loads)
    consumer.worker.wait_idle()
    assert consumer.worker.take_results().failed == {"c-forged"}
    assert consumer.worker.counts.take() == {"refusals.position": 1}
    assert all(not t.any() for t in consumer.buffers.values())  # nothing of tenant a reached tenant b


@pytest.mark.parametrize("field", ["lora", "mm"])
def test_what_cannot_be_keyed_is_a_counted_miss_and_never_saved(engines, field, tmp_path) -> None:
    producer, consumer = engines(role="producer", seed=34), engines(role="consumer", seed=None)
    prompt = tokens(34, 40)
    if field == "lora":  # an adapter with no weights to identify it by
        fields = {"lora_request": LoRARequest("ghost", 7, str(tmp_path / "no-such-adapter"))}
    else:  # an image without a content hash
        fields = {"mm_features": [Feature("", PlaceholderRange(0, 8))]}
    metas = prefill(producer, FakeRequest("p-unkeyed", prompt, **fields), PRODUCER_BLOCKS)
    assert [m.saves for m in metas] == [(), (), ()]
    assert producer.scheduler.counts.take()[f"saves_unkeyed.{field}"] == 1
    assert producer.scheduler.request_finished(FakeRequest("p-unkeyed", prompt, **fields)) == (False, None)
    assert ask(consumer.scheduler, FakeRequest("c-unkeyed", prompt, **fields)) == 0
    assert consumer.scheduler.counts.take() == {"lookups": 1, f"misses.unkeyed_{field}": 1}


def test_a_request_without_extra_keys_is_keyed_exactly_as_before() -> None:
    prompt = tokens(35, 40)
    keys = request_keys(FakeRequest("plain", prompt), AdapterIdentities())
    assert keys.digests == {} and keys.hashes(prompt, BLOCK) == prefix_hashes(prompt, BLOCK)
    salted = request_keys(FakeRequest("salted", prompt, cache_salt="s"), AdapterIdentities()).hashes(prompt, BLOCK)
    assert all(a != b for a, b in zip(salted, prefix_hashes(prompt, BLOCK)))  # the salt is in every later block


_HASHES = """
import sys, torch
from dataclasses import dataclass
from statetier.clients.vllm.extra_keys import AdapterIdentities, request_keys
from tests.support.vllm_connector import FakeRequest, tokens

@dataclass
class R:
    offset: int
    length: int

@dataclass
class F:
    identifier: str
    mm_position: R

@dataclass
class L:
    lora_name: str
    lora_int_id: int
    lora_path: str

request = FakeRequest("r", tokens(36, 48), cache_salt="tenant-a", mm_features=[F("img", R(20, 10))],
                      lora_request=L("adapter", 1, sys.argv[1]))
keys = request_keys(request, AdapterIdentities())
print(",".join(h.hex() for h in keys.hashes(keys.tokens, 16)))
"""


def test_the_keys_are_the_same_in_every_process(tmp_path) -> None:
    """No per-process seed: two processes with other hash seeds (and another adapter path to the
    same weights, as on another node) derive the same prefix hashes."""
    root = Path(__file__).resolve().parents[2]
    answers = set()
    for seed, folder in (("1", "node-a"), ("2", "node-b")):
        path = adapter_dir(tmp_path / folder, "adapter", 5)
        done = subprocess.run([sys.executable, "-c", _HASHES, str(path)], capture_output=True, text=True, cwd=root,
                              env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120, check=True)
        answers.add(done.stdout.strip())
    assert len(answers) == 1 and len(answers.pop().split(",")) == 3


def daemon_requests(daemon) -> float:
    """Every request the daemon has answered (``tier="daemon"`` operations, lookups included),
    from its /metrics; the tiers' own operations (write-behind) run on their own."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("statetier_operations_total{") and 'tier="daemon"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_request_finished_asks_the_daemon_nothing_and_is_counted(engines, daemon) -> None:
    producer = engines(role="producer", seed=37)
    prompt = tokens(37, 40)
    produced = FakeRequest("p-37", prompt)
    prefill(producer, produced, PRODUCER_BLOCKS, seed=37)
    before = daemon_requests(daemon)
    delay_free, params = producer.scheduler.request_finished(produced)
    assert daemon_requests(daemon) == before  # zero daemon requests from vLLM's scheduler thread
    assert delay_free and handoff_from_params(params).tokens == 32
    counted = producer.scheduler.counts.take()
    assert counted["calls.request_finished"] == 1 and counted["handoffs.by_ref"] == 1
    assert "scheduler_seconds.request_finished" in counted  # its cost, in the stats vLLM logs


def test_a_request_finished_before_its_saves_were_answered_hands_off_by_key(engines) -> None:
    """The refs of the last step's saves reach the scheduler a step later: the handoff names the
    boundary saved, and the consumer looks it up rather than load fewer blocks."""
    producer, consumer = engines(role="producer", seed=38), engines(role="consumer", seed=None)
    prompt = tokens(38, 40)
    produced = FakeRequest("p-38", prompt)
    prefill(producer, produced, PRODUCER_BLOCKS, seed=38)
    producer.scheduler.producer.tracked["p-38"].refs.refs.clear()  # as if vLLM had not yet delivered them
    _, params = producer.scheduler.request_finished(produced)
    handoff = handoff_from_params(params)
    assert (handoff.tokens, handoff.saved, handoff.refs) == (32, 32, ())
    assert producer.scheduler.counts.take()["handoffs.by_key"] == 1
    assert restore(consumer, FakeRequest("c-38", prompt, kv_transfer_params=params), CONSUMER_BLOCKS) == 32
    assert consumer.scheduler.counts.take()["handoffs.looked_up"] == 1
