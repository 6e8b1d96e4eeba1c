"""What the session-epoch tests share: a deployment of a tiny attention-only model (4 layers,
one 16-wide KV head: 1 KiB per layer and page, so a test moves hundreds of pages in
milliseconds and its copy delays are all its time), served by the real `serve()` on the fake
copy backend with copy delays, and bytes derived from a prompt's token ids."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from hicache.client.process import SidecarProcess
from hicache.memory import DevicePool
from hicache.testing import serve as fault_serve

PAGE = 16
LAYERS = 4  # each copied layer waits the test's delay: a walk takes LAYERS of them


def tiny_llama(tmp_path: Path) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "num_hidden_layers": LAYERS,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "vocab_size": 1024,
    }
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(config))
    return path


def deployment(tmp_path: Path, **service: Any) -> Path:
    data = {
        "model": {"config_path": str(tiny_llama(tmp_path)), "page_size_tokens": PAGE},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "4MiB"},
        "storage": {"kind": "none"},
        "service": {"socket_path": str(tmp_path / "e.sock"), "http_port": 0, **service},
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def slowed_sidecar(config: Path, **delays: float) -> SidecarProcess:
    """The real `serve()` whose copies wait `delays` (`backup_layer_delay_s`,
    `load_layer_delay_s`) before each layer; `with` starts and stops it."""
    return SidecarProcess(config, command=fault_serve.command(delays))


def prompt_bytes(tokens: list[int], page: int, layer: object, nbytes: int) -> torch.Tensor:
    """Page `page` of layer `layer` of the prompt `tokens`, as `nbytes` bytes: a function of
    the page's tokens (and every token before them), the layer and nothing else."""
    seed = hashlib.blake2b(
        repr((tokens[: (page + 1) * PAGE], layer)).encode(), digest_size=8
    ).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(seed, "little") >> 1)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def fill(pools: Mapping[str, DevicePool], tokens: list[int], pages: Sequence[int]) -> None:
    """Write the prompt's bytes into `pages` (its pages 0.. in order) of every layer."""
    for pool in pools.values():
        for layer in range(pool.geometry.num_layers):
            for tensor, _ in pool.geometry.tensors:
                rows = pool.rows(layer, tensor)
                for i, page in enumerate(pages):
                    rows[page].copy_(prompt_bytes(tokens, i, (layer, tensor), rows.shape[1]))


def wrong_pages(pools: Mapping[str, DevicePool], tokens: list[int], pages: Sequence[int]) -> int:
    """How many (page, layer, tensor) rows of `pages` do not hold the prompt's bytes."""
    wrong = 0
    for pool in pools.values():
        for layer in range(pool.geometry.num_layers):
            for tensor, _ in pool.geometry.tensors:
                rows = pool.rows(layer, tensor)
                for i, page in enumerate(pages):
                    want = prompt_bytes(tokens, i, (layer, tensor), rows.shape[1])
                    wrong += not rows[page].equal(want)
    return wrong
