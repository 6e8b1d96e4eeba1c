"""Named yield points on the sidecar's attach / op / end / drain paths, for the interleaving
explorer (`hicache.testing.interleave`), which decides at each one which party goes next.

`await checkpoint("attach.start")` sits immediately before an await of the path that can let
another party run (so a schedule the explorer picks is one the event loop could pick too). In
a running sidecar no hook is installed: `checkpoint` returns at once and never yields to the
loop (one call and one global read). `install(hook)` sets the hook (one at a time, refused
while another is installed) and returns the function that removes it; nothing in the product
installs one.

The names, stable (a harness scenario waits on them):
  attach.start     ops_pools: before awaiting the namespace's start (the first registration of
                   a key starts it; the others wait for that same start)
  attach.attached  ops_pools: the session attached to a running namespace, before the reply
  namespace.build  namespace_registry: the start task, before the namespace's cache is built
  store.begin      ops_data: before the cache's store
  load.begin       ops_data: before the cache's load
  end.begin        server.end: a session's end, before its loads are cancelled and awaited
  end.detach       server.end: before its pools are detached from its namespace
  drain.begin      server.drain: listening stopped, before in-flight loads are awaited
  drain.sessions   server.drain: before the sessions are ended and awaited
  drain.flush      server.drain: before every namespace is flushed and closed
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

Hook = Callable[[str], Awaitable[None]]

_hook: Hook | None = None


async def checkpoint(name: str) -> None:
    """A yield point named `name`: awaits the installed hook, or returns at once (none)."""
    hook = _hook
    if hook is not None:
        await hook(name)


def install(hook: Hook) -> Callable[[], None]:
    """Install `hook` (awaited at every checkpoint, in the task that reached it); returns its
    removal. Refused (RuntimeError) while another hook is installed."""
    global _hook
    if _hook is not None:
        raise RuntimeError(
            f"a checkpoint hook is already installed ({_hook!r}); remove it first (one "
            "explorer at a time per process)"
        )
    _hook = hook

    def remove() -> None:
        global _hook
        if _hook is hook:
            _hook = None

    return remove
