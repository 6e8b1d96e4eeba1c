"""The engine channel's wire format, shared by the sidecar and `hicache.client`.

A frame is a 4-byte little-endian length, then that many bytes of msgpack. A request is a map
`{"op": str, "id": int, "args": map}`; its reply `{"id": int, "ok": true, "result": map}` or
`{"id": int, "ok": false, "error": {"code": str, "message": str}}`. Requests on one connection
are answered in order. The first request must be `hello`, which carries `PROTOCOL_VERSION`.

Each op's arguments are a strict pydantic model (no coercion, no unknown fields, bounded
sizes), so a malformed request is refused at the boundary with a message naming the field, the
value and what is allowed. A frame over the size limit is answered with an error and the
connection is closed (its bytes cannot be skipped safely); anything else keeps it open.

Lookups by page keys. `hello`'s reply carries `keys`: the page size, the hash algorithm and
each cached group's keyer root (`PageKeyer.root` of the session's namespace). With them the
engine computes a prompt's chained page keys itself, once (`PageKeyer.from_root`), exactly as
the sidecar's index does, and `lookup_keys` sends them as one blob per group (the 16-byte keys
concatenated: no token list to decode, validate and hash again) with the prompt's length
(`num_tokens`; its partial trailing page has no key). The reply is `lookup`'s.
`lookup_many` carries several such lookups in one frame and answers them in one reply, in
order. Keys computed under another namespace's root (another tenant, model, rank) are simply
not in this namespace's index: they never hit. These are new ops: an engine that never sends
them speaks version 3 as before, and a sidecar without them answers `unknown_op`, so the
version stays 3.

Epochs. The replies to `register_pools` / `register_cuda_pools`, `store` and `load` carry
`session`: the id of the session (as `hello`'s reply names it) that ran the op, the epoch
the engine files each op under. A registration succeeds only once no other unended session
holds the memory it names (the engine's own earlier session included), so an engine whose
op got no reply knows that op's copies are over when a registration of the same memory
under a later epoch succeeds. New reply keys only (a client reads the keys it knows): the
version stays 3.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hicache.index import KEY_BYTES
from hicache.memory import GroupGeometry
from hicache.model import CacheKind, CacheSpec, LayerMap
from hicache.model.tensor_parallel import TP_SIZE_MAX

# 2: stores say each snapshot's length, and which pages are held; 3: pools and counters are
# sealed memfds named by descriptor number (no paths); 4: register_cuda_pools names the GPU by
# identity (UUID, PCI bus id), not by the engine's device index
PROTOCOL_VERSION = 4
HEADER = struct.Struct("<I")
MAX_TOKENS = 1 << 20
TOKEN_ID_MAX = (1 << 32) - 1
PAGE_ID_MAX = (1 << 31) - 1
IPC_EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
# a cudaMalloc allocation's shareable handle as torch writes it (a version and a type byte,
# then cudaIpcMemHandle_t's 64 bytes), with room; expandable segments' are kilobytes
IPC_MEM_HANDLE_MAX_BYTES = 256
MAX_LOOKUPS = 4096  # lookups in one lookup_many
MAX_STORE_WAIT_S = 60.0  # the longest a lookup may wait for a store in flight


class ErrorCode:
    BAD_FRAME = "bad_frame"  # not msgpack, not a map, or over the size limit
    BAD_REQUEST = "bad_request"  # arguments fail validation
    UNKNOWN_OP = "unknown_op"
    NOT_READY = "not_ready"  # hello / register_pools missing
    REFUSED = "refused"  # hello refused: version, layout, token, namespace in use
    OUT_OF_RANGE = "out_of_range"  # a page id beyond the registered pool, and the like
    BUSY = "busy"  # no free load slot, queue full
    INTERNAL = "internal"


class Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


TokenIds = Annotated[
    list[Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]], Field(max_length=MAX_TOKENS)
]
PageIds = Annotated[list[Annotated[int, Field(ge=0, le=PAGE_ID_MAX)]], Field(max_length=MAX_TOKENS)]
Name = Annotated[str, Field(min_length=1, max_length=128)]


class Hello(Msg):
    protocol: int
    layout: dict[str, Any]
    engine: str = Field(default="", max_length=256)
    pid: int = Field(default=0, ge=0)
    tp_rank: int = Field(default=0, ge=0, le=65535)
    # the engine's tensor-parallel size: must be the deployment's model.tp_size (sent only
    # when above 1: sidecars before it refuse unknown hello keys)
    tp_size: int = Field(default=1, ge=1, le=TP_SIZE_MAX)
    tenant: str = Field(default="", max_length=256)
    token: str | None = Field(default=None, max_length=4096)
    # "engine": owns the namespace's device pools (one per namespace); "lookup": a scheduler
    # process beside it (vLLM's EngineCore) that only asks lookup / prefetch / stats
    role: Literal["engine", "lookup"] = "engine"


class GroupManifest(Msg):
    num_pages: int = Field(ge=1, le=PAGE_ID_MAX)
    offsets: Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=16)]],
        Field(max_length=4096),
    ]
    # per layer, per tensor: bytes between page rows (the engine's own KV memory shared in
    # place, e.g. vLLM's blocks); absent: contiguous `[slots, *shape]` tensors
    page_strides: (
        Annotated[
            list[Annotated[list[Annotated[int, Field(ge=1)]], Field(max_length=16)]],
            Field(max_length=4096),
        ]
        | None
    ) = None


Fd = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]


class RegisterPools(Msg):
    fd: Fd  # in the engine's own fd table: the sidecar opens it as the socket's peer's
    nbytes: int = Field(ge=1, le=1 << 48)
    groups: Annotated[dict[Name, GroupManifest], Field(max_length=64)]
    counters_fd: Fd


class CudaTensor(Msg):
    device: int = Field(ge=0, le=1024)  # the engine's index: for messages (see CudaDevice)
    handle: bytes
    storage_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_handle: bytes = Field(max_length=4096)
    ref_offset: int = Field(ge=0)
    event_handle: bytes = Field(max_length=256)
    event_sync: bool
    shape: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=8)]
    stride: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=8)]
    offset: int = Field(ge=0)
    dtype: str = Field(max_length=32)

    @field_validator("handle")
    @classmethod
    def _one_allocation(cls, handle: bytes) -> bytes:
        if len(handle) > IPC_MEM_HANDLE_MAX_BYTES:
            raise ValueError(
                f"a CUDA IPC handle of {len(handle)} bytes (at most {IPC_MEM_HANDLE_MAX_BYTES}, "
                "one cudaMalloc allocation's): the engine allocates with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, whose memory the sidecar "
                "cannot map; start the engine without it"
            )
        return handle


class CudaDevice(Msg):
    """The GPU an engine's pools are on, as any process can name it (the sidecar may see it
    at another index: CUDA_VISIBLE_DEVICES differs between containers)."""

    uuid: str = Field(max_length=64)
    pci_bus_id: str = Field(max_length=32)
    index: int = Field(ge=0, le=1024)  # the engine's own, for messages


class CudaGroup(Msg):
    num_pages: int = Field(ge=1, le=PAGE_ID_MAX)
    tensors: Annotated[
        list[Annotated[list[CudaTensor], Field(max_length=16)]], Field(max_length=4096)
    ]


class RegisterCudaPools(Msg):
    device: CudaDevice
    groups: Annotated[dict[Name, CudaGroup], Field(max_length=64)]
    counters_fd: Fd


class Tokens(Msg):
    tokens: TokenIds


# one group's page keys, concatenated (checked against the page size in the op)
KeyBlob = Annotated[bytes, Field(max_length=MAX_TOKENS * KEY_BYTES)]


class KeyLookup(Msg):
    # every cached group's keys of the prompt's full pages (hello's `keys.roots` names them)
    keys: Annotated[dict[Name, KeyBlob], Field(max_length=64)]
    # the prompt's length; its partial trailing page has no key (default: the full pages')
    num_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    # the hit of these groups alone (an engine moving each pool on its own); None: all
    groups: Annotated[list[Name], Field(min_length=1, max_length=64)] | None = None
    # also answer, per group, the prompt's pages it holds (`served`: run and at)
    served: bool = False
    # wait up to this long when the hit stops at a page a store in flight is writing (a
    # decode instance asking for its prefill's pages, service/store_waits.py); 0: answer now
    wait_stored_s: float = Field(default=0.0, ge=0.0, le=MAX_STORE_WAIT_S)
    # with wait_stored_s: never hold the reply; the engine asks again itself while the
    # reply's `store_writing` says a store in flight writes the page past the hit (vLLM's
    # "ask again later"); wait_stored_s then only marks a lookup waiting for another
    # engine's pages (L3's remembered "absent" not trusted: ops_lookup.Query.trusts_absent)
    answer_at_once: bool = False


class LookupMany(Msg):
    lookups: Annotated[list[KeyLookup], Field(max_length=MAX_LOOKUPS)]


class PagesRequest(Msg):
    tokens: TokenIds
    device_pages: Annotated[dict[Name, PageIds], Field(max_length=64)]


PageId = Annotated[int, Field(ge=0, le=PAGE_ID_MAX)]
HeldPageIds = Annotated[list[PageId | None], Field(max_length=MAX_TOKENS)]
# one state snapshot: [num_tokens it covers, device slot]
Snapshot = Annotated[
    list[Annotated[int, Field(ge=0, le=PAGE_ID_MAX)]], Field(min_length=2, max_length=2)
]


# an engine's interprocess CUDA event, as its IPC handle (cudaIpcEventHandle_t): what a store's
# backup or a load's copies wait on, on the sidecar's stream
Fence = Annotated[
    bytes | None, Field(min_length=IPC_EVENT_HANDLE_BYTES, max_length=IPC_EVENT_HANDLE_BYTES)
]


class StoreRequest(Msg):
    tokens: TokenIds
    # token groups: a device page per full page, None where the engine no longer holds it
    device_pages: Annotated[dict[Name, HeldPageIds], Field(max_length=64)]
    # state groups: the snapshots the engine kept, each with the prefix length it covers
    snapshots: Annotated[
        dict[Name, Annotated[list[Snapshot], Field(max_length=MAX_TOKENS)]], Field(max_length=64)
    ] = {}
    # CUDA pools: the IPC handle (cudaIpcEventHandle_t, 64 bytes) of an interprocess event the
    # engine recorded after the kernels that wrote the pages; the backup waits on it. Absent:
    # the engine synchronised before storing (or its pools are shared memory, written on CPU).
    fence: Fence = None
    # answer only once L3 holds the prompt's pages (`persisted` in the reply), or after this
    # long: a prefill instance whose decode instance is on another host (0: at L2)
    persisted_within_s: float = Field(default=0.0, ge=0.0, le=MAX_STORE_WAIT_S)


class LoadRequest(PagesRequest):
    # the engine's own device cache holds the prompt's first pages: load only later ones
    skip_pages: int = Field(default=0, ge=0, le=PAGE_ID_MAX)
    # CUDA pools: an interprocess event the engine recorded after its work that still uses
    # (or zeroes) the pages the load fills, e.g. vLLM zeroing newly allocated blocks on its
    # stream; the load's copies wait on it. Absent: nothing of the engine's is in flight
    # on them (shared-memory pools: the engine works on the CPU).
    fence: Fence = None


class KeyedStore(Msg):
    """`store` of a prompt given by page keys the engine derived itself (an engine that keys
    pages by its own hashes, as SGLang does, and sends no tokens), one key per full page in
    every cached group (hello's `keys.roots` names them); state groups' snapshots as
    `store`'s, after a number of tokens that whole keys cover."""

    keys: Annotated[dict[Name, KeyBlob], Field(max_length=64)]
    device_pages: Annotated[dict[Name, HeldPageIds], Field(max_length=64)]
    snapshots: Annotated[
        dict[Name, Annotated[list[Snapshot], Field(max_length=MAX_TOKENS)]], Field(max_length=64)
    ] = {}
    fence: Fence = None
    # as `StoreRequest`'s: SGLang's MLA writer (rank 0), whose other ranks read L3
    persisted_within_s: float = Field(default=0.0, ge=0.0, le=MAX_STORE_WAIT_S)


class KeyedLoad(Msg):
    """`load` of a prompt given by the engine's own page keys (see `KeyedStore`)."""

    keys: Annotated[dict[Name, KeyBlob], Field(max_length=64)]
    device_pages: Annotated[dict[Name, PageIds], Field(max_length=64)]
    skip_pages: int = Field(default=0, ge=0, le=PAGE_ID_MAX)
    fence: Fence = None
    # the hit and copies of these groups alone, device pages for them only; None: all
    groups: Annotated[list[Name], Field(min_length=1, max_length=64)] | None = None
    # how long the load waits for its L3-only pages to reach L2 (a caller on a thread of its
    # own that would rather wait than miss: SGLang's prefetch IO); None: the prefetch policy
    l3_wait_s: float | None = Field(default=None, ge=0.0, le=MAX_STORE_WAIT_S)


class Release(Msg):
    load_id: int = Field(ge=0)


class Empty(Msg):
    pass


class Heartbeat(Msg):
    # the engine's per-layer wait_layer stalls since the last heartbeat, for the metrics
    layer_stall_s: Annotated[
        list[Annotated[float, Field(ge=0, le=3600)]], Field(max_length=4096)
    ] = []
    # loads the engine recomputed since the last heartbeat because its own staging pool had
    # too few free pages (sent only when nonzero: older sidecars refuse unknown keys)
    loads_starved: int = Field(default=0, ge=0, le=1 << 31)


ARGS: dict[str, type[Msg]] = {
    "hello": Hello,
    "register_pools": RegisterPools,
    "register_cuda_pools": RegisterCudaPools,
    "lookup": Tokens,
    "lookup_keys": KeyLookup,
    "lookup_many": LookupMany,
    "store": StoreRequest,
    "load": LoadRequest,
    "store_keys": KeyedStore,
    "load_keys": KeyedLoad,
    "prefetch": Tokens,
    "release": Release,
    "stats": Empty,
    "heartbeat": Heartbeat,
}


class RequestError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def describe(exc: ValidationError, op: str) -> str:
    """A pydantic error as `op.field: message (got value)`, one per line, at most five."""
    lines = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "args"
        if "token" in err["loc"]:  # the hello's `token` field (not `tokens`)
            # a secret, right or wrong: never echoed (a cut-off copy would escape masking)
            value = f"a {type(err.get('input')).__name__}, not shown"
        else:
            value = repr(err.get("input"))
            if len(value) > 60:
                value = value[:57] + "..."
        lines.append(f"{op}.{where}: {err['msg']} (got {value})")
    more = len(exc.errors()) - len(lines)
    if more > 0:
        lines.append(f"... and {more} more")
    return "; ".join(lines)


def _undecodable(payload: bytes, exc: Exception) -> str:
    detail = str(exc) or {
        "FormatError": "a byte that starts no msgpack value",
        "StackError": "nested too deep",
    }.get(type(exc).__name__, type(exc).__name__)
    if isinstance(exc, msgpack.ExtraData):
        detail = "bytes after the first value; one request per frame"
    head = payload[:16].hex(" ")
    return f"frame of {len(payload)} bytes is not valid msgpack ({detail}); it starts {head}"


def parse_request(payload: bytes) -> tuple[int, str, Msg]:
    """Decode and validate one request body; RequestError names what is wrong."""
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:
        raise RequestError(ErrorCode.BAD_FRAME, _undecodable(payload, exc)) from None
    if not isinstance(message, dict):
        raise RequestError(
            ErrorCode.BAD_FRAME,
            f"a request is a map with op, id and args; got {type(message).__name__}",
        )
    not_text = [key for key in message if not isinstance(key, str)]
    if not_text:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"request keys must be msgpack strings; got {', '.join(map(repr, not_text[:3]))} "
            "(pack with use_bin_type=True and str keys)",
        )
    unknown = set(message) - {"op", "id", "args"}
    if unknown:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"unknown request fields {sorted(unknown)}; allowed: op, id, args",
        )
    request_id = message.get("id", 0)
    if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0:
        raise RequestError(ErrorCode.BAD_REQUEST, f"id must be an int >= 0 (got {request_id!r})")
    if "op" not in message:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"request {request_id} names no op; a request is {{op, id, args}} with op one of: "
            f"{', '.join(sorted(ARGS))}",
        )
    op = message["op"]
    if not isinstance(op, str):
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"op must be a string (got {type(op).__name__} {op!r:.40})"
        )
    if op not in ARGS:
        raise RequestError(
            ErrorCode.UNKNOWN_OP, f"op {op!r} is not known; allowed: {', '.join(sorted(ARGS))}"
        )
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{op}.args must be a map (got {args!r:.60})")
    try:
        return request_id, op, ARGS[op].model_validate(args)
    except ValidationError as exc:
        raise RequestError(ErrorCode.BAD_REQUEST, describe(exc, op)) from None


def frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def ok(request_id: int, result: dict[str, Any]) -> bytes:
    return frame({"id": request_id, "ok": True, "result": result})


def error(request_id: int, code: str, message: str) -> bytes:
    return frame({"id": request_id, "ok": False, "error": {"code": code, "message": message}})


def unpack(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False)


def layout_summary(
    layer_map: LayerMap, geometries: Mapping[str, GroupGeometry], page_size_tokens: int
) -> dict[str, Any]:
    """What an engine and the sidecar must agree on before sharing pages: compared key by key
    (and group by group) in `hello`, so a refusal names exactly what differs. A group is its
    cache spec's fields (`CacheSpec.to_json`, plus any other field set) and its layers."""
    return {
        "model_type": layer_map.model_type,
        "start_layer": layer_map.start_layer,
        "end_layer": layer_map.end_layer,
        "dtypes": {name: geom.dtype_signature for name, geom in geometries.items()},
        "page_size_tokens": page_size_tokens,
        "groups": {g.name: _group_summary(g.spec, g.layer_ids) for g in layer_map.groups},
    }


def _group_summary(spec: CacheSpec, layer_ids: Sequence[int]) -> dict[str, Any]:
    out: dict[str, Any] = dict(spec.to_json())
    if not spec.kind.is_token_cache:  # fields `to_json` leaves out of a state cache, if set
        for key, value in (
            ("kv_format", spec.kv_format.value if spec.kv_format else None),
            ("kv_heads", spec.num_kv_heads),
            ("head_dim", spec.head_dim),
            ("v_head_dim", spec.v_head_dim),
        ):
            if value is not None:
                out[key] = value
    out["layers"] = list(layer_ids)
    return out


def layout_differences(engine: dict[str, Any], ours: dict[str, Any], at: str = "") -> list[str]:
    """Each differing entry as `key: engine X, sidecar Y`, nested keys dotted; a differing
    group in words: `group 'full': engine has ...; sidecar has ...`."""
    diffs = []
    for key in sorted(set(engine) | set(ours), key=str):
        theirs, mine = engine.get(key), ours.get(key)
        if theirs == mine:
            continue
        if not at and key == "groups" and isinstance(theirs, dict) and isinstance(mine, dict):
            for name in sorted(set(theirs) | set(mine), key=str):
                if theirs.get(name) != mine.get(name):
                    diffs.append(
                        f"group {name!r}: engine has {describe_group(theirs.get(name))}; "
                        f"sidecar has {describe_group(mine.get(name))}"
                    )
        elif isinstance(theirs, dict) and isinstance(mine, dict):
            diffs.extend(layout_differences(theirs, mine, f"{at}{key}."))
        else:
            diffs.append(f"{at}{key}: engine {theirs!r}, sidecar {mine!r}")
    return diffs


_KIND_WORDS = {kind.value: kind.description for kind in CacheKind}


def describe_group(group: Any) -> str:
    """A group of a layout summary in words: 'sliding-window (window 128), 8 KV heads x 64,
    24 layers (0-23)'; 'no such group' when absent."""
    if group is None:
        return "no such group"
    if not isinstance(group, dict):
        return str(group)  # a summary from another version: shown as it came
    g = dict(group)
    kind = g.pop("kind", None)
    words = [_KIND_WORDS.get(str(kind), str(kind))]
    if "window_tokens" in g:
        words[0] += f" (window {g.pop('window_tokens')})"
    if "chunk_tokens" in g:
        words[0] += f" (chunk {g.pop('chunk_tokens')})"
    kv_format = g.pop("kv_format", None)
    heads, head_dim, v_dim = (
        g.pop("kv_heads", None),
        g.pop("head_dim", None),
        g.pop("v_head_dim", None),
    )
    if kv_format == "mla":
        words.append(f"MLA latent {head_dim}")
    elif heads is not None or head_dim is not None:
        kv = f"{heads} KV heads x {head_dim}"
        if v_dim is None:
            kv += " (K only)"
        elif v_dim != head_dim:
            kv += f" (V x {v_dim})"
        words.append(kv)
    index = g.pop("index", None)
    if isinstance(index, dict):
        words.append(f"indexer {'K+V' if index.get('has_v') else 'K'} x {index.get('head_dim')}")
    shapes = g.pop("state_shapes", None)
    if isinstance(shapes, dict):
        words.append(
            "state "
            + ", ".join(f"{name} {'x'.join(map(str, shape))}" for name, shape in shapes.items())
        )
    layers = g.pop("layers", None)
    words += [f"{key} {value}" for key, value in g.items()]  # anything newer, as it is
    if isinstance(layers, list):
        words.append(f"{len(layers)} layers ({_ranges(layers)})")
    return ", ".join(words)


def _ranges(ids: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    run: list[int] = []
    for i in ids:
        if run and isinstance(i, int) and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
