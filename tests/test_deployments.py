"""Every shipped deployment validates, with the layout its comments promise, and the docker
files reference what exists: compose's build files and mounts, and the config it mounts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hicache.config import load_deployment
from hicache.model import CacheKind
from tests.conftest import CONFIGS, REPO

EXPECTED = {
    # file: (model_type, layers, {group: kind}, storage kind)
    "default.yaml": ("gpt_oss", 24, {"sliding": "sliding", "full": "full"}, "file"),
    "llama-3.1-8b.yaml": ("llama", 32, {"full": "full"}, "file"),
    "gpt-oss-120b.yaml": ("gpt_oss", 36, {"sliding": "sliding", "full": "full"}, "redis"),
    "qwen3-next-80b.yaml": ("qwen3_next", 48, {"linear": "linear", "full": "full"}, "mooncake"),
    "deepseek-v3.2.yaml": ("deepseek_v32", 61, {"sparse": "sparse"}, "file"),
    "compose.yaml": ("gpt_oss", 24, {"sliding": "sliding", "full": "full"}, "redis"),
    "compose-mooncake.yaml": ("gpt_oss", 24, {"sliding": "sliding", "full": "full"}, "mooncake"),
}

TP_SIZES = {"gpt-oss-120b.yaml": 2, "qwen3-next-80b.yaml": 4, "deepseek-v3.2.yaml": 8}


def test_tensor_parallel_deployments_cache_one_ranks_share() -> None:
    env = {"HICACHE_SERVICE__TOKEN": "t"}
    gpt = load_deployment(CONFIGS / "gpt-oss-120b.yaml", env=env).layer_map().layout
    assert {g.name: g.spec.num_kv_heads for g in gpt.groups} == {"sliding": 4, "full": 4}
    assert not any(g.replicated for g in gpt.groups)
    qwen = load_deployment(CONFIGS / "qwen3-next-80b.yaml", env=env).layer_map().layout
    full = next(g for g in qwen.groups if g.name == "full")
    assert full.spec.num_kv_heads == 1  # 2 KV heads over 4 ranks: each held by two
    linear = next(g for g in qwen.groups if g.name == "linear")
    assert dict(linear.spec.state_shapes)["recurrent"] == (8, 128, 128)  # 32 value heads / 4
    deepseek = load_deployment(CONFIGS / "deepseek-v3.2.yaml", env=env).layer_map().layout
    assert [g.replicated for g in deepseek.groups] == [True]  # the latent: once for 8 ranks


def test_every_config_is_covered() -> None:
    assert {p.name for p in CONFIGS.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_deployment_validates_with_its_layout(name: str) -> None:
    model_type, layers, groups, storage = EXPECTED[name]
    # a token is required where a listener is exposed (gpt-oss-120b binds 0.0.0.0)
    loaded = load_deployment(CONFIGS / name, env={"HICACHE_SERVICE__TOKEN": "t"})
    layer_map = loaded.layer_map()
    assert layer_map.model_type == model_type
    assert layer_map.layout.num_layers == layers
    assert {g.name: g.kind.value for g in layer_map.groups} == groups
    assert loaded.deployment.storage.kind == storage
    assert layer_map.layout.tp_size == TP_SIZES.get(name, 1)
    if name == "deepseek-v3.2.yaml":  # DSA layers are sparse, never "full attention"
        assert layer_map.layout.full_attention_layer_ids == ()
        assert not layer_map.is_full_attention_layer(0)
        assert layer_map.groups[0].kind is CacheKind.SPARSE


def test_exposed_deployment_without_token_is_refused() -> None:
    from hicache.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape("http_host=0.0.0.0 binds beyond loopback")):
        load_deployment(CONFIGS / "gpt-oss-120b.yaml", env={})


@pytest.mark.parametrize(
    ("files", "storage"),
    [(["compose.yaml"], "redis"), (["compose.yaml", "compose.mooncake.yaml"], "mooncake")],
)
def test_compose_references_existing_files_and_a_valid_config(
    files: list[str], storage: str
) -> None:
    class Loader(yaml.SafeLoader):  # Compose's `!override` merge tag, as a plain mapping
        pass

    def override(loader: yaml.SafeLoader, node: yaml.Node) -> object:
        if isinstance(node, yaml.SequenceNode):  # the short form: `depends_on: !override [a]`
            return {str(name): {} for name in loader.construct_sequence(node, deep=True)}
        assert isinstance(node, yaml.MappingNode)
        return loader.construct_mapping(node, deep=True)

    Loader.add_constructor("!override", override)
    services: dict[str, dict[str, object]] = {}
    mounts: dict[str, Path] = {}
    environment: dict[str, str] = {}
    for name_of_file in files:
        compose_path = REPO / "docker" / name_of_file
        compose = yaml.load(compose_path.read_text(), Loader=Loader)  # a SafeLoader
        for name, service in compose["services"].items():
            services.setdefault(name, {}).update(service)
            build = service.get("build")
            if build:
                context = (compose_path.parent / build["context"]).resolve()
                assert (context / build["dockerfile"]).exists(), name
            if name != "hicache":
                continue
            environment.update(service.get("environment", {}))
            for volume in service.get("volumes", []):
                if isinstance(volume, str):
                    source, target, *_ = volume.split(":")
                else:
                    source, target = volume["source"], volume["target"]
                if source.startswith("."):  # paths relative to the first file's folder
                    path = (REPO / "docker" / source).resolve()
                    assert path.exists(), f"compose mounts {source}, which does not exist"
                    mounts[target] = path
    assert {"hicache", "redis"} <= set(services)
    for name, service in services.items():
        if not service.get("profiles"):
            assert "healthcheck" in service, f"{name} has no healthcheck"
    assert "/healthz" in (REPO / "docker" / "healthcheck.py").read_text()
    config = mounts["/etc/hicache/deploy.yaml"]
    env = {
        k: str(v).replace("${SIDECAR_TOKEN:?set SIDECAR_TOKEN}", "t")
        for k, v in environment.items()
    }
    loaded = load_deployment(config, env=env)
    assert loaded.deployment.service.http_host == "0.0.0.0"
    assert loaded.deployment.storage.kind == storage
    # the config's model path, resolved inside the container, is a mounted file
    container_model = Path("/etc/hicache") / "models" / "gpt-oss-20b.json"
    assert container_model.parent.as_posix() in mounts
    assert (mounts[container_model.parent.as_posix()] / container_model.name).exists()


def test_dockerfiles_serve_with_a_healthcheck_as_non_root() -> None:
    for dockerfile in sorted((REPO / "docker").glob("Dockerfile*")):
        text = dockerfile.read_text()
        assert "HEALTHCHECK" in text
        assert "docker/healthcheck.py" in text  # GET /healthz on the config's port
        assert '"serve"' in text
        assert "USER hicache" in text
