"""What the vLLM connector requires of an engine (``clients/vllm/contract.py``), with plain
objects in place of vLLM's configs; EAGLE's unstable last block against a real daemon; and the
opt-in vLLM scripts importable as ``make test-vllm`` starts them (``python -m``, from the work
folder, the checkout on ``PYTHONPATH``), without vLLM.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from statetier.clients.vllm.contract import check_engine, check_mamba_spec, drops_last_block, saves_decode_tokens
from statetier.clients.vllm.layout import ConnectorConfig
from statetier.protocol.errors import InvalidRequest
from tests.support.daemons import daemon_fixture
from statetier.clients.vllm.scheduler import ScheduledStep
from tests.support.vllm_connector import FakeRequest, ask, attention_layout, tokens


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, metrics=False, name="vllmcontract")


def engine_config(policy: str = "recompute", stages: int = 1, speculative=None, prefix_caching: bool = False):
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=stages, tensor_parallel_size=1),
                           speculative_config=speculative,
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))


def test_an_engine_that_would_fail_a_refused_load_is_refused_at_start() -> None:
    check_engine(engine_config())
    with pytest.raises(InvalidRequest, match="kv_load_failure_policy='recompute'.*'fail'"):
        check_engine(engine_config(policy="fail"))  # vLLM's default


def test_pipeline_parallelism_is_refused_at_start_with_what_to_change() -> None:
    with pytest.raises(InvalidRequest, match="pipeline parallelism.*pipeline_parallel_size=2.*=1"):
        check_engine(engine_config(stages=2))


def test_hybrid_mtp_is_refused_by_name_and_align_mode_accepted() -> None:
    check_mamba_spec(SimpleNamespace(num_speculative_blocks=0, mamba_cache_mode="none"))
    check_mamba_spec(SimpleNamespace(num_speculative_blocks=0, mamba_cache_mode="align"))  # test_vllm_align.py
    with pytest.raises(InvalidRequest, match="hybrid MTP.*num_speculative_blocks=2"):
        check_mamba_spec(SimpleNamespace(num_speculative_blocks=2, mamba_cache_mode="align"))
    with pytest.raises(InvalidRequest, match="'none' or 'align'.*'all'"):
        check_mamba_spec(SimpleNamespace(num_speculative_blocks=0, mamba_cache_mode="all"))


def test_eagle_drops_the_last_block_and_speculation_saves_no_decoded_tokens() -> None:
    eagle = SimpleNamespace(use_eagle_block_drop=lambda: True)
    assert drops_last_block(engine_config(speculative=eagle))
    assert not drops_last_block(engine_config(speculative=SimpleNamespace(use_eagle_block_drop=lambda: False)))
    assert not drops_last_block(engine_config())
    cfg = ConnectorConfig.from_extra({"url": "unix:///x"})
    assert saves_decode_tokens(cfg, engine_config(prefix_caching=True))
    assert not saves_decode_tokens(cfg, engine_config(prefix_caching=True, speculative=eagle))


@pytest.mark.parametrize("by", ["lookup", "handoff"])
def test_an_eagle_hit_is_one_block_short_as_vllm_makes_its_own(engines, by) -> None:
    layout = attention_layout()
    producer = engines(layout, role="producer", seed=41)
    consumer = engines(layout, role="consumer", seed=None, drops_last_block=True)
    prompt = tokens(41, 50)
    produced = FakeRequest("p-41", prompt)
    blocks = ([1, 2, 3, 4],)
    producer.scheduler.after_alloc(produced, blocks, 0)
    producer.worker.save(producer.scheduler.build_meta([ScheduledStep(produced, 0, 50, blocks)]).saves)
    producer.worker.wait_idle()
    producer.scheduler.refs_saved(producer.worker.take_saved_refs())
    _, params = producer.scheduler.request_finished(produced)
    request = FakeRequest(f"c-41-{by}", prompt, kv_transfer_params=params if by == "handoff" else None)
    assert ask(consumer.scheduler, request) == 32  # 48 stored: the drafter's last block is recomputed
    consumer.scheduler.after_alloc(request, ([6, 7, 8, 9],), 32)
    (job,) = consumer.scheduler.build_meta([]).loads
    assert sorted(i.ref.key.token_end for i in job.items) == [16, 32]
    assert consumer.scheduler.hit_source(request.request_id) == ("p2p" if by == "handoff" else "host")


def test_every_opt_in_vllm_script_imports_as_make_test_vllm_starts_it(tmp_path) -> None:
    """run_e2e starts its children as modules from the work folder: without the checkout on
    their path, ``events_e2e`` died on ``No module named 'tests'``."""
    from tests.vllm_e2e.run_e2e import ROOT, child_command, child_env

    assert child_command("events_e2e") == [sys.executable, "-m", "tests.vllm_e2e.events_e2e"]
    probe = ("import importlib; [importlib.import_module(f'tests.vllm_e2e.{m}').main for m in "
             "('run_e2e', 'events_e2e', 'engine_run', 'scheduler_align', 'align_e2e', 'tp2_e2e')]; import tests.vllm_e2e.tiny_models")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bare = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in child_env().items() if k != "PYTHONPATH"})
    assert "No module named 'tests'" in bare.stderr  # what the fix is for
    assert (ROOT / "tests" / "vllm_e2e" / "events_e2e.py").is_file()
