"""One way in: an embedded cache and a sidecar namespace's cache built from the same YAML run
with the same settings, every one of them, as each reports it (`effective_settings`, read
back from the built objects); every deployment key reaches the cache it configures.

The sidecar's cache is built as `hicache serve` builds it, by `Namespace.start` on the
sidecar's copy backend and L3 store with an engine's device pools; the embedded one by
`hicache.assembly.embedded_cache`. Keys are checked one at a time against a small base
deployment (each change must show in the settings it maps to, alike on both sides), and
together (every key changed at once), and on `configs/default.yaml` as shipped. A new schema
key fails `test_every_schema_key_is_checked` until it is mapped here or said not to be a
cache setting.
"""

from __future__ import annotations

import ast
import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache import assembly
from hicache.assembly.sidecar import sidecar_plan
from hicache.config import load_deployment
from hicache.config.schema import Deployment, ServiceSection
from hicache.memory import DevicePool
from hicache.service.namespaces import Namespace, NamespaceKey
from tests.conftest import CONFIGS, MODEL_CONFIGS, REPO

BASE: dict[str, Any] = {
    "model": {
        "model_type": "tiny-hybrid",
        "layers": [
            {"kind": "full", "kv_heads": 2, "head_dim": 8},
            {"kind": "sliding", "kv_heads": 2, "head_dim": 8, "window_tokens": 8},
            {"kind": "mamba", "state_shapes": {"conv": [16, 3], "ssm": [2, 8, 4]}},
            {"kind": "full", "kv_heads": 2, "head_dim": 8},
            {"kind": "sparse", "kv_format": "mla", "head_dim": 16, "index_head_dim": 128},
        ],
        "page_size_tokens": 4,
    },
    "device": {"pool_capacity_bytes": "1MiB"},
    "host": {"capacity_bytes": "2MiB"},
    "storage": {"kind": "file", "path": "l3", "capacity_bytes": "16MiB"},
    "service": {"socket_path": "engine.sock", "http_port": None},
}

# each key's changed value (another allowed one) and the setting it must change
CHANGES: dict[str, tuple[Any, str]] = {
    "model.name": ("other-weights", "cache.key_roots"),
    "model.model_type": ("tiny-other", "cache.key_roots"),
    "model.dtype": ("float16", "model.groups"),
    "model.state_dtype": ("float32", "model.groups"),
    "model.ssm_state_dtype": ("float32", "model.groups"),
    "model.index_format": ("fp8_scaled", "model.groups"),
    "model.page_size_tokens": (8, "model.page_size_tokens"),
    "model.start_layer": (1, "model.groups"),
    "model.end_layer": (3, "model.groups"),
    "host.capacity_bytes": ("3MiB", "host.pages"),
    "host.state_fraction": (0.5, "host.pages"),
    "host.layout": ("page_first", "host.layout"),
    "host.prefault": (False, "host.prefault"),
    "storage.path": ("l3-other", "storage.root"),
    "storage.key_prefix": ("tenant-a", "storage.root"),
    "storage.capacity_bytes": ("32MiB", "storage.capacity_bytes"),
    "storage.base_timeout_s": (2.5, "storage.base_timeout_s"),
    "storage.min_bandwidth_bytes_per_s": (1e6, "storage.min_bandwidth_bytes_per_s"),
    "storage.breaker_failure_threshold": (7, "storage.breaker_failure_threshold"),
    "storage.breaker_reset_after_s": (9.0, "storage.breaker_reset_after_s"),
    "storage.chunk_bytes": ("1MiB", "storage.chunk_bytes"),
    "scheduler.queue_depth": (5, "scheduler.queue_depth"),
    "scheduler.inflight_bytes": ("8MiB", "scheduler.inflight_bytes"),
    "scheduler.op_timeout_s": (4.0, "scheduler.op_timeout_s"),
    "scheduler.move_policy": ("full_attention_only", "scheduler.move_policy"),
    "scheduler.counter_ring_size": (5, "scheduler.counter_ring_size"),
    "cache.write_policy": ("write_back", "cache.write_policy"),
    "cache.prefetch_policy": ("wait_complete", "cache.prefetch_policy"),
    "cache.prefetch_timeout_s": (0.25, "cache.prefetch_timeout_s"),
    "cache.prefetch_timeout_per_token_s": (1e-5, "cache.prefetch_timeout_per_token_s"),
    "cache.prefetch_auto_headroom": (3.0, "cache.prefetch_auto_headroom"),
    "cache.prefetch_auto_floor_s": (0.02, "cache.prefetch_auto_floor_s"),
    "cache.prefetch_timeout_max_s": (2.0, "cache.prefetch_timeout_max_s"),
    "cache.eviction": ("s3fifo", "cache.eviction"),
    "cache.key_algorithm": ("blake2b", "cache.key_algorithm"),
    "cache.tenant_salt": ("pepper", "cache.key_roots"),
    "cache.l3_absent_ttl_s": (0.5, "cache.l3_absent_ttl_s"),
    "cache.persist_queue_pages": (100, "cache.persist_queue_pages"),
    "cache.l3_index_max_pages": (1000, "cache.l3_index_max_pages"),
}

# keys of the cache's sections that are not compared, and why
NOT_COMPARED = {
    "model.config_path": "the other source of a layout (test_a_config_json_layout_is_alike)",
    "model.layers": "the base's layout; every group is compared (model.groups)",
    "model.tp_size": "explicit state layers have no TP split (test_a_config_json_layout_is_alike)",
    "device.kind": "cuda needs a GPU; the kind is compared (device.kind)",
    "device.index": "which CUDA device: cuda only",
    "device.pool_capacity_bytes": "the embedded stack's own L1; a namespace serves the engine's",
    "host.pin_chunk_bytes": "cudaHostRegister's chunk: cuda only",
    "host.pin_memory": "read by no code: L2 is pinned when the backend is CUDA's (host.pinned)",
    "storage.kind": "the backend is compared (storage.backend); other kinds need servers",
}


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    data.setdefault(section, {})[key] = value


def _write(tmp_path: Path, data: dict[str, Any], name: str = "deploy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


async def _sidecar_settings(path: Path) -> dict[str, object]:
    """The settings of the cache `hicache serve` builds for (rank 0, tenant ""): its copy
    backend and store, a namespace started on an engine's device pools."""
    loaded = load_deployment(path, env={})
    plan = sidecar_plan(loaded)
    backend = assembly.copy_backend(loaded.deployment)
    store = assembly.open_store(loaded)
    pools = {
        name: DevicePool.allocate(geometry, 4, backend.device)
        for name, geometry in plan.geometries.items()
    }
    try:
        async with asyncio.TaskGroup() as tg:
            namespace = await Namespace.start(
                NamespaceKey(0, ""),
                plan,
                backend,
                store,
                pools,
                tg,
            )
            settings = namespace.cache.effective_settings()
            await namespace.close()
    finally:
        if store is not None:
            await store.backend.close()
        backend.close()
    return settings


async def _embedded_settings(path: Path) -> dict[str, object]:
    cache = assembly.embedded_cache(load_deployment(path, env={}), tp_rank=0)
    try:
        return cache.effective_settings()
    finally:
        if cache.l3 is not None:
            await cache.l3.backend.close()
        cache.embedded.close()


def both(path: Path) -> tuple[dict[str, object], dict[str, object]]:
    async def main() -> tuple[dict[str, object], dict[str, object]]:
        return await _embedded_settings(path), await _sidecar_settings(path)

    return asyncio.run(main())


def assert_alike(embedded: dict[str, object], sidecar: dict[str, object]) -> None:
    assert embedded.keys() == sidecar.keys()
    differ = {k: (embedded[k], sidecar[k]) for k in embedded if embedded[k] != sidecar[k]}
    assert differ == {}, f"embedded vs sidecar (embedded, sidecar): {differ}"


def test_every_schema_key_is_checked() -> None:
    """Every key of the sections that configure a cache is changed by a test here, or said
    not to be compared (a new key fails until it is one or the other)."""
    sections = ("model", "device", "host", "storage", "scheduler", "cache")
    storage = Deployment.model_fields["storage"].annotation
    keys = set()
    for name in sections:
        if name == "storage":
            models = [m for m in storage.__args__ if m.__name__ == "FileStorage"]  # type: ignore[union-attr]
        else:
            models = [Deployment.model_fields[name].annotation]
        for model in models:
            keys |= {f"{name}.{field}" for field in model.model_fields}  # type: ignore[union-attr]
    assert keys - set(CHANGES) - set(NOT_COMPARED) == set()
    assert set(CHANGES) & set(NOT_COMPARED) == set()
    assert set(CHANGES) | set(NOT_COMPARED) <= keys


def test_the_shipped_default_deployment_is_alike(tmp_path: Path) -> None:
    """configs/default.yaml as shipped (its state moved into tmp_path): the embedded cache
    runs the schema's prefetch policy (`timeout`), as the sidecar does."""
    data = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    data["model"]["config_path"] = str(CONFIGS / data["model"]["config_path"])
    data["storage"]["path"] = "l3"
    data["host"]["capacity_bytes"] = "16MiB"  # the file's 256MiB, twice, is slow to prefault
    embedded, sidecar = both(_write(tmp_path, data))
    assert_alike(embedded, sidecar)
    assert embedded["cache.prefetch_policy"] == "timeout"


def test_a_config_json_layout_is_alike(tmp_path: Path) -> None:
    """A checkpoint's config.json, whole and as one rank's share at model.tp_size 2."""
    data = copy.deepcopy(BASE)
    data["model"] = {"config_path": str(MODEL_CONFIGS / "gpt-oss-20b.json")}
    data["host"]["capacity_bytes"] = "8MiB"
    whole, sidecar = both(_write(tmp_path, data, "tp1.yaml"))
    assert_alike(whole, sidecar)
    data["model"]["tp_size"] = 2
    rank0, sidecar = both(_write(tmp_path, data, "tp2.yaml"))
    assert_alike(rank0, sidecar)
    for setting in ("model.tp_size", "model.groups", "cache.key_roots", "host.pages"):
        assert rank0[setting] != whole[setting], setting


def test_every_key_changed_at_once_is_alike(workdir: Path, base: dict[str, object]) -> None:
    data = copy.deepcopy(BASE)
    for key, (value, _setting) in CHANGES.items():
        _set(data, key, value)
    embedded, sidecar = both(_write(workdir, data, "all.yaml"))
    assert_alike(embedded, sidecar)
    same = sorted({s for _, s in CHANGES.values() if embedded.get(s) == base.get(s)})
    assert same == []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("assembly")


@pytest.fixture(scope="module")
def base(workdir: Path) -> dict[str, object]:
    embedded, sidecar = both(_write(workdir, BASE, "base.yaml"))
    assert_alike(embedded, sidecar)
    return embedded


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_each_key_reaches_both_caches(workdir: Path, base: dict[str, object], key: str) -> None:
    """Changing `key` alone changes the setting it maps to, alike in both caches."""
    value, setting = CHANGES[key]
    data = copy.deepcopy(BASE)
    _set(data, key, value)
    embedded, sidecar = both(_write(workdir, data, f"{key}.yaml"))
    assert_alike(embedded, sidecar)
    assert embedded[setting] != base[setting], f"{key}: {value!r} left {setting} unchanged"


def test_the_service_settings_are_the_service_section() -> None:
    """Every `service` key reaches the sidecar's settings, by the same name."""
    section = ServiceSection(tcp_port=7000, max_sessions=3, drain_timeout_s=2.5)
    settings = assembly.service_settings(section)
    assert set(settings.__dataclass_fields__) == set(ServiceSection.model_fields)
    for name in ServiceSection.model_fields:
        assert getattr(settings, name) == getattr(section, name), name


def test_the_embedded_cache_serves_from_l3_across_processes_as_the_sidecar_would(
    tmp_path: Path,
) -> None:
    """`embedded_cache` is a whole cache: a store reaches the deployment's L3; a second
    cache from the same file (another process, L2 empty) loads the prompt from there,
    waiting for L3 as the schema's `timeout` policy says."""
    data = copy.deepcopy(BASE)
    data["model"]["layers"] = [{"kind": "full", "kv_heads": 2, "head_dim": 8}] * 2
    path = _write(tmp_path, data)
    tokens = list(range(16))  # 4 pages

    async def main() -> tuple[int, int]:
        first = assembly.embedded_cache(load_deployment(path, env={}))
        second = assembly.embedded_cache(load_deployment(path, env={}))
        try:
            pool = first.embedded.device_pools["full"]
            rows = [pool.rows(i, t) for i in range(2) for t, _ in pool.geometry.tensors]
            for page in range(4):
                for row in rows:
                    row[page].fill_(page + 1)
            async with first.running():
                await first.store(tokens, {"full": [0, 1, 2, 3]})
                await first.flush()
            async with second.running():
                await second.discover(tokens)  # asks L3, as a load does
                probe = second.lookup(tokens)
                handle, _ = await second.load(tokens, {"full": [4, 5, 6, 7]})
                assert handle is not None
                assert (await handle.done()).ok
            got = second.embedded.device_pools["full"]
            rows = [got.rows(i, t) for i in range(2) for t, _ in got.geometry.tensors]
            same = sum(all(bool((r[4 + p] == p + 1).all()) for r in rows) for p in range(4))
            return probe.pages_total - probe.pages_l2, same
        finally:
            for cache in (first, second):
                if cache.l3 is not None:
                    await cache.l3.backend.close()
                cache.embedded.close()

    from_l3, same = asyncio.run(main())
    assert (from_l3, same) == (4, 4)


SECTIONS = {
    "Deployment",
    "Section",
    "ModelSection",
    "DeviceSection",
    "HostSection",
    "L3Guard",
    "FileStorage",
    "RedisStorage",
    "MooncakeStorage",
    "NoStorage",
    "StorageSection",
    "SchedulerSection",
    "CacheSection",
    "ServiceSection",
}
MAY_READ = ("assembly", "cli", "config")  # hicache/<these>/ read deployment sections


def section_reads(source: str) -> list[str]:
    """Where a module reads a deployment's sections: imports a section type, reads through
    `.deployment` (`loaded.deployment.model`), or through a name bound to it (`d =
    loaded.deployment; d.model`). Passing `loaded.deployment` on is not a read."""
    tree = ast.parse(source)
    bound = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "deployment"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hicache.config"):
            found += [f"imports {a.name}" for a in node.names if a.name in SECTIONS]
        if not isinstance(node, ast.Attribute):
            continue
        inner = node.value
        if isinstance(inner, ast.Attribute) and inner.attr == "deployment":
            found.append(f"line {node.lineno}: reads .deployment.{node.attr}")
        if isinstance(inner, ast.Name) and inner.id in bound:
            found.append(f"line {node.lineno}: reads {inner.id}.{node.attr}")
    return found


def test_no_module_below_the_cli_reads_deployment_sections() -> None:
    """The rule of #26: below the CLI only hicache/assembly/ (and config/ itself) reads a
    `Deployment`'s sections; every other module takes plain settings."""
    package = REPO / "hicache"
    readers = {}
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in MAY_READ:
            continue
        reads = section_reads(path.read_text())
        if reads:
            readers[str(path.relative_to(REPO))] = reads
    assert readers == {}


def test_the_rule_sees_each_way_of_reading_a_section() -> None:
    """The check above finds what it looks for (a check that cannot fail is a bug)."""
    assert section_reads("from hicache.config.schema import CacheSection\n") == [
        "imports CacheSection"
    ]
    assert section_reads("from hicache.config import Deployment\n") == ["imports Deployment"]
    assert section_reads("x = loaded.deployment.cache.eviction\n") == [
        "line 1: reads .deployment.cache"
    ]
    assert section_reads("d = loaded.deployment\ny = d.host\n") == ["line 2: reads d.host"]
    assert section_reads("f(loaded.deployment)\nfrom hicache.config import LoadedConfig\n") == []
