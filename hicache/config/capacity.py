"""Capacity warnings: a tier that cannot hold one long prompt validates and serves, but caches
little; `hicache config validate` and `hicache serve` warn about it, one line per tier.

One long prompt is `min(max_position_embeddings, 32768)` tokens: the model's context when its
config.json gives `max_position_embeddings` (in the decoder's part of a multimodal wrapper)
and it is shorter than 32k, else 32768 tokens (`LONG_PROMPT_TOKENS`). It needs, per token
group, that many tokens in pages; a state group (linear / Mamba / conv) one snapshot. The
tiers checked: L2 (`host.capacity_bytes`, token groups' share of it), and a file L3
(`storage.capacity_bytes`). An L2 that cannot hold one page of a group stays an error
(`hicache.memory.host_tier.budget_pages`). The caller computes the page sizes (this package
sits below `hicache.memory`) and passes them in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path

from hicache.config.loader import LoadedConfig
from hicache.config.sizes import format_bytes
from hicache.model.hf_config import decoder_config, read_config_json

LONG_PROMPT_TOKENS = 32_768
TOO_SMALL = "too small for one long prompt"  # in every warning line

log = logging.getLogger("hicache.config")


def max_position_embeddings(config_path: Path | None) -> int | None:
    """The model's `max_position_embeddings` from its config.json, or None when not known."""
    if config_path is None:
        return None
    path = config_path / "config.json" if config_path.is_dir() else config_path
    if path.suffix != ".json":
        return None
    try:
        value = decoder_config(read_config_json(path)).get("max_position_embeddings")
    except Exception:
        return None  # the layout reports an unreadable config.json
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def long_prompt(loaded: LoadedConfig) -> tuple[int, str]:
    """Tokens of one long prompt, and how that number was chosen."""
    context = max_position_embeddings(loaded.deployment.model.config_path)
    if context is None:
        return LONG_PROMPT_TOKENS, f"{LONG_PROMPT_TOKENS} tokens, max_position_embeddings unknown"
    if context <= LONG_PROMPT_TOKENS:
        return context, f"{context} tokens, the model's max_position_embeddings"
    return LONG_PROMPT_TOKENS, f"{LONG_PROMPT_TOKENS} tokens of max_position_embeddings {context}"


def capacity_warnings(
    loaded: LoadedConfig,
    token_page_bytes: Mapping[str, int],
    state_page_bytes: Mapping[str, int],
    host_pages: Mapping[str, int],
) -> list[str]:
    """One line per tier too small for one long prompt, naming where the setting came from,
    the tier's capacity, what it holds, what one prompt needs and the setting to raise.
    `*_page_bytes`: one page (snapshot) of each group; `host_pages`: L2 pages per group."""
    if not token_page_bytes:
        return []  # state groups only: one snapshot per prompt, which start-up checks
    d = loaded.deployment
    page = d.model.page_size_tokens
    tokens, why = long_prompt(loaded)
    need_pages = -(-tokens // page)
    token_bytes = sum(token_page_bytes.values())
    lines = []
    held = min(host_pages.get(name, 0) for name in token_page_bytes)
    if held < need_pages:
        share = 1.0 - d.host.state_fraction if state_page_bytes else 1.0
        need = math.ceil(need_pages * token_bytes / share)
        lines.append(
            _line(loaded, "host.capacity_bytes", d.host.capacity_bytes, held, need_pages, why, need)
        )
    storage = d.storage
    if storage.kind == "file":
        need = need_pages * token_bytes + sum(state_page_bytes.values())
        if storage.capacity_bytes < need:
            held = storage.capacity_bytes // token_bytes
            key, capacity = "storage.capacity_bytes", storage.capacity_bytes
            lines.append(_line(loaded, key, capacity, held, need_pages, why, need))
    return lines


def _line(
    loaded: LoadedConfig, key: str, capacity: int, held: int, need_pages: int, why: str, need: int
) -> str:
    tier = "L2" if key.startswith("host.") else "L3 (file)"
    unit = 1 << 20 if need >= 1 << 20 else 1 << 10
    need = -(-need // unit) * unit  # rounded up, so the size shown is enough
    return (
        f"{tier} {TOO_SMALL}: {loaded.source_of(key)}: {key} {format_bytes(capacity)} holds "
        f"{held} pages, one long prompt needs {need_pages} ({why}); set {key} to at least "
        f"{format_bytes(need)} to cache one"
    )


def warn_capacity(
    loaded: LoadedConfig,
    token_page_bytes: Mapping[str, int],
    state_page_bytes: Mapping[str, int],
    host_pages: Mapping[str, int],
) -> list[str]:
    """`capacity_warnings`, each logged as a warning on `hicache.config` (stderr when logging
    is not configured, the structured log under `hicache serve`); returns them."""
    lines = capacity_warnings(loaded, token_page_bytes, state_page_bytes, host_pages)
    for line in lines:
        log.warning(line)
    return lines
