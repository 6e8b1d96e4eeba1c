"""Explicit YAML layer lists and the layout file formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.errors import LayoutError
from hicache.model import CacheKind, LayerMap, load_layout

GOOD = """\
model_type: custom-hybrid
layers:
  - {repeat: 2, kind: sliding, kv_heads: 4, head_dim: 64, window_tokens: 256}
  - {kind: full, kv_heads: 4, head_dim: 64}
  - caches:
      - {kind: full, kv_heads: 4, head_dim: 64}
      - {kind: mamba, state_shapes: {conv: [512, 3], ssm: [8, 64, 16]}}
  - {kind: none}
  - {reuses: 2}
  - {kind: sparse, kv_format: mla, head_dim: 576, index_head_dim: 128, index_has_v: true}
"""


def test_explicit_list_builds_groups(tmp_path: Path) -> None:
    path = tmp_path / "layers.yaml"
    path.write_text(GOOD)
    layout = load_layout(path)
    assert layout.model_type == "custom-hybrid"
    assert [[k.value for k in layer.kinds] for layer in layout.layers] == [
        ["sliding"],
        ["sliding"],
        ["full"],
        ["full", "mamba"],
        [],
        [],
        ["sparse"],
    ]
    assert layout.layers[5].reuses == 2
    assert layout.group("full").layer_ids == (2, 3)
    layer_map = LayerMap(layout)
    assert layer_map.is_index_kv_layer(6)
    assert layer_map.local_id(3, CacheKind.MAMBA).local_id == 0


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("layers: []", r"layers: List should have at least 1 item"),
        (
            "layers:\n  - {kind: full, head_dim: 64}",
            r"layers\[0\]\.caches\[0\]: a full cache needs kv_heads and head_dim",
        ),
        (
            "layers:\n  - {kind: sliding, kv_heads: 1, head_dim: 8}",
            r"layers\[0\]\.caches\[0\]: window_tokens is required for, and only for, kind sliding$",
        ),
        (
            "layers:\n  - {kind: mamba}",
            r"layers\[0\]\.caches\[0\]: a mamba cache needs state_shapes",
        ),
        (
            "layers:\n  - {kind: full, kv_heads: 1, head_dim: 8, colour: red}",
            r"layers\[0\]\.colour: unknown key$",
        ),
        (
            "layers:\n  - {kind: quantum, kv_heads: 1, head_dim: 8}",
            r"layers\[0\]\.caches\[0\]\.kind: Input should be 'full', 'sliding', 'chunked', "
            r"'sparse', 'linear', 'mamba' or 'conv' \(got 'quantum'\)",
        ),
        ("layers:\n  - {reuses: 0}", r"layer 0 reuses layer 0; it must reuse an earlier layer"),
    ],
)
def test_explicit_list_errors_name_file_key_and_allowed(
    tmp_path: Path, text: str, pattern: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(LayoutError, match=rf"^(?:{path}: |explicit \({path}\): ){pattern}"):
        load_layout(path)


def test_unknown_file_format(tmp_path: Path) -> None:
    path = tmp_path / "model.toml"
    path.write_text("")
    with pytest.raises(
        LayoutError,
        match=rf"^cannot tell the format of '{path}'; allowed: a Hugging "
        r"Face config\.json \(\.json\) or an explicit layer list \(\.yaml / \.yml\)$",
    ):
        load_layout(path)


def test_broken_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{nope")
    with pytest.raises(LayoutError, match=rf"^model config '{path}' is not valid JSON: "):
        load_layout(path)
