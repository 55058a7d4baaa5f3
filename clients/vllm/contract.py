"""What the connector requires of a vLLM engine, checked when it starts; reads vLLM's configs
(plain attributes: no vLLM import, so the default suite tests it with plain objects).

- ``check_engine(vllm_config)`` — raises ``InvalidRequest`` naming the setting to change:
  - ``kv_load_failure_policy`` must be ``"recompute"``: the connector refuses a load whose
    state is not the request's (that is its purpose), and under vLLM's default ``"fail"`` a
    refused or late load fails the user's request; with ``"recompute"`` vLLM computes the
    refused blocks and the user sees no difference. Under ``MultiConnector`` the connector sees
    only its own entry's config, so the policy must be set there too (vLLM acts on the outer one);
  - ``pipeline_parallel_size`` must be 1: a pipeline stage holds only some layers, and the
    connector's group objects and joint hits cover every layer of a cache group;
- ``check_mamba_spec(spec)`` — a Mamba cache group the connector restores: ``mamba_cache_mode``
  ``"none"`` (one state slot per request, saved at step ends on block ends) or ``"align"``
  (vLLM's mode under prefix caching: the boundary states vLLM hands over,
  ``boundary_state_offloads``), and no speculative blocks (hybrid MTP: refused by name, its
  draft states are not keyed);
- ``drops_last_block(vllm_config)`` — EAGLE (vLLM's ``use_eagle_block_drop``): a hit's last
  block is dropped, as vLLM drops it from its own prefix-cache hits;
- ``saves_decode_tokens(cfg, vllm_config)`` — whether producers save decoded tokens' blocks:
  ``save_decode_tokens``, by default on with prefix caching (multi-turn reuse) and off under
  speculative decoding (its scheduled tokens are not all kept);
- ``returns_handoff(cfg, kv_role)`` — whether a finished request's ``kv_transfer_params``
  carry the handoff (``{"statetier": {refs, …}}``): what a consumer behind a PD proxy needs,
  and nobody else. ``return_handoff`` when set, else only for ``kv_producer``: a ``kv_both``
  instance serves end users, whose completions must not carry statetier's refs and digests.
"""

from __future__ import annotations

from statetier.protocol.errors import InvalidRequest

from .layout import ConnectorConfig


def check_engine(vllm_config) -> None:
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
    if policy != "recompute":
        raise InvalidRequest(f"the statetier connector needs kv_transfer_config.kv_load_failure_policy='recompute' "
                             f"(it is {policy!r}; under MultiConnector, in statetier's entry of 'connectors' too: "
                             f"the connector sees only its own): a load statetier refuses (another request's "
                             f"state, a late answer) must be recomputed, not fail the request")
    stages = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    if stages != 1:
        raise InvalidRequest(f"the statetier connector does not support pipeline parallelism "
                             f"(pipeline_parallel_size={stages}): its objects and joint hits cover every layer of "
                             f"a cache group, and a pipeline stage holds only some; run with "
                             f"pipeline_parallel_size=1")


def check_mamba_spec(spec) -> None:
    if spec.num_speculative_blocks:
        raise InvalidRequest(f"the statetier connector does not support hybrid MTP (speculative decoding on a model "
                             f"with Mamba state: num_speculative_blocks={spec.num_speculative_blocks}): its draft "
                             f"states are not keyed")
    if spec.mamba_cache_mode not in ("none", "align"):
        raise InvalidRequest(f"the statetier connector restores Mamba state with mamba_cache_mode 'none' or 'align' "
                             f"(it is {spec.mamba_cache_mode!r})")


def drops_last_block(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and bool(spec.use_eagle_block_drop())


def saves_decode_tokens(cfg: ConnectorConfig, vllm_config) -> bool:
    if cfg.save_decode_tokens is not None:
        return cfg.save_decode_tokens
    return bool(vllm_config.cache_config.enable_prefix_caching) and vllm_config.speculative_config is None


def returns_handoff(cfg: ConnectorConfig, kv_role: str) -> bool:
    if cfg.return_handoff is not None:
        return cfg.return_handoff
    return kv_role == "kv_producer"
