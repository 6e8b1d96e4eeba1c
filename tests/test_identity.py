"""Page keys carry the weights' identity, not only the architecture: two fine-tunes of one
architecture sharing an L3 never read each other's KV. And every L3 backend takes a key
prefix, so deployments sharing one store can be kept apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hicache.assembly import storage_backend as make_backend
from hicache.cache import TieredCache
from hicache.config import load_deployment
from hicache.errors import ConfigError
from tests.conftest import shared_model
from tests.test_tiered import build

PAGE = 4


def test_two_fine_tunes_of_one_architecture_never_share_keys(tmp_path: Path) -> None:
    a, _ = build(tmp_path / "a", "qwen2_7b.json", host_pages=4, model="org/qwen2-7b-chat")
    b, _ = build(tmp_path / "b", "qwen2_7b.json", host_pages=4, model="org/qwen2-7b-math")
    same, _ = build(tmp_path / "c", "qwen2_7b.json", host_pages=4, model="org/qwen2-7b-chat")
    try:
        tokens = list(range(3 * PAGE))
        assert a.index.keys(tokens) != b.index.keys(tokens)
        assert a.index.keys(tokens) == same.index.keys(tokens)
    finally:
        for cache in (a, b, same):
            cache.embedded.close()


def _deploy(tmp_path: Path, model: dict[str, object], storage: dict[str, object]) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"model": model, "storage": storage}))
    return path


def test_model_name_defaults_to_the_checkpoint_and_can_be_set(tmp_path: Path) -> None:
    config = tmp_path / "my-finetune" / "config.json"
    config.parent.mkdir()
    config.write_text(shared_model("qwen2_7b.json").read_text())
    loaded = load_deployment(_deploy(tmp_path, {"config_path": str(config)}, {"kind": "none"}))
    default = loaded.model_name()
    assert default  # derived from the checkpoint, never empty
    # the same config.json in another checkpoint's folder: other weights, another name
    other = tmp_path / "other-finetune" / "config.json"
    other.parent.mkdir()
    other.write_text(config.read_text())
    elsewhere = load_deployment(_deploy(tmp_path, {"config_path": str(other)}, {"kind": "none"}))
    assert elsewhere.model_name() != default
    named = load_deployment(
        _deploy(tmp_path, {"config_path": str(config), "name": "acme/qwen2-ft"}, {"kind": "none"})
    )
    assert named.model_name() == "acme/qwen2-ft"


def test_file_l3_key_prefix_is_a_folder_of_its_own(tmp_path: Path) -> None:
    model = {"config_path": str(shared_model("qwen2_7b.json"))}
    loaded = load_deployment(
        _deploy(tmp_path, model, {"kind": "file", "path": str(tmp_path / "l3"), "key_prefix": "a"})
    )
    backend = make_backend(loaded.deployment.storage)
    assert backend is not None
    assert getattr(backend, "root") == tmp_path / "l3" / "a"  # noqa: B009
    with pytest.raises(
        ConfigError,
        match=r"deploy\.yaml: storage\.key_prefix: '\.\.' is not a folder name; allowed: letters, digits, \. _ - \(got '\.\.'\)$",
    ):
        load_deployment(
            _deploy(tmp_path, model, {"kind": "file", "path": str(tmp_path), "key_prefix": ".."})
        )


def test_mooncake_section_takes_a_key_prefix(tmp_path: Path) -> None:
    model = {"config_path": str(shared_model("qwen2_7b.json"))}
    loaded = load_deployment(_deploy(tmp_path, model, {"kind": "mooncake", "key_prefix": "t1:"}))
    assert getattr(loaded.deployment.storage, "key_prefix") == "t1:"  # noqa: B009


def test_tiered_build_without_a_name_keys_by_architecture_alone(tmp_path: Path) -> None:
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=4)
    try:
        assert isinstance(cache, TieredCache)
        keyer = next(iter(cache.index.keyers.values()))
        assert keyer.namespace.model_type == "qwen2"
    finally:
        cache.embedded.close()
