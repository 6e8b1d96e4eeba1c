"""`model.index_format`: how a sparse layer's indexer keys are stored (`hicache.model.index_format`).

Judged: the default keeps the layout (and every page key) as before; fp8_scaled gives DeepSeek
Sparse Attention's 132 bytes a token (fp8 keys, then a float32 scale per 128 dims) whatever the
KV dtype, keys pages apart from the other format, and is refused by name where it cannot apply.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hicache.assembly import geometries as deployment_geometries
from hicache.config import load_deployment
from hicache.errors import ConfigError
from hicache.model import IndexSpec, load_layout, with_index_format
from hicache.model.explicit import ExplicitLayout
from tests.conftest import CONFIGS

V32 = CONFIGS / "models" / "deepseek-v3.2-exp.json"


def deploy(tmp_path: Path, extra: str = "", config: Path = V32) -> Path:
    shutil.copy(config, tmp_path / "model.json")
    path = tmp_path / "deploy.yaml"
    path.write_text(f"model:\n  config_path: model.json\n  page_size_tokens: 64\n{extra}")
    return path


def sparse_geometry(path: Path, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    loaded = load_deployment(path, env=env or {})
    (geometry,) = deployment_geometries(loaded.deployment, loaded.layer_map()).values()
    return loaded, geometry


def test_default_keeps_index_keys_in_the_kv_dtype_and_the_keys_as_before(tmp_path: Path) -> None:
    loaded, geometry = sparse_geometry(deploy(tmp_path))
    assert loaded.deployment.model.index_format == "kv_dtype"
    assert [name for name, _ in geometry.tensors] == ["kv", "index_k"]
    assert geometry.dtype_of("index_k") == torch.bfloat16
    assert geometry.row_bytes("index_k") == 64 * 128 * 2
    # page keys hash the spec's repr: unchanged by the new field while it is unset
    assert repr(geometry.group.spec.index) == "IndexSpec(head_dim=128, has_v=False)"


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_fp8_scaled_is_132_bytes_a_token_whatever_the_kv_dtype(
    tmp_path: Path, kv_dtype: str
) -> None:
    extra = f"  index_format: fp8_scaled\n  dtype: {kv_dtype}\n  state_dtype: bfloat16\n"
    _, geometry = sparse_geometry(deploy(tmp_path, extra))
    assert [name for name, _ in geometry.tensors] == ["kv", "index_k", "index_k_scale"]
    assert geometry.dtype_of("index_k") == torch.float8_e4m3fn
    assert geometry.dtype_of("index_k_scale") == torch.float32
    assert geometry.row_bytes("index_k") + geometry.row_bytes("index_k_scale") == 64 * 132
    kv_bytes = 576 * torch.empty(0, dtype=getattr(torch, kv_dtype)).element_size()
    assert geometry.page_bytes_per_layer == 64 * (kv_bytes + 132)
    # keyed apart from kv_dtype's: the dtypes and the spec are in every page key's namespace
    assert "index_k_scale=float32" in geometry.dtype_signature
    assert "fp8_block=128" in repr(geometry.group.spec)
    # an fp8 index is carried by uint8 engine buffers (SGLang's, vLLM's), as fp8 KV is
    assert geometry.accepts_dtype("index_k", torch.uint8)


def test_the_two_formats_never_share_pages(tmp_path: Path) -> None:
    from hicache.channel.protocol import layout_summary

    plain = load_deployment(deploy(tmp_path), env={})
    scaled = load_deployment(deploy(tmp_path), env={"HICACHE_MODEL__INDEX_FORMAT": "fp8_scaled"})
    summaries = []
    for loaded in (plain, scaled):
        geos = deployment_geometries(loaded.deployment, loaded.layer_map())
        summaries.append(layout_summary(loaded.layer_map(), geos, 64))
    assert summaries[0] != summaries[1]  # hello refuses an engine of the other format


def test_a_model_without_an_indexer_is_unchanged(tmp_path: Path) -> None:
    config = CONFIGS / "models" / "llama-3.1-8b.json"
    layout = load_layout(config)
    assert with_index_format(layout, "fp8_scaled", "test") == layout


def test_fp8_scaled_refused_where_the_keys_do_not_split_in_blocks_of_128(tmp_path: Path) -> None:
    layout = ExplicitLayout.model_validate(
        {
            "model_type": "tiny_dsa",
            "layers": [
                {"kind": "sparse", "kv_format": "mla", "head_dim": 96, "index_head_dim": 16}
            ],
        }
    ).to_layout("test")
    with pytest.raises(ConfigError) as err:
        with_index_format(layout, "fp8_scaled", "deploy.yaml")
    text = str(err.value)
    assert "model.index_format is 'fp8_scaled' (from deploy.yaml)" in text
    assert "layer 0 of tiny_dsa" in text
    assert "index head_dim 16" in text
    assert "allowed: kv_dtype" in text


def test_a_bad_index_format_names_the_value_where_it_came_from_and_the_choices(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as err:
        load_deployment(deploy(tmp_path), env={"HICACHE_MODEL__INDEX_FORMAT": "fp4"})
    text = str(err.value)
    assert "index_format" in text
    assert "fp4" in text
    assert "fp8_scaled" in text
    assert "HICACHE_MODEL__INDEX_FORMAT" in text


def test_an_explicit_fp8_index_is_checked() -> None:
    assert IndexSpec(128, fp8_block=128).tensors()[1] == ("index_k_scale", (1, 1))
    with pytest.raises(ValueError, match="keys only"):
        IndexSpec(128, has_v=True, fp8_block=128)
    for bad, why in (
        ({"index_fp8_block": 128}, "needs index_head_dim"),
        ({"index_head_dim": 100, "index_fp8_block": 128}, "divide its head_dim"),
    ):
        with pytest.raises(ValueError, match=why):
            ExplicitLayout.model_validate(
                {
                    "model_type": "x",
                    "layers": [{"kind": "sparse", "kv_format": "mla", "head_dim": 96, **bad}],
                }
            )
