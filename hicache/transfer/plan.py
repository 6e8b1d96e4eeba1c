"""From pools and page lists to per-layer copies.

A `GroupMove` pairs device pages with host pages of one cache group (device_pages[i] <->
host_pages[i]); its index sets are built once per op and shared by every layer. `row_pairs`
gives one layer's copies (one per tensor: K, V, latent, index K/V, conv, ssm, ...), so side
caches such as a sparse layer's index K always travel with the KV.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hicache.errors import TransferError
from hicache.memory import DevicePool, HostPool
from hicache.transfer.backend import CopyBackend, Direction, LayerPart, RowPair, RowSource
from hicache.transfer.rows import Rows


@dataclass(frozen=True, slots=True)
class GroupMove:
    device: DevicePool
    host: HostPool
    device_rows: Rows
    host_rows: Rows

    @classmethod
    def build(
        cls,
        backend: CopyBackend,
        device: DevicePool,
        host: HostPool,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
    ) -> GroupMove:
        name = device.geometry.name
        if len(device_pages) != len(host_pages):
            raise TransferError(
                f"group {name!r}: {len(device_pages)} device pages but {len(host_pages)} host "
                "pages; a move pairs them one to one"
            )
        for label, pages, limit in (
            ("device", device_pages, device.num_pages),
            ("host", host_pages, host.num_pages),
        ):
            bad = [p for p in pages if not 0 <= p < limit]
            if bad:
                raise TransferError(
                    f"group {name!r}: {label} page {bad[0]} is outside 0..{limit - 1}"
                )
            if len(set(pages)) != len(pages):
                raise TransferError(f"group {name!r}: a {label} page is listed twice")
        # Enumerate the pairs in host-page order: host pages come from runs, so one side of
        # every copy is a run (one gather or one scatter); the pairing itself is unchanged.
        pairs = sorted(zip(host_pages, device_pages, strict=True))
        return cls(
            device,
            host,
            backend.rows([d for _, d in pairs], "device"),
            backend.rows([h for h, _ in pairs], "host"),
        )

    @property
    def num_pages(self) -> int:
        return self.device_rows.count

    def row_pairs(self, direction: Direction, local_id: int) -> Iterable[RowPair]:
        """One layer's copies (one per tensor), expanded on the backend's thread."""
        dev_rows, host_rows = self.device_rows, self.host_rows
        pairs = zip(self.device.layer_rows(local_id), self.host.layer_rows(local_id), strict=True)
        if direction is Direction.LOAD:
            return [(host, host_rows, dev, dev_rows) for dev, host in pairs]
        return [(dev, dev_rows, host, host_rows) for dev, host in pairs]

    def layer_bytes(self) -> int:
        return self.num_pages * self.device.geometry.page_bytes_per_layer


def copy_layers_blocking(
    backend: CopyBackend,
    direction: Direction,
    moves: Sequence[tuple[RowSource, Sequence[int]]],
) -> None:
    """Copy the given local layers of each move (a `GroupMove`, or any `RowSource` such as a
    `RowCopy`) as one walk and wait for it (no scheduler): for embedded callers that need a
    plain synchronous copy, and for benchmarks."""
    layers: list[list[LayerPart]] = [[(move, local_id)] for move, ids in moves for local_id in ids]
    if not layers:
        return
    finished = threading.Event()
    failures: dict[int, BaseException] = {}

    def done(errors: dict[int, BaseException]) -> None:
        failures.update(errors)
        finished.set()

    backend.submit_walk(direction, layers, done)
    finished.wait()
    if failures:
        position, first = next(iter(failures.items()))
        where = "the walk" if position < 0 else f"layer position {position}"
        lost = sum(p >= 0 for p in failures)
        raise TransferError(
            f"{where} failed, so {lost} layer copies did not land (a failed layer stops its "
            f"walk); first: {first!r}"
        ) from first
