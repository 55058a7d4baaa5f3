"""Which objects a restore at a boundary needs, and the handoff a producer builds from the refs
its workers report; no vLLM, no daemon call.

- ``Spans(layout, tp_size)`` — ``groups(blocks)``: the group objects of every KV cache group
  and TP shard a restore at ``blocks`` attention blocks needs (one per attention block, one
  Mamba state at the boundary; a replicated group's on shard 0 only); ``layers(blocks)``: the
  per-layer objects producers saved before group objects; ``largest(have, most)`` → the
  largest block count ≤ ``most`` whose every group object is in ``have`` (refs by
  ``span_of``), and those refs.
- ``span_of(key)`` — what a ref stands for: kind, layer or group, its layers, shard, span.
- ``SavedRefs`` — a producer's request: the refs its workers reported saved (vLLM's
  worker → scheduler metadata, ``StatetierWorkerMetadata``, every TP rank's), ``add(refs)``.

The handoff is built from these at ``request_finished`` without asking the daemon: the refs
are those the daemon answered each worker's ``put_many`` with. A request that finishes in
the step its last saves start has not heard of them yet: its handoff then names the boundary
saved (``saved``) with the refs reported so far, and the consumer looks the rest up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from statetier.protocol.identity import Kind, StateKey, StateRef

from .layout import EngineLayout


def span_of(key: StateKey) -> tuple:
    return key.kind, key.layer, tuple(key.group_layers), key.shard, key.token_start, key.token_end


@dataclass(frozen=True)
class Spans:
    layout: EngineLayout
    tp_size: int = 1

    def groups(self, blocks: int) -> list[tuple]:
        size, end = self.layout.block_size, blocks * self.layout.block_size
        spans = []
        for shard in range(self.tp_size):
            for group in self.layout.groups:
                if shard >= group.shard_count(self.tp_size):
                    continue  # a replicated state: one object, shard 0's
                layers = group.layer_group.layers
                if group.kind is Kind.KV:
                    spans += [(Kind.KV, group.index, layers, shard, j * size, (j + 1) * size) for j in range(blocks)]
                else:
                    spans.append((Kind.SSM, group.index, layers, shard, 0, end))
        return spans

    def layers(self, blocks: int) -> list[tuple]:
        size, end = self.layout.block_size, blocks * self.layout.block_size
        spans = []
        for shard in range(self.tp_size):
            spans += [(Kind.KV, lid, (), shard, j * size, (j + 1) * size)
                      for lid in self.layout.attention_layers for j in range(blocks)]
            spans += [(Kind.SSM, lid, (), shard, 0, end) for lid in self.layout.ssm_layers]
        return spans

    def largest(self, have: dict[tuple, StateRef], most: int, *, by_layer: bool = False) -> tuple[int, list[StateRef]]:
        """The most blocks (≤ ``most``) ``have`` restores whole, and the refs of that restore."""
        for blocks in range(most, 0, -1):
            for wanted in (self.groups(blocks), self.layers(blocks)) if by_layer else (self.groups(blocks),):
                if all(span in have for span in wanted):
                    return blocks, [have[span] for span in wanted]
        return 0, []


@dataclass
class SavedRefs:
    refs: dict[tuple, StateRef] = field(default_factory=dict)

    def add(self, refs) -> None:
        for ref in refs:
            self.refs[span_of(ref.key)] = ref
