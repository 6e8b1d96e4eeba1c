"""The package's exception tree. Every error names the bad value, where it came from, and
what is allowed. Backend-native errors are mapped at the boundary (`raise X(...) from exc`).

    HicacheError
    ├── ConfigError (ValueError)          a deployment file or override is invalid
    ├── LayoutError (ValueError)          a model config cannot be turned into a layout
    │   └── UnsupportedModelError         unknown model_type and no generic fields
    ├── LayerIdError (ValueError)         a layer id used where it does not belong
    │   ├── UnknownLayerError             not a layer of this model
    │   ├── LayerOutsideStageError        a layer of another pipeline stage
    │   └── WrongLayerKindError           the layer owns no cache of the asked kind
    ├── MemoryTierError
    │   ├── PoolExhaustedError            no free pages within the byte budget
    │   ├── PoolShapeError (ValueError)   a tensor handed to a pool has the wrong shape/dtype
    │   ├── PoolManifestError (ValueError) an engine's shared-pool manifest is unusable
    │   └── PinError (ValueError)         freeing a pinned page, unpinning an unpinned one
    ├── TransferError                     a copy failed; the op's pages are listed
    │   └── LayerLoadError                wait_layer: the layer's copy failed or was cancelled
    ├── CounterMisuseError (RuntimeError) layer-done counter used against its protocol
    ├── StorageError                      an L3 backend failed (never reaches the engine)
    │   ├── TierUnavailableError          the backend is down, slow or its breaker is open
    │   └── ObjectCorruptError            a stored object failed its header or checksum
    └── ServiceStartError                 `hicache serve` cannot listen where it is told to
"""

from __future__ import annotations


class HicacheError(Exception):
    """Base of every error hicache raises on purpose."""


class ConfigError(HicacheError, ValueError):
    """A deployment file, override or CLI argument is invalid."""


class LayoutError(HicacheError, ValueError):
    """A model config cannot be turned into a layout."""


class UnsupportedModelError(LayoutError):
    """The model_type is not a known family and the config has no generic layer fields."""


class LayerIdError(HicacheError, ValueError):
    """A layer id was used where it does not belong."""


class UnknownLayerError(LayerIdError):
    """The id is not a layer of this model."""


class LayerOutsideStageError(LayerIdError):
    """The id is a layer of another pipeline stage."""


class WrongLayerKindError(LayerIdError):
    """The layer owns no cache of the kind the caller asked for."""


class MemoryTierError(HicacheError):
    """A pool or tier cannot do what was asked."""


class PoolExhaustedError(MemoryTierError):
    """No free pages are left within the pool's byte budget."""


class PoolShapeError(MemoryTierError, ValueError):
    """A tensor handed to a pool does not match the layout's geometry."""


class PoolManifestError(MemoryTierError, ValueError):
    """A shared pool an engine registers (a file, or CUDA IPC handles) cannot be mapped."""


class PinError(MemoryTierError, ValueError):
    """A page was freed while pinned, or unpinned while not pinned."""


class TransferError(HicacheError):
    """A copy failed. The op's result says which pages moved and which did not."""


class LayerLoadError(TransferError):
    """`wait_layer(layer_id)` on a load whose walk stopped at or before that layer: its copy
    (or an earlier layer's) failed, or the load was cancelled. Raised as soon as the stop is
    known, before the load ends; `done()` still reports the load's end."""

    def __init__(self, load_id: int, layer_id: int, cause: str):
        super().__init__(f"load {load_id}: layer {layer_id} did not land: {cause}")
        self.load_id = load_id
        self.layer_id = layer_id
        self.cause = cause


class CounterMisuseError(HicacheError, RuntimeError):
    """The layer-done counter was used against its protocol."""


class StorageError(HicacheError):
    """An L3 backend failed. Callers above the storage tier see misses, never this."""


class TierUnavailableError(StorageError):
    """The backend is down, timed out, or its circuit breaker is open."""


class ObjectCorruptError(StorageError):
    """A stored object's header, key or checksum does not match: it is not handed out."""


class ServiceStartError(HicacheError):
    """The sidecar cannot listen where its config says (socket path, port in use, ...)."""
