"""hicache's layout of a transformers-5.x saved config.json against the cache transformers
actually makes for that model: per layer the attention kind, window / chunk, per-token tensors,
and the state tensors' shapes; and the facts about transformers' caches the harness relies on
(a conv state's first column is never read; garbage in it changes nothing, in a read column
it does).

A mismatch names the layer, hicache's side and transformers' side.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from hicache.model import LayerMap, load_layout
from tests.real_models.families import FAMILIES, STATE_FAMILIES
from tests.real_models.harness import (
    SENSITIVE,
    Zoo,
    continue_logits,
    conv_width_mismatches,
    layout_mismatches,
    max_diff,
    prefill,
    tokens_for,
)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layout_of_the_saved_config_is_the_cache_transformers_makes(zoo: Zoo, family: str) -> None:
    """`load_layout` on exactly what `model.config.save_pretrained` wrote."""
    tm = zoo.get(family)
    assert layout_mismatches(tm, tm.layer_map) == []


@pytest.mark.parametrize("family", [n for n, f in FAMILIES.items() if f.checkpoint_fields])
def test_layout_of_a_checkpoint_style_config_is_the_same(
    zoo: Zoo, family: str, tmp_path: Path
) -> None:
    """The same config written as the family's released checkpoints write it (the hub's field
    names, families.py's `checkpoint_fields`): the same layout."""
    tm = zoo.get(family)
    data = json.loads(tm.config_path.read_text())
    data.update(FAMILIES[family].checkpoint_fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    layer_map = LayerMap(load_layout(path))
    assert layout_mismatches(tm, layer_map) == []
    assert [(g.name, g.spec, g.layer_ids) for g in layer_map.groups] == [
        (g.name, g.spec, g.layer_ids) for g in tm.layer_map.groups
    ]


@pytest.mark.parametrize("family", STATE_FAMILIES)
def test_conv_state_is_the_kernel_minus_one_columns_the_model_reads(zoo: Zoo, family: str) -> None:
    """kernel-1 columns per conv state: what the model reads, and what vLLM and SGLang allocate
    per slot (LFM2's rule once kept conv_L_cache columns, one more than an engine's pool)."""
    assert conv_width_mismatches(zoo.get(family)) == []


@pytest.mark.parametrize("family", STATE_FAMILIES)
def test_transformers_never_reads_a_conv_states_first_column(zoo: Zoo, family: str) -> None:
    """What the harness relies on when it fills the first conv column with garbage (and
    hicache keeps only the others): garbage there leaves the continuation bit-identical;
    garbage in the next column moves it past SENSITIVE (so this check can fail)."""
    tm = zoo.get(family)
    prompt = tokens_for(f"{family}/conv", 12)
    new = tokens_for(f"{family}/conv-next", 5)
    for continuation in (new, new[:1]):  # the chunked path and the one-token decode path
        want = continue_logits(tm.model, prefill(tm.model, prompt, 4).cache, continuation)
        diffs = []
        for column in (0, 1):
            cache = prefill(tm.model, prompt, 4).cache
            gen = torch.Generator().manual_seed(column)
            for layer in cache.layers:
                conv = getattr(layer, "conv_states", {}).get(0)
                if conv is not None:
                    conv[..., column] = torch.randn(conv[..., column].shape, generator=gen) * 10
            diffs.append(max_diff(continue_logits(tm.model, cache, continuation), want))
        assert diffs[0] == 0.0, f"garbage in conv column 0 moved the logits by {diffs[0]}"
        assert diffs[1] > SENSITIVE, f"garbage in conv column 1 moved the logits by {diffs[1]}"
