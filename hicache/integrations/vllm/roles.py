"""What vLLM's `kv_transfer_config.kv_role` means for the hicache connector (no vLLM import).

    kv_both      loads hits and stores each step's pages (one engine, or many sharing a
                 sidecar): as before roles existed
    kv_producer  the prefill instance of a prefill/decode pair: stores every complete page
                 of each prompt (a request with max_tokens=1 too: its one step's pages), and
                 a step ends only once the sidecar acknowledged its stores (in L2, counted in
                 the worker's stats): when the prefill's response comes back, its pages are
                 there for the decode instance. It loads too: a prefix another prompt stored
                 (a shared system prompt) is loaded instead of recomputed — that saves the
                 prefill's compute, and what it loaded is already in L2 for the decode side
    kv_consumer  the decode instance: loads, never stores (its pages are the producer's; a
                 decode step's new pages are its own). Its lookups wait, up to
                 `store_wait_s` (default `CONSUMER_STORE_WAIT_S`), for pages a producer's
                 store in flight is writing, vLLM asking again at later steps meanwhile
                 (`vllm/lookups.py`), so a decode request that overtakes its prefill's store
                 loads instead of recomputing

Two hosts: the decode instance's sidecar sees the prefill's pages only in L3; a producer with
`persisted_within_s` has the store that completes a prompt answered once L3 holds its pages
(or at that bound), so its reply means they are readable from the other host
(`check_persisted`: producers only); earlier chunks' stores are answered at L2.

Each client's reply timeout outlasts only the waits its own requests carry
(`reply_timeout_s`): the scheduler's lookups their `store_wait_s` (held only by a sidecar
that predates `answer_at_once`), the worker's stores
`persisted_within_s` and its loads `load_timeout_s`.

vLLM checks the value when it builds `KVTransferConfig`; the connector checks it again (a
config built without validation, a value from a newer vLLM) and refuses to start on any
other, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.errors import ConfigError

WHERE = "KVTransferConfig.kv_role"
# a decode instance's default wait for its prefill's store: that store's copy into L2 (the
# prefill's compute is over by then), far under a second; the bound holds vLLM's scheduler
# thread, so it stays small
CONSUMER_STORE_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Role:
    name: str
    loads: bool  # asks the sidecar for hits and loads them
    stores: bool  # backs each step's new pages up
    acks_stores: bool  # a step ends once its stores are in L2 (the sidecar's reply)
    default_store_wait_s: float  # its lookups' wait for stores in flight, unless configured


ROLES = {
    "kv_both": Role("kv_both", loads=True, stores=True, acks_stores=False, default_store_wait_s=0),
    "kv_producer": Role(
        "kv_producer", loads=True, stores=True, acks_stores=True, default_store_wait_s=0
    ),
    "kv_consumer": Role(
        "kv_consumer",
        loads=True,
        stores=False,
        acks_stores=False,
        default_store_wait_s=CONSUMER_STORE_WAIT_S,
    ),
}


def role_of(value: object, where: str = WHERE) -> Role:
    """The role `value` names; a `ConfigError` naming it, where it came from and the roles
    allowed, for anything else (None included: a connector needs a role)."""
    role = ROLES.get(value) if isinstance(value, str) else None
    if role is None:
        raise ConfigError(
            f"{where}: {value!r} is not a role the hicache connector serves; allowed: "
            f"{', '.join(ROLES)} (kv_producer: the prefill instance, stores every prompt's "
            "pages; kv_consumer: the decode instance, loads them; kv_both: both)"
        )
    return role


# what a reply takes beyond its own waits: the sidecar's work and the socket, on a busy host
REPLY_MARGIN_S = 5.0


def reply_timeout_s(
    client_role: str, *, load_timeout_s: float, store_wait_s: float, persisted_within_s: float
) -> float:
    """How long a client of `client_role` waits for a reply: the scheduler's lookup client
    (`lookup`) for a lookup's store wait, the worker's (`engine`) for a load's layer or a
    store's wait for L3, each plus `REPLY_MARGIN_S`."""
    if client_role == "lookup":
        return REPLY_MARGIN_S + store_wait_s
    return max(REPLY_MARGIN_S, load_timeout_s, REPLY_MARGIN_S + persisted_within_s)


def check_persisted(role: Role, persisted_within_s: float) -> None:
    """`persisted_within_s` (a store answered once L3 holds its pages) makes each step wait
    for L3: only a producer, whose steps wait for their stores anyway, may ask for it."""
    if persisted_within_s > 0 and not role.acks_stores:
        raise ConfigError(
            f"kv_connector_extra_config.persisted_within_s: {persisted_within_s:g} with "
            f"{WHERE} {role.name!r}; only kv_producer (a prefill instance whose decode "
            "instance reads its pages from L3 on another host) waits for L3; use 0 here"
        )
