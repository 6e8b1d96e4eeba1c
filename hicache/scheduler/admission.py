"""Admission: validate an op's request, select the pages each group moves, and reserve them.

`select_pages` checks every group against the layer map and the hybrid rules (moves.py);
`reserve` pins a load's host pages, or a backup's — the ones its caller reserved (the cache's
planner does), or a run it allocates itself, handed to the device pages in ascending order so
the copy is one gather — and builds each group's move. On any
error the caller releases what was reserved, so a rejected op leaves every pool as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

from hicache.memory import DevicePool, HostTier
from hicache.model import LayerMap
from hicache.scheduler.moves import MovePolicy, OpRequestError, Selection, select
from hicache.scheduler.ops import GroupPages, OpKind
from hicache.scheduler.records import OpRecord
from hicache.transfer import CopyBackend, GroupMove


def select_pages(
    kind: OpKind,
    request: Mapping[str, GroupPages],
    layer_map: LayerMap,
    page_size_tokens: int,
    policy: MovePolicy,
) -> dict[str, tuple[GroupPages, Selection]]:
    if not request:
        raise OpRequestError(f"a {kind.value} op needs pages of at least one group")
    selections: dict[str, tuple[GroupPages, Selection]] = {}
    for name, pages in request.items():
        group = layer_map.group(name)  # raises with the valid groups
        if kind is OpKind.LOAD and len(pages.host_pages) != len(pages.device_pages):
            raise OpRequestError(
                f"group {name!r}: {len(pages.device_pages)} device pages but "
                f"{len(pages.host_pages)} host pages; a load pairs them one to one"
            )
        if (
            kind is OpKind.BACKUP
            and pages.host_pages
            and (len(pages.host_pages) != len(pages.device_pages))
        ):
            raise OpRequestError(
                f"group {name!r}: {len(pages.device_pages)} device pages but "
                f"{len(pages.host_pages)} host pages; a backup either names one reserved host "
                "page per device page or none (the scheduler allocates them)"
            )
        selection = select(
            group,
            len(pages.device_pages),
            pages.num_tokens,
            page_size_tokens,
            policy,
            for_load=kind is OpKind.LOAD,
            first_page=pages.first_page,
        )
        selections[name] = (pages, selection)
    return selections


def reserve(
    op: OpRecord,
    backend: CopyBackend,
    device_pools: Mapping[str, DevicePool],
    host_tier: HostTier,
) -> None:
    for name, (pages, selection) in op.selections.items():
        if op.kind is OpKind.BACKUP and pages.host_pages and selection.skipped:
            raise OpRequestError(
                f"group {name!r}: host pages were reserved for {len(selection.skipped)} "
                f"device pages this backup does not copy (move policy); reserve only what moves"
            )
        if not selection.positions:
            continue
        host = host_tier.pool(name)
        device = device_pools.get(name)
        if device is None:
            raise OpRequestError(
                f"group {name!r}: no device pool is attached (the engine detached); "
                "register pools before loading or storing"
            )
        dev = [pages.device_pages[i] for i in selection.positions]
        if op.kind is OpKind.LOAD or pages.host_pages:
            # a load's pages hold its bytes; a backup's were reserved by its caller, who
            # keeps them whatever happens
            what = "holds nothing" if op.kind is OpKind.LOAD else "is not reserved"
            hosts = [pages.host_pages[i] for i in selection.positions]
            for page in hosts:
                if not 0 <= page < host.num_pages or not host.allocator.is_allocated(page):
                    raise OpRequestError(
                        f"group {name!r}: host page {page} {what} (not allocated in the host "
                        f"pool of {host.num_pages} pages)"
                    )
        else:
            run = host.allocator.alloc(len(dev))
            op.allocated[name] = run
            by_rank = {d: run[r] for r, d in enumerate(sorted(dev))}
            hosts = [by_rank[d] for d in dev]
        move = GroupMove.build(backend, device, host, dev, hosts)
        host.allocator.pin(hosts)
        op.pinned[name] = hosts
        op.host_pages[name] = hosts
        op.moves[name] = move
        op.nbytes += move.layer_bytes() * device.geometry.num_layers
