"""SGLang's real HiCache controller with hicache's storage backend, driven from the main
environment: a sidecar deployment for the controller's model and `Controllers`, one SGLang
process (`controller_driver.py`) holding any number of controllers.

    deploy = write_deployment(tmp)                     # model, page size, file L3, socket
    with SidecarProcess(deploy), Controllers(tmp, "a") as a:
        a.start("c1", "layer_first", {"config": str(deploy)})
        a.fill("c1", seed=1, pages=8)                  # device -> host -> hicache
        a.fetch("c1", seed=1, pages=8)                 # hicache -> host -> device, compared
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hicache.testing.local_servers import free_port
from tests.integrations.sglang.engine_harness import DriverProcess

# the controller driver's pools: 4 layers, 2 KV heads of 64, 16-token pages, bfloat16
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 50000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
# the driver's MLA pools (`model="mla"`): DeepSeek-V3's family, 4 layers, a latent of
# kv_lora_rank 64 + qk_rope_head_dim 32 (hicache derives it from these fields, as for V3)
MLA_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "q_lora_rank": None,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "vocab_size": 50000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
PAGE = 16


def write_deployment(
    directory: Path,
    *,
    extra_lines: tuple[str, ...] = (),
    config: dict[str, Any] = CONFIG,
    tp_size: int = 1,
    page_size: int = PAGE,
    model_lines: tuple[str, ...] = (),
) -> Path:
    """A sidecar for the controller's model (`config`: MLA_CONFIG for `model="mla"`; more
    `model:` keys in `model_lines`): L2 of 64 MiB, a file L3 beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    lines = [
        "model:",
        f"  config_path: {directory / 'config.json'}",
        "  dtype: bfloat16",
        f"  page_size_tokens: {page_size}",
        f"  tp_size: {tp_size}",
        *model_lines,
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
        *extra_lines,
    ]
    path = directory / "deploy.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Controllers(DriverProcess):
    """One SGLang process of controllers (see `controller_driver`'s commands)."""

    def __init__(self, work: Path, name: str, *, tp: tuple[int, int] = (0, 1)):
        """`tp`: the (rank, size) of tensor parallelism the process plays."""
        super().__init__(
            "tests.integrations.sglang.controller_driver",
            [],
            work,
            name,
            env={"MASTER_PORT": str(free_port()), "SGLANG_DRIVER_TP_RANK_SIZE": f"{tp[0]}/{tp[1]}"},
        )

    def start(
        self, name: str, layout: str, extra: dict[str, Any], model: str = "mha"
    ) -> dict[str, Any]:
        return self.request(
            {"op": "start", "name": name, "layout": layout, "extra": extra, "model": model}
        )

    def fill(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        return self.request({"op": "fill", "name": name, "seed": seed, "pages": pages})

    def fetch(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        return self.request({"op": "fetch", "name": name, "seed": seed, "pages": pages})

    def stats(self, name: str) -> dict[str, Any]:
        return self.request({"op": "stats", "name": name})

    def stop(self, name: str) -> dict[str, Any]:
        return self.request({"op": "stop", "name": name})
