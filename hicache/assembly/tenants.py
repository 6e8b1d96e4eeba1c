"""The `tenants` section, read: `TenantL2` (each tp_rank's L2 shared by its tenants, and the
eviction rule over it, `cache.shares.L2Shares`) and `check_tenant_shares`, the start-up check
of the shares against what L2 holds.

Lifecycle: `tenant_l2(d)` builds an empty `TenantL2` at start-up when `tenants.shared_l2` is
set (else None: every namespace its own L2, as before) -> the first namespace of a tp_rank
builds the host tier and `join`s, creating that rank's `L2Shares`; later namespaces of the
rank build on that tier (`tier`) and `join` it -> it lives with the service. Read once: a
change to the section needs a restart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from hicache.cache import TieredCache
from hicache.cache.shares import L2Shares, ShareRule, TenantGroupStats
from hicache.config import LoadedConfig
from hicache.config.capacity import long_prompt
from hicache.config.schema import Deployment, TenantsSection
from hicache.errors import ConfigError
from hicache.memory import HostTier


class TenantL2:
    """Each tp_rank's shared L2, built by its first namespace."""

    def __init__(self, section: TenantsSection):
        self._listed = {
            t: ShareRule(s.l2_share, 1.0 if s.l2_cap is None else s.l2_cap)
            for t, s in section.l2_shares.items()
        }
        self._rest = ShareRule(section.rest_share)
        self._ranks: dict[int, L2Shares] = {}

    def tier(self, tp_rank: int) -> HostTier | None:
        """The host tier the tenants of `tp_rank` share; None until its first namespace."""
        shares = self._ranks.get(tp_rank)
        return None if shares is None else shares.host_tier

    def join(self, tp_rank: int, tenant: str, cache: TieredCache) -> None:
        """`tenant`'s namespace on `tp_rank` takes its part of the rank's L2 (the tier its
        cache was built on: the shared one, or the first, which becomes it)."""
        shares = self._ranks.get(tp_rank)
        if shares is None:
            shares = self._ranks[tp_rank] = L2Shares(
                cache.embedded.host_tier, self._listed, self._rest
            )
        shares.join(tenant, cache.planner)

    def stats(self) -> dict[str, dict[str, dict[str, TenantGroupStats]]]:
        """Per tenant, per tp_rank (as a string), per group: `L2Shares.stats`."""
        out: dict[str, dict[str, dict[str, TenantGroupStats]]] = {}
        for rank, shares in sorted(self._ranks.items()):
            for tenant, groups in shares.stats().items():
                out.setdefault(tenant, {})[str(rank)] = groups
        return out


def tenant_l2(d: Deployment) -> TenantL2 | None:
    return TenantL2(d.tenants) if d.tenants.shared_l2 else None


def check_tenant_shares(
    loaded: LoadedConfig, host_pages: Mapping[str, int], tokens: set[str]
) -> None:
    """Refuse a listed tenant whose guaranteed share of L2 cannot hold one long prompt
    (`config.capacity.long_prompt`) in the token groups, or one snapshot of a state group,
    naming where the share was set, the share, the pages it buys and the least share that
    holds one."""
    d = loaded.deployment
    if not d.tenants.shared_l2:
        return
    states = {g: n for g, n in host_pages.items() if g not in tokens}
    for tenant, share in sorted(d.tenants.l2_shares.items()):
        for group, snapshots in sorted(states.items()):
            if math.floor(share.l2_share * snapshots) < 1:
                key = f"tenants.l2_shares.{tenant}.l2_share"
                raise ConfigError(
                    f"{loaded.source_of(key)}: {key} {share.l2_share} guarantees no snapshot "
                    f"of state group {group!r} ({snapshots} in L2); allowed: at least "
                    f"{math.ceil(1000 / snapshots) / 1000} (or a larger host.capacity_bytes "
                    "or host.state_fraction)"
                )
    if not tokens:
        return
    need_tokens, why = long_prompt(loaded)
    need_pages = -(-need_tokens // d.model.page_size_tokens)
    pages = min(host_pages[g] for g in tokens)
    for tenant, share in sorted(d.tenants.l2_shares.items()):
        held = math.floor(share.l2_share * pages)
        if held < need_pages:
            key = f"tenants.l2_shares.{tenant}.l2_share"
            least = need_pages / pages
            raise ConfigError(
                f"{loaded.source_of(key)}: {key} {share.l2_share} guarantees {held} of L2's "
                f"{pages} pages, smaller than one long prompt ({need_pages} pages, {why}); "
                f"allowed: at least {math.ceil(least * 1000) / 1000} (or a larger "
                "host.capacity_bytes)"
                if least <= 1
                else f"{loaded.source_of(key)}: {key} {share.l2_share} guarantees {held} of "
                f"L2's {pages} pages, smaller than one long prompt ({need_pages} pages, {why}); "
                "even all of L2 holds less: raise host.capacity_bytes"
            )
