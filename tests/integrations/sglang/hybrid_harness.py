"""SGLang's real `HybridCacheController` (KV host pool + Mamba side pool) with hicache's storage
backend, driven from the main environment: a sidecar deployment of a tiny Qwen3-Next and
`HybridControllers`, one SGLang process (`hybrid_driver.py`) holding any number of controllers.

The model is Qwen3-Next's real config.json (`configs/models/qwen3_next_80b.json`) scaled down:
the same fields and family rule, 4 layers (every 2nd full attention), small heads, so one
Mamba state is ~34 KiB. The sidecar reads that config as any deployment would; the driver's
pools have the geometry SGLang would build for it (`hybrid_driver`: 2 full-attention layers of
2 KV heads x 64, 2 gated-delta-net layers of conv (256, 3) bf16 and recurrent (4, 32, 32) fp32).

    deploy = write_hybrid_deployment(tmp)
    with SidecarProcess(deploy), HybridControllers(tmp, "a") as a:
        a.start("c1", "default", {"config": str(deploy)})
        a.fill("c1", seed=1, pages=8, state=True)    # device -> host -> hicache, both pools
        a.fetch("c1", seed=1, pages=8)               # hicache -> host -> device, compared
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hicache.testing.local_servers import free_port
from tests.conftest import shared_model
from tests.integrations.sglang.engine_harness import DriverProcess

PAGE = 16
TINY = {  # Qwen3-Next's own fields, scaled down (see the module doc)
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "vocab_size": 50000,
    "max_position_embeddings": 4096,
}


def tiny_qwen3_next(directory: Path) -> Path:
    """The scaled-down Qwen3-Next config.json in `directory`."""
    config = json.loads(shared_model("qwen3_next_80b.json").read_text()) | TINY
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


TINY_GPT_OSS = {  # gpt-oss's own fields, scaled down: sliding (64 tokens) and full, alternating
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 64,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 4,
    "vocab_size": 50000,
    "max_position_embeddings": 4096,
}


def tiny_gpt_oss(directory: Path) -> Path:
    """gpt-oss's real config.json scaled down (a hybrid-SWA model: full + sliding groups)."""
    config = json.loads(shared_model("gpt_oss_20b.json").read_text()) | TINY_GPT_OSS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


def write_hybrid_deployment(directory: Path, model: str = "qwen3_next") -> Path:
    """A sidecar for the tiny Qwen3-Next (SGLang's state dtypes: conv bf16, SSM fp32), or
    (`model="gpt_oss"`) the tiny gpt-oss."""
    config = tiny_gpt_oss(directory) if model == "gpt_oss" else tiny_qwen3_next(directory)
    lines = [
        "model:",
        f"  config_path: {config}",
        "  dtype: bfloat16",
        "  ssm_state_dtype: float32",
        f"  page_size_tokens: {PAGE}",
        "device:",
        "  kind: cpu",
        "  pool_capacity_bytes: 16MiB",
        "host:",
        "  capacity_bytes: 64MiB",
        "storage:",
        "  kind: file",
        "  path: l3",
        "  capacity_bytes: 256MiB",
        "service:",
        "  socket_path: engine.sock",
        "  http_host: 127.0.0.1",
        "  http_port: 0",
        "  heartbeat_timeout_s: 10",
    ]
    path = directory / "deploy.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


class HybridControllers(DriverProcess):
    """One SGLang process of hybrid controllers (see `hybrid_driver`'s commands)."""

    def __init__(self, work: Path, name: str):
        super().__init__(
            "tests.integrations.sglang.window_driver",  # hybrid_driver's commands and SWA's
            [],
            work,
            name,
            env={"MASTER_PORT": str(free_port())},
        )

    def start(
        self, name: str, allocator: str, extra: dict[str, Any], variant: str = "mamba"
    ) -> dict[str, Any]:
        return self.request(
            {
                "op": "start",
                "name": name,
                "allocator": allocator,
                "extra": extra,
                "variant": variant,
            }
        )

    def fill(self, name: str, seed: int, pages: int, state: bool = True) -> dict[str, Any]:
        return self.request(
            {"op": "fill", "name": name, "seed": seed, "pages": pages, "state": state}
        )

    def fetch(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        return self.request({"op": "fetch", "name": name, "seed": seed, "pages": pages})

    def three_threads(self, name: str, seed: int, pages: int, rounds: int) -> dict[str, Any]:
        return self.request(
            {"op": "three_threads", "name": name, "seed": seed, "pages": pages, "rounds": rounds}
        )

    def attach_order(self, name: str) -> dict[str, Any]:
        return self.request({"op": "attach_order", "name": name})

    def stop(self, name: str) -> dict[str, Any]:
        return self.request({"op": "stop", "name": name})

    def start_window(self, name: str, extra: dict[str, Any]) -> dict[str, Any]:
        return self.request({"op": "start_window", "name": name, "extra": extra})

    def fill_window(self, name: str, seed: int, pages: int, window_pages: int) -> dict[str, Any]:
        return self.request(
            {
                "op": "fill_window",
                "name": name,
                "seed": seed,
                "pages": pages,
                "window_pages": window_pages,
            }
        )

    def fetch_window(
        self, name: str, seed: int, pages: int, window: int | None = None
    ) -> dict[str, Any]:
        extra = {} if window is None else {"window": window}
        return self.request(
            {"op": "fetch_window", "name": name, "seed": seed, "pages": pages, **extra}
        )

    def get_window(self, name: str, seed: int, pages: int, window: int) -> dict[str, Any]:
        return self.request(
            {"op": "get_window", "name": name, "seed": seed, "pages": pages, "window": window}
        )

    def malformed(self, name: str) -> dict[str, Any]:
        return self.request({"op": "malformed", "name": name})
