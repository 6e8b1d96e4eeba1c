"""`Attachments`: the sets of device pools a scheduler's ops copy to and from, by attachment
id, and each attachment's live ops (admitted, not yet ended).

Lifecycle of an attachment: `add(id, pools)` (every group of the stage, each with the stage's
geometry) -> ops admitted under it (`admitted`) end one by one (`ended`, from the scheduler's
one `Completion.finish`) -> `remove(id)` once none is live. The host tier, the budget and the
walks are the scheduler's and shared by every attachment; only the device side is per
attachment, so two engines' ops never write each other's memory. Pure bookkeeping: no awaits,
no torch calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hicache.memory import DevicePool, GroupGeometry
from hicache.scheduler.moves import OpRequestError
from hicache.scheduler.ops import OpState
from hicache.scheduler.records import OpRecord

DEFAULT_ATTACHMENT = 0  # the scheduler's constructor pools (an embedded engine's own)


class Attachments:
    def __init__(self, geometries: Mapping[str, GroupGeometry]):
        self.geometries = dict(geometries)
        self._pools: dict[int, dict[str, DevicePool]] = {}
        self._live: dict[int, set[OpRecord]] = {}

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._pools))

    def pools(self, attachment: int) -> dict[str, DevicePool]:
        """The pools ops of `attachment` move; refused by name when it is not attached."""
        pools = self._pools.get(attachment)
        if pools is None:
            raise OpRequestError(
                f"attachment {attachment}: no device pools are attached under it (its engine "
                f"detached, or never attached); attached: {list(self.ids)}"
            )
        return pools

    def get(self, attachment: int) -> dict[str, DevicePool]:
        return self._pools.get(attachment, {})

    def add(self, attachment: int, device_pools: Mapping[str, DevicePool]) -> None:
        self.require_idle(attachment, "replaced")
        if set(device_pools) != set(self.geometries):
            raise OpRequestError(
                f"device pools {sorted(device_pools)} given; the stage's groups are "
                f"{sorted(self.geometries)}"
            )
        for name, pool in device_pools.items():
            if pool.geometry != self.geometries[name]:
                raise OpRequestError(
                    f"group {name!r}: the device pool's geometry {pool.geometry} differs from "
                    f"the stage's {self.geometries[name]}"
                )
        self._pools[attachment] = dict(device_pools)

    def remove(self, attachment: int) -> None:
        self.require_idle(attachment, "dropped")
        self._pools.pop(attachment, None)
        self._live.pop(attachment, None)

    def admitted(self, attachment: int, ops: Iterable[OpRecord]) -> None:
        live = self._live.setdefault(attachment, set())
        for op in ops:
            op.attachment = attachment
            live.add(op)

    def ended(self, op: OpRecord) -> None:
        """`op` ended and no copy of it runs any more: its attachment's pools may go."""
        live = self._live.get(op.attachment)
        if live is not None:
            live.discard(op)

    def live(self, attachment: int) -> list[OpRecord]:
        return [op for op in self._live.get(attachment, ()) if not op.state.final]

    def require_idle(self, attachment: int, verb: str) -> None:
        live = self._live.get(attachment, ())
        if live:
            running = sum(op.state is OpState.RUNNING for op in live)
            raise OpRequestError(
                f"device pools of attachment {attachment} can be {verb} only while none of its "
                f"ops is queued or in flight; {running} in flight, {len(live) - running} queued"
            )
