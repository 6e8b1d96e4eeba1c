"""The default model name page keys are seeded with, and how `hicache layout` shows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.model import LayerMap, load_layout, model_identity
from hicache.model.render import layout_json, layout_table
from tests.conftest import shared_model

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 512}
LLAMA |= {"num_attention_heads": 4}


def write(folder: Path, config: dict[str, object]) -> Path:
    folder.mkdir(parents=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_two_fine_tunes_of_one_base_get_different_names(tmp_path: Path) -> None:
    # transformers 4.x wrote the *base* model into _name_or_path of both fine-tunes
    config = {**LLAMA, "_name_or_path": "meta-llama/Llama-3.1-8B"}
    a, b = write(tmp_path / "ft-a", config), write(tmp_path / "ft-b", config)
    names = {model_identity(p, load_layout(p), config) for p in (a, b)}
    assert names == {str((tmp_path / "ft-a").resolve()), str((tmp_path / "ft-b").resolve())}


def test_folder_path_and_relative_paths_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "ckpt", LLAMA)
    layout = load_layout(path)
    want = str((tmp_path / "ckpt").resolve())
    assert model_identity(tmp_path / "ckpt", layout) == want
    monkeypatch.chdir(tmp_path / "ckpt")
    assert model_identity(Path("config.json"), layout) == want


def test_renamed_configs_in_one_folder_are_told_apart() -> None:
    # gpt-oss-20b and -120b share every group's geometry, so only the name keeps them apart
    small, big = shared_model("gpt-oss-20b.json"), shared_model("gpt-oss-120b.json")
    names = {model_identity(p, load_layout(p)) for p in (small, big)}
    assert names == {str(small.resolve()), str(big.resolve())}


def test_hub_snapshot_folder_names_repo_and_revision(tmp_path: Path) -> None:
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "9c925d64d72725edaf899c"
    path = write(snap, LLAMA)
    name = model_identity(path, load_layout(path))
    assert name == "Qwen/Qwen3-8B@9c925d64d72725edaf899c"


def test_without_a_path_name_or_path_then_model_type() -> None:
    layout = load_layout(shared_model("llama-3.1-8b.json"))
    assert model_identity(None, layout, {"_name_or_path": " org/tuned "}) == "org/tuned"
    assert model_identity(None, layout, {"_name_or_path": ""}) == "llama"
    assert model_identity(None, layout) == "llama"


def test_a_yaml_layer_list_is_not_a_checkpoint(tmp_path: Path) -> None:
    layers = tmp_path / "layers.yaml"
    layers.write_text("model_type: mine\nlayers:\n  - {kind: full, kv_heads: 2, head_dim: 64}\n")
    layout = load_layout(layers)
    assert layout.rule == "explicit layer list"
    assert model_identity(layers, layout) == "mine"


def test_layout_json_and_table_show_the_name_and_rule() -> None:
    layer_map = LayerMap(load_layout(shared_model("gemma3_27b.json")))
    data = layout_json(layer_map, "google/gemma-3-27b-it@abc")
    assert data["model_name"] == "google/gemma-3-27b-it@abc"
    # the wrapper is named gemma3; its decoder's model_type picked the rule
    rule = "family rule 'gemma3' (model_type 'gemma3_text')"
    assert data["rule"] == rule
    assert layout_json(layer_map)["model_name"] is None
    lines = layout_table(layer_map, "google/gemma-3-27b-it@abc").splitlines()
    assert lines[1:3] == ["model_name: google/gemma-3-27b-it@abc", f"rule: {rule}"]
    assert layout_table(layer_map).splitlines()[1] == f"rule: {rule}"
