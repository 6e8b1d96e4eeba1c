"""The layer map: guards, their messages, stage slicing, and properties (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.errors import (
    LayerIdError,
    LayerOutsideStageError,
    UnknownLayerError,
    WrongLayerKindError,
)
from hicache.model import CacheKind, CacheSpec, LayerMap, LayerSpec, ModelLayout, load_layout
from tests.conftest import shared_model


@pytest.fixture(scope="module")
def gemma3() -> LayerMap:
    return LayerMap(load_layout(shared_model("gemma3_27b.json")))


def test_guard_message_says_what_the_layer_is(gemma3: LayerMap) -> None:
    assert not gemma3.is_full_attention_layer(3)
    with pytest.raises(
        WrongLayerKindError,
        match=(
            r"^layer 3 of gemma3 is a sliding-window layer \(window 1024\); full-attention layers: "
            r"\[5, 11, 17, 23, 29, 35, 41, 47, 53, 59\]$"
        ),
    ):
        gemma3.local_id(3, CacheKind.FULL)
    assert gemma3.local_id(11, CacheKind.FULL).local_id == 1
    assert gemma3.local_id(12, CacheKind.SLIDING).local_id == 10


def test_wrong_group_is_a_value_error(gemma3: LayerMap) -> None:
    with pytest.raises(
        ValueError,
        match=r"^layer 5 of gemma3 is a full-attention layer, not in "
        r"group 'sliding'; its layers: \[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, "
        r"15, 16, 18, \.\.\. \(52 in all\)\]$",
    ):
        gemma3.to_local(5, "sliding")


def test_unknown_and_outside_stage_ids() -> None:
    layout = load_layout(shared_model("gpt_oss_20b.json"))
    stage = LayerMap(layout, 12, 24)
    with pytest.raises(
        UnknownLayerError, match=r"^layer 24 does not exist: gpt_oss has layers 0\.\.23$"
    ):
        stage.is_full_attention_layer(24)
    with pytest.raises(UnknownLayerError, match=r"^layer -1 does not exist"):
        stage.layer(-1)
    with pytest.raises(
        LayerOutsideStageError,
        match=r"^layer 3 of gpt_oss is outside this pipeline "
        r"stage; this stage holds layers 12\.\.23$",
    ):
        stage.local_id(3, CacheKind.FULL)
    # local ids restart at 0 in each stage
    assert stage.local_id(13, CacheKind.FULL).local_id == 0
    assert stage.to_global("full", 5) == 23
    with pytest.raises(
        LayerIdError,
        match=r"^local id 6 is not in group 'full' of gpt_oss; "
        r"allowed: 0\.\.5$",
    ):
        stage.to_global("full", 6)
    with pytest.raises(
        LayerIdError,
        match=r"^pipeline stage 12\.\.30 is not a layer range of "
        r"gpt_oss; allowed: 0 <= start_layer < end_layer <= 24$",
    ):
        LayerMap(layout, 12, 30)


def test_holey_mlp_layers_and_missing_groups() -> None:
    layer_map = LayerMap(load_layout(shared_model("nemotron_h_8b.json")))
    with pytest.raises(
        WrongLayerKindError,
        match=r"^layer 1 of nemotron_h is a layer with no cache "
        r"\(MLP/MoE only\); full-attention layers: \[7, 18, 29, 40\]$",
    ):
        layer_map.local_id(1, CacheKind.FULL)
    assert layer_map.local_id(18, CacheKind.FULL).local_id == 1
    assert layer_map.slots(1) == ()
    assert [lid for lid, _ in layer_map.walk()][:4] == [0, 2, 4, 6]
    with pytest.raises(
        LayerIdError,
        match=r"^nemotron_h has no cache group 'sliding' in pipeline "
        r"stage 0\.\.52; groups: \['full', 'mamba'\]$",
    ):
        layer_map.group("sliding")


def test_linear_layer_routed_to_full_path_fails_clearly() -> None:
    layer_map = LayerMap(load_layout(shared_model("qwen3_next_80b.json")))
    with pytest.raises(
        WrongLayerKindError,
        match=r"^layer 0 of qwen3_next is a linear-attention "
        r"layer; full-attention layers: \[3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, "
        r"47\]$",
    ):
        layer_map.local_id(0, CacheKind.FULL)


def test_index_v_misuse_and_kv_sharing_guards() -> None:
    v32 = LayerMap(load_layout(shared_model("deepseek_v32_exp.json")))
    assert v32.is_index_k_layer(5)
    assert not v32.is_index_kv_layer(5)
    assert v32.is_mla_layer(5)
    gemma3n = LayerMap(load_layout(shared_model("gemma3n_e4b.json")))
    assert gemma3n.is_kv_shared_layer(20)
    assert not gemma3n.has_cache(20)
    with pytest.raises(
        WrongLayerKindError,
        match=r"^layer 24 of gemma3n is a KV-sharing layer that "
        r"reads layer 19's cache; full-attention layers: \[4, 9, 14, 19\]$",
    ):
        gemma3n.local_id(24, CacheKind.FULL)
    with pytest.raises(
        LayerIdError,
        match=r"^layer 20 of gemma3n reuses layer 18's KV, which is "
        r"outside pipeline stage 20\.\.35",
    ):
        LayerMap(gemma3n.layout, 20, 35)


def test_parallel_hybrid_has_two_slots() -> None:
    layer_map = LayerMap(load_layout(shared_model("falcon_h1_7b.json")), 4, 8)
    slots = layer_map.slots(5)
    assert [(s.group.name, s.local_id) for s in slots] == [("full", 1), ("mamba", 1)]
    assert layer_map.is_full_attention_layer(5)
    assert layer_map.is_mamba_layer(5)


# ---- properties --------------------------------------------------------------------------

_SPECS = [
    CacheSpec(CacheKind.FULL, num_kv_heads=2, head_dim=8, v_head_dim=8),
    CacheSpec(CacheKind.SLIDING, num_kv_heads=2, head_dim=8, v_head_dim=8, window_tokens=4),
    CacheSpec(CacheKind.MAMBA, state_shapes=(("ssm", (2, 3)),)),
]
_layer_choices = st.sampled_from(["none", "full", "sliding", "mamba", "full+mamba"])


@st.composite
def layouts_and_stages(draw: st.DrawFn) -> tuple[ModelLayout, int, int]:
    names = draw(st.lists(_layer_choices, min_size=1, max_size=40))
    specs = {
        "full": (_SPECS[0],),
        "sliding": (_SPECS[1],),
        "mamba": (_SPECS[2],),
        "full+mamba": (_SPECS[0], _SPECS[2]),
        "none": (),
    }
    layout = ModelLayout.build("prop", [LayerSpec(i, specs[n]) for i, n in enumerate(names)])
    start = draw(st.integers(0, len(names) - 1))
    end = draw(st.integers(start + 1, len(names)))
    return layout, start, end


@given(layouts_and_stages())
def test_global_local_round_trip(case: tuple[ModelLayout, int, int]) -> None:
    layout, start, end = case
    layer_map = LayerMap(layout, start, end)
    for group in layer_map.groups:
        # local ids are dense 0..n-1 over this stage's layers, even when global ids have holes
        for local_id, global_id in enumerate(group.layer_ids):
            assert start <= global_id < end
            assert layer_map.to_local(global_id, group.name) == local_id
            assert layer_map.to_global(group.name, local_id) == global_id
    for layer_id in range(start, end):
        kinds = {k for k in layout.layers[layer_id].kinds}
        assert {s.group.kind for s in layer_map.slots(layer_id)} == kinds
        for kind in CacheKind:
            if kind in kinds:
                assert layer_map.local_id(layer_id, kind).group.kind is kind
            else:
                with pytest.raises(WrongLayerKindError):
                    layer_map.local_id(layer_id, kind)
    for layer_id in [*range(0, start), *range(end, layout.num_layers)]:
        with pytest.raises(LayerOutsideStageError):
            layer_map.slots(layer_id)


@given(layouts_and_stages(), st.integers(1, 5))
def test_stages_partition_every_group(case: tuple[ModelLayout, int, int], cuts: int) -> None:
    layout, _, _ = case
    n = layout.num_layers
    bounds = sorted({0, n, *[(n * i) // (cuts + 1) for i in range(1, cuts + 1)]})
    for group in layout.groups:
        joined: list[int] = []
        for lo, hi in itertools.pairwise(bounds):
            if lo == hi:
                continue
            stage = LayerMap(layout, lo, hi)
            joined.extend(i for g in stage.groups if g.spec == group.spec for i in g.layer_ids)
        assert tuple(joined) == group.layer_ids


@pytest.mark.parametrize(
    ("model", "layer_id", "true_guards"),
    [
        ("gemma3_27b.json", 0, {"is_sliding_window_layer"}),
        ("gemma3_27b.json", 5, {"is_full_attention_layer"}),
        ("llama4_scout.json", 0, {"is_chunked_attention_layer"}),
        ("qwen3_next_80b.json", 0, {"is_linear_attention_layer"}),
        ("lfm2_350m.json", 0, {"is_conv_layer"}),
        ("jamba_v01.json", 0, {"is_mamba_layer"}),
        ("falcon_h1_7b.json", 3, {"is_full_attention_layer", "is_mamba_layer"}),
        ("kimi_linear_48b.json", 3, {"is_full_attention_layer", "is_mla_layer"}),
        (
            "deepseek_v32_exp.json",
            9,
            {"is_sparse_attention_layer", "is_mla_layer", "is_index_k_layer"},
        ),
        ("gemma3n_e4b.json", 24, {"is_kv_shared_layer"}),
        ("nemotron_h_8b.json", 1, set()),
    ],
)
def test_every_guard_on_real_layouts(model: str, layer_id: int, true_guards: set[str]) -> None:
    layer_map = LayerMap(load_layout(shared_model(model)))
    guards = [
        "is_full_attention_layer",
        "is_sliding_window_layer",
        "is_chunked_attention_layer",
        "is_sparse_attention_layer",
        "is_linear_attention_layer",
        "is_mamba_layer",
        "is_conv_layer",
        "is_index_k_layer",
        "is_index_kv_layer",
        "is_mla_layer",
        "is_kv_shared_layer",
    ]
    assert {g for g in guards if getattr(layer_map, g)(layer_id)} == true_guards
    assert layer_map.has_cache(layer_id) == bool(true_guards - {"is_kv_shared_layer"})
