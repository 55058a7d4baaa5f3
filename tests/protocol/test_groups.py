"""Group objects' identity and layout rules (``protocol/groups.py``), sans-I/O.

A group key is a ``StateKey`` whose ``layer`` is the group id and whose ``group_layers``
are the group's layers; its payload names each tensor ``"<layer>.<name>"``. A put must
cover every layer of the group and no other, and a partial load may choose only the
group's layers: both are refused with DESIGN §4's placement reason.
"""

from __future__ import annotations

import pytest

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import InvalidRequest, PlacementMismatch
from statetier.protocol.groups import LayerGroup, check_layers, check_regions, chosen, region_name, split_region_name
from statetier.protocol.identity import Kind, Namespace, StateKey
from statetier.protocol.sealed import layout_payload

NS = Namespace(bytes(range(32)))
PREFIX = bytes(32)
ATTENTION = LayerGroup(Kind.KV, 0, (3, 9, 15))
MAMBA = LayerGroup(Kind.SSM, 1, (0, 1, 2, 4))


def test_a_group_key_names_the_group_id_and_its_layers_in_order():
    key = ATTENTION.key(NS, PREFIX, 256, 512, shard=1)
    assert key == StateKey(NS, Kind.KV, 0, PREFIX, 256, 512, 1, (3, 9, 15))
    assert LayerGroup.of_key(key) == ATTENTION
    assert LayerGroup.of_key(StateKey(NS, Kind.KV, 3, PREFIX, 0, 16)) is None
    assert key.placement() != LayerGroup(Kind.KV, 0, (3, 9, 16)).key(NS, PREFIX, 256, 512, 1).placement()


def test_an_ssm_group_key_spans_from_token_zero():
    assert MAMBA.key(NS, PREFIX, 0, 8192).tokens_absorbed == 8192
    with pytest.raises(InvalidRequest, match="token_start must be 0"):
        MAMBA.key(NS, PREFIX, 16, 8192)


@pytest.mark.parametrize("layers", [(), (1, 1), (-1,), (True,)], ids=["empty", "twice", "negative", "bool"])
def test_a_group_refuses_layers_it_cannot_hold(layers):
    with pytest.raises(InvalidRequest):
        LayerGroup(Kind.KV, 0, layers)


def test_region_names_carry_the_layer():
    assert region_name(15, "k") == "15.k"
    assert split_region_name("15.recurrent_states.0") == (15, "recurrent_states.0")
    for bad in ("k", "x.k", "15.", "-1.k", "١.k"):
        with pytest.raises(PlacementMismatch, match="names no layer"):
            split_region_name(bad)


def test_a_put_must_cover_every_layer_of_its_group_and_no_other():
    key = ATTENTION.key(NS, PREFIX, 0, 16)
    check_regions(key, ["3.k", "3.v", "9.k", "9.v", "15.k", "15.v"])
    with pytest.raises(PlacementMismatch, match=r"misses layers \[15\]"):
        check_regions(key, ["3.k", "9.k"])
    with pytest.raises(PlacementMismatch, match=r"layers \[4\] are not in group 0"):
        check_regions(key, ["3.k", "9.k", "15.k", "4.k"])


def test_a_partial_load_chooses_layers_of_the_group_only():
    key = ATTENTION.key(NS, PREFIX, 0, 16)
    check_layers(key, [9])
    with pytest.raises(PlacementMismatch, match=r"layers \[4\] are not in group 0"):
        check_layers(key, [9, 4])
    with pytest.raises(InvalidRequest):
        check_layers(key, [9, 9])
    with pytest.raises(InvalidRequest, match="only a group object"):
        check_layers(StateKey(NS, Kind.KV, 3, PREFIX, 0, 16), [3])


def test_chosen_keeps_payload_order_and_the_layout_packs_regions():
    specs = [TensorSpec(region_name(layer, name), "bfloat16", (2, 3)) for layer in (3, 9, 15) for name in "kv"]
    assert [s.name for s in chosen(specs, [15, 3])] == ["3.k", "3.v", "15.k", "15.v"]
    assert chosen(specs, None) == specs
    layout = layout_payload(specs)
    assert layout.offsets == (0, 64, 128, 192, 256, 320)  # each region 64-byte aligned
