"""`end_load`: wait for a load an engine adapter started, so that when the adapter hands the
load's memory back to its engine no copy of the load can still land there.

An engine that reuses the memory of a failed load at once (SGLang's controller frees the host
slots of a prefetch that answered False, and hands them to the next backup or prefetch) must
not be told "failed" while the sidecar's copy of that load still runs: the copy would finish
into memory that holds another node's pages by then, which are then stored, or loaded, under
someone else's keys (review F3). So a load that did not end in time is cancelled and waited
for again; only a load whose end the sidecar reported is over.

States of one load, as this module sees them:

    running --ended within timeout_s--> done / failed / cancelled          (ENDED)
    running --timeout_s passed--> cancel sent (`release`: the sidecar stops the walk at the
        next layer, its pins go as it ends)
        --ended within cancel_wait_s--> done / failed / cancelled          (ENDED)
        --not ended, or the cancel / the wait failed on the connection--> UNENDED

UNENDED means the sidecar may still write into the memory the load names until the session
that runs it ended. The adapter then detaches that session (`SidecarLink.detach`): the sidecar
ends a session whose connection is gone only once its ops settled, and registers the same
memory for a new session only after that (`service/claims.py`), so a new attach that succeeds
is the sidecar's word that the old copies are over.
"""

from __future__ import annotations

from hicache.client import LoadFailedError, LoadHandle, LoadLostError
from hicache.errors import HicacheError

UNENDED = "unended"


def end_load(handle: LoadHandle, timeout_s: float, cancel_wait_s: float) -> str:
    """The load's final state ("done", "failed", "cancelled") once it ended, or UNENDED (see
    the module doc). Never raises for a slow or lost load; its slot is released either way."""
    try:
        return handle.done(timeout_s=timeout_s)
    except LoadLostError:
        return UNENDED  # the connection went while it ran: its session is ending
    except LoadFailedError:
        pass
    try:
        handle.cancel()
        return handle.done(timeout_s=cancel_wait_s)
    except (HicacheError, ConnectionError, OSError):  # not ended, or not known to have
        return UNENDED
