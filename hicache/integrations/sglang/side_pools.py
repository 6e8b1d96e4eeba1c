"""SGLang's Mamba host pool (a v2 side pool) as the sidecar's state group, slot for slot.

A hybrid model's layout in hicache has a full-attention group (SGLang's KV host pool,
`host_pools`) and a state group (linear attention / Mamba: one snapshot per "page", each layer
a `conv` row and a recurrent / SSM row). SGLang's `MambaPoolHost` keeps one slot per state
(page size 1) in buffers of their own, in the page-first layouts only:

    temporal_buffer   [slots, L, 1, *temporal]    slot s of layer l at (s*L + l)*Rt  (stride L*Rt)
    conv_buffer[i]    [slots, L, 1, *conv_i]      slot s of layer l at (s*L + l)*Rc  (stride L*Rc)

(Rt, Rc: one layer's state bytes.) That is the state group's page rows at a page stride, so the
sidecar maps SGLang's host slots as the group's device pages: slot s for the sidecar is SGLang's
host slot s. hicache's state tensors are `conv` and one recurrent / SSM tensor: the conv buffer
maps to `conv`, the temporal buffer to the other; each buffer's per-slot shape, dtype and row
bytes, the layer count and the count of buffers are checked against the sidecar's group
(`model.ssm_state_dtype` must be SGLang's `--mamba-ssm-dtype`, `model.state_dtype` its conv
dtype), every mismatch named (`SidePoolError`). Not mapped, refused with the reason: side pools
of other kinds (a DSA indexer's is `index_pools`'), several conv buffers,
MTP draft layers, side-state buffers (`slot_state_buffers`), and a layout with no or several
state groups.

The buffers are shared in place with the KV host pool (`core.shared_memory`: one sealed memfd
under all of them, any allocator, SGLang's own "shm" memfds included — those are unsealed, so
the sidecar could not map them as they are): no copy through a staging buffer is needed, since
every buffer SGLang allocates for a host pool is page-aligned anonymous or memfd memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.errors import HicacheError
from hicache.index import GroupRule
from hicache.integrations.core.shared_memory import SharedRegions
from hicache.memory import GroupGeometry
from hicache.model import CacheKind

STATE_LAYOUTS = ("page_first", "page_first_direct")  # MambaPoolHost's own
CONV = "conv"


class SidePoolError(HicacheError):
    """SGLang's side pool does not fit the sidecar's layout (the message names each mismatch)."""


@dataclass(frozen=True, slots=True)
class StateBuffer:
    """One of the Mamba host pool's buffers: the hicache tensor it holds, its bytes per layer
    and slot, and the tensor itself (kept to share it and find its address)."""

    tensor: str
    row_bytes: int
    buffer: Any


@dataclass(frozen=True, slots=True)
class HostState:
    """What SGLang's Mamba host pool says about itself."""

    layers: int
    slots: int
    buffers: tuple[StateBuffer, ...]  # conv first, then the temporal (recurrent / SSM) state

    @classmethod
    def of(cls, host_pool: Any, geometry: GroupGeometry) -> HostState:
        """The pool's buffers named by the group's tensors; refused (SidePoolError) when it
        is not a MambaPoolHost in a page-first layout of one conv and one temporal buffer."""
        kind = type(host_pool).__name__
        if kind != "MambaPoolHost":
            raise SidePoolError(f"SGLang's mamba side pool is a {kind}; hicache maps MambaPoolHost")
        layout = str(host_pool.layout)
        if layout not in STATE_LAYOUTS:
            raise SidePoolError(
                f"SGLang's Mamba host pool is {layout}; hicache maps {', '.join(STATE_LAYOUTS)}"
            )
        conv, temporal = list(host_pool.conv_buffer), host_pool.temporal_buffer
        extra = list(getattr(host_pool, "slot_state_buffers", ()))
        drafts = getattr(host_pool, "mtp_draft_buffer_infos", ())
        if len(conv) != 1 or extra or drafts or temporal.numel() == 0:
            raise SidePoolError(
                f"SGLang's Mamba host pool holds {len(conv)} conv buffers, "
                f"{'a' if temporal.numel() else 'no'} temporal state, {len(extra)} side-state "
                f"buffers and {len(drafts)} MTP draft layers; hicache maps one conv and one "
                "temporal buffer of the target model's layers"
            )
        others = [name for name, _ in geometry.tensors if name != CONV]
        if [name for name, _ in geometry.tensors if name == CONV] != [CONV] or len(others) != 1:
            raise SidePoolError(
                f"the sidecar's state group {geometry.group.name!r} holds tensors "
                f"{[name for name, _ in geometry.tensors]}; SGLang's Mamba pool maps to 'conv' "
                "and one recurrent / SSM state"
            )
        layers = int(host_pool.num_mamba_layers)

        def row(buffer: Any) -> int:
            return int(buffer[0, 0].numel()) * int(buffer.element_size())

        return cls(
            layers,
            int(temporal.shape[0]),
            (
                StateBuffer(CONV, row(conv[0]), conv[0]),
                StateBuffer(others[0], row(temporal), temporal),
            ),
        )


def state_group(geometries: Mapping[str, GroupGeometry]) -> str:
    """The one state group of the sidecar's layout a Mamba side pool maps to."""
    states = sorted(g for g, geo in geometries.items() if not geo.group.kind.is_token_cache)
    if len(states) != 1:
        raise SidePoolError(
            f"the sidecar's layout has state groups {states}; SGLang's Mamba side pool maps "
            "to a layout of exactly one"
        )
    return states[0]


def sliding_group(geometries: Mapping[str, GroupGeometry]) -> str:
    """The one sliding-window group of the sidecar's layout an SWA side pool maps to."""
    windows = sorted(g for g, geo in geometries.items() if geo.group.kind is CacheKind.SLIDING)
    if len(windows) != 1:
        raise SidePoolError(
            f"the sidecar's layout has sliding-window groups {windows}; SGLang's SWA side pool "
            "maps to a layout of exactly one"
        )
    return windows[0]


def window_fits(geometry: GroupGeometry, pages: int, page_size_tokens: int) -> bool:
    """Whether the sidecar's sliding group moves every page of an SWA window of `pages`
    trailing pages. Its rule keeps only the pages its `window_tokens` needs
    (`GroupRule.needed`): a window SGLang sizes wider (its `swa_retain_window`, widened for
    speculative decoding, or a layout whose window is shorter than the model's) would have its
    leading pages neither stored nor loaded, so such a window is never served (SGLang
    recomputes), never reported loaded over slots the sidecar did not write."""
    rule = GroupRule.of(geometry.group)
    return len(rule.needed(pages, page_size_tokens)) >= pages


def check_state(state: HostState, group: str, geometry: GroupGeometry) -> None:
    """Every difference between SGLang's Mamba host pool and the sidecar's state group, named."""
    wrong = []
    if geometry.num_layers != state.layers:
        wrong.append(f"layers: SGLang {state.layers}, sidecar {geometry.num_layers}")
    shapes = dict(geometry.tensors)
    for buffer in state.buffers:
        want = geometry.row_bytes(buffer.tensor)
        shape, dtype = tuple(buffer.buffer.shape[3:]), buffer.buffer.dtype
        want_shape, want_dtype = tuple(shapes[buffer.tensor]), geometry.dtype_of(buffer.tensor)
        # bytes alone would let bfloat16 pass for float16, or a [8, 3] conv for a [3, 8] one:
        # engines of either would then share state pages and read each other's bytes wrong
        if (
            want != buffer.row_bytes
            or shape != want_shape
            or not geometry.accepts_dtype(buffer.tensor, dtype)
        ):
            wrong.append(
                f"{buffer.tensor} state: SGLang {shape} x {dtype} ({buffer.row_bytes} bytes per "
                f"layer), sidecar {want_shape} x {want_dtype} ({want} bytes)"
            )
    if wrong:
        raise SidePoolError(
            f"SGLang's Mamba host pool does not match the sidecar's group {group!r}: "
            + "; ".join(wrong)
        )


def state_rows(
    region: SharedRegions, state: HostState, geometry: GroupGeometry
) -> tuple[list[list[int]], list[list[int]]]:
    """The state group's per-layer offsets and page strides over `region` (shared in place
    with the pool's buffers), in the geometry's tensor order."""
    by_tensor = {buffer.tensor: buffer for buffer in state.buffers}
    offsets, strides = [], []
    for layer in range(state.layers):
        row_offsets, row_strides = [], []
        for tensor, _ in geometry.tensors:
            buffer = by_tensor[tensor]
            base = region.offset_of(buffer.buffer.data_ptr())
            row_offsets.append(base + layer * buffer.row_bytes)
            row_strides.append(state.layers * buffer.row_bytes)
        offsets.append(row_offsets)
        strides.append(row_strides)
    return offsets, strides


def host_slots(host_indices: Any, count: int) -> list[int] | None:
    """The Mamba host slots of a v2 transfer (one per key), or None when they do not match."""
    if host_indices is None or int(host_indices.numel()) != count:
        return None
    return [int(slot) for slot in host_indices.reshape(-1).tolist()]
