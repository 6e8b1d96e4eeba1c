"""The `tenants` section (`TenantsSection`): whether a host's tenants share one L2 budget, and
each listed tenant's guaranteed share of it (and optional cap).

`shared_l2: false` (the default) keeps every namespace (tp_rank, tenant) on its own host tier
of `host.capacity_bytes`, as before. `shared_l2: true` gives all tenants of one tp_rank one
host tier of `host.capacity_bytes` together; `l2_shares` then guarantees the tenants it lists
their fraction of it (eviction takes from tenants over their share first), and the tenants it
does not list share the rest (`1 - sum(l2_share)`) as one group. What the schema cannot see
(a share too small for one long prompt) is checked at start-up by `assembly.host_pages`.
Read once at start: a change needs a restart. The sidecar's section: an embedded cache is one
tenant's and has its L2 to itself.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from hicache.config.section import Section


class TenantShare(Section):
    """A tenant's part of the shared L2, in fractions of it (a change needs a restart)."""

    l2_share: float = Field(
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="the fraction of L2 guaranteed to this tenant: other tenants' stores never "
        "evict its pages while it holds no more than this",
    )
    l2_cap: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="the most of L2 this tenant may hold (its own pages are evicted beyond "
        "it); none: it may borrow whatever others do not use",
    )

    @model_validator(mode="after")
    def _cap_at_least_share(self) -> TenantShare:
        if self.l2_cap is not None and self.l2_cap < self.l2_share:
            raise ValueError(
                f"l2_cap {self.l2_cap} is below l2_share {self.l2_share}; allowed: a cap >= "
                "the share (or none)"
            )
        return self


class TenantsSection(Section):
    """How the sidecar's tenants share L2 (read at start: a change needs a restart)."""

    shared_l2: bool = Field(
        default=False,
        description="one L2 of host.capacity_bytes per tp_rank for all tenants together; "
        "false: each (tp_rank, tenant) namespace its own host.capacity_bytes",
    )
    l2_shares: dict[str, TenantShare] = Field(
        default_factory=dict,
        description='per tenant name (as engines send it; "" is the engine that names none) '
        "its guaranteed share of the shared L2; tenants not listed share the rest",
    )

    @model_validator(mode="after")
    def _shares_fit(self) -> TenantsSection:
        if self.l2_shares and not self.shared_l2:
            raise ValueError(
                f"l2_shares lists {sorted(self.l2_shares)} but shared_l2 is false; allowed: "
                "shares only with shared_l2: true (each namespace has its own L2 otherwise)"
            )
        total = sum(s.l2_share for s in self.l2_shares.values())
        if total > 1 + 1e-9:
            shares = ", ".join(f"{t!r} {s.l2_share}" for t, s in sorted(self.l2_shares.items()))
            raise ValueError(
                f"the l2_share values add up to {total:.4g} ({shares}); allowed: at most 1 "
                "(the whole of host.capacity_bytes)"
            )
        return self

    @property
    def rest_share(self) -> float:
        """What the tenants not listed share: L2 less every listed tenant's guarantee."""
        return max(0.0, 1.0 - sum(s.l2_share for s in self.l2_shares.values()))
