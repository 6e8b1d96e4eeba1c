"""SGLang's real `HybridCacheController` with a DSA model's pools (`dsa_driver`) and hicache's
storage backend, driven from the main environment: a sidecar deployment of a tiny
DeepSeek-V3.2 and `DsaControllers`, one SGLang process holding any number of controllers.

The model is DeepSeek-V3.2-Exp's real config.json (`configs/models/deepseek-v3.2-exp.json`)
scaled down: the same fields and family rule, 2 layers, a latent of 64 + 32, SGLang's fixed
128-dim indexer key; the sidecar reads that config as any deployment would, with
`model.index_format: fp8_scaled` (SGLang's 132 bytes a token) and SGLang's 64-token pages.

    deploy = write_dsa_deployment(tmp)
    with SidecarProcess(deploy), DsaControllers(tmp, "a") as a:
        a.start("c1", "layer_first", "default", {"config": str(deploy)})
        a.fill("c1", seed=1, pages=4)     # device -> host -> hicache, latents and index keys
        a.fetch("c1", seed=1, pages=4)    # hicache -> host -> device, compared
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hicache.testing.local_servers import free_port
from tests.conftest import CONFIGS
from tests.integrations.sglang.controller_harness import write_deployment
from tests.integrations.sglang.dsa_driver import INDEX_DIM, RANK, ROPE, L, P
from tests.integrations.sglang.engine_harness import DriverProcess

TINY = {  # DeepSeek-V3.2's own fields, scaled down to the driver's pools
    "num_hidden_layers": L,
    "kv_lora_rank": RANK,
    "qk_rope_head_dim": ROPE,
    "index_head_dim": INDEX_DIM,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 50000,
}


def write_dsa_deployment(directory: Path, index_format: str = "fp8_scaled") -> Path:
    """A sidecar for the tiny DeepSeek-V3.2 (L2 of 64 MiB, a file L3 beside it)."""
    config = json.loads((CONFIGS / "models" / "deepseek-v3.2-exp.json").read_text()) | TINY
    return write_deployment(
        directory,
        config=config,
        page_size=P,
        model_lines=(f"  index_format: {index_format}",),
    )


class DsaControllers(DriverProcess):
    """One SGLang process of DSA controllers (see `dsa_driver`'s commands)."""

    def __init__(self, work: Path, name: str):
        super().__init__(
            "tests.integrations.sglang.dsa_driver",
            [],
            work,
            name,
            env={"MASTER_PORT": str(free_port())},
        )

    def start(
        self, name: str, layout: str, allocator: str, extra: dict[str, Any]
    ) -> dict[str, Any]:
        return self.request(
            {"op": "start", "name": name, "layout": layout, "allocator": allocator, "extra": extra}
        )

    def fill(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        return self.request({"op": "fill", "name": name, "seed": seed, "pages": pages})

    def fetch(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        return self.request({"op": "fetch", "name": name, "seed": seed, "pages": pages})

    def stop(self, name: str) -> dict[str, Any]:
        return self.request({"op": "stop", "name": name})
