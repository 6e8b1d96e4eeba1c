"""The interleaving explorer: runs a small scenario of the sidecar's real op handlers again and
again, each time under another schedule of its parties, until every schedule has run (or a
bound). A party is a coroutine (an engine's registration, a store, a session's end, the
drain); it runs freely until it reaches a checkpoint (`hicache.service.checkpoints`: named
yield points immediately before the awaits of the attach / op / end / drain paths), where it
parks. Whenever nothing can run without a parked party going on (the loop is quiet: no ready
callback, no due timer, no thread job of the loop's executors), the explorer picks the party
to release: each pick is a decision, and the decisions of a run are its schedule. The next
run replays the schedule up to its last decision that has an untried choice and takes that
choice (depth-first search over the decision tree), so every order in which the parties can
pass their checkpoints is run exactly once.

API (stable; scenarios of other helpers build on it):

    def scenario(run: Run) -> Awaitable[None]:        # one fresh world per ordering
        async def a() -> int: ...                     # a party: any coroutine function
        outcomes = await run.parties({"a": a, "b": b})  # all run under the schedule
        # (at={"attach.start", ...}: only those checkpoints are decisions)
        assert outcomes["a"].error is None            # Outcome: .value, .error, .ok
        ...                                           # invariants after this ordering

    report = explore(scenario, name="register together", max_orderings=500)
    report.orderings          # how many orderings ran; report.exhaustive: all of them
    print(report)             # "register together: 12 orderings (all), depth 5"

- `Run.parties` may be called several times in one scenario (phases): their decisions add
  up to one schedule. Outside `parties` (the scenario's own steps) checkpoints pass.
  `parties(..., at={...})`: only the checkpoints named are decisions (the code between
  them runs as one step), to keep a scenario's orderings few.
- A task that is no party (one a party started: a namespace's start, a session's end after
  an abort) is adopted as a party when it reaches a checkpoint, named by its task name
  (`task#k` for an unnamed one, k its order of adoption), and is released by the same
  picks; its outcome is its own task's.
- A scenario that raises fails the exploration: `OrderingFailed` says which ordering (its
  picks: party@checkpoint, in order) and chains the scenario's error, so the failing
  schedule can be read and replayed (`explore(..., replay=failed.picks)`).
- Quiet but nothing parked while a party is unfinished: the parties wait on time (a timer)
  or on each other for good. The explorer waits for the next park or end; past
  `hang_after_s` it fails the ordering as a hang naming where every party is.
- Each ordering runs on a fresh event loop (`ExploringLoop`: the default selector loop that
  counts its executor jobs, for the quiet test); the hook is installed for the run only.

Lifecycle of one ordering: fresh loop -> hook installed -> scenario (parties parked and
released by the picks, replayed from the prefix, the first choice after it) -> hook removed,
loop closed -> the next prefix, or the end (all explored, or `max_orderings`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.service import checkpoints


class ExploringLoop(asyncio.SelectorEventLoop):
    """The default event loop, counting the jobs its executors run (`run_in_executor`, hence
    `asyncio.to_thread` too) from submission until their result is back on the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs = 0
        self.jobs_idle = asyncio.Event()

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:  # type: ignore[override]
        future = super().run_in_executor(executor, func, *args)
        self.jobs += 1
        self.jobs_idle.clear()

        def landed(_: asyncio.Future[Any]) -> None:
            self.jobs -= 1
            if not self.jobs:
                self.jobs_idle.set()

        future.add_done_callback(landed)
        return future

    def quiet(self) -> bool:
        """Nothing runs before a parked party goes on: no ready callback, no timer due, no
        executor job in flight (its result would wake someone)."""
        ready = self._ready  # type: ignore[attr-defined]
        scheduled = self._scheduled  # type: ignore[attr-defined]
        due = bool(scheduled) and scheduled[0].when() <= self.time()
        return not ready and not due and not self.jobs


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class Pick:
    party: str
    checkpoint: str
    options: tuple[str, ...]  # the parties parked then (sorted); the pick is one of them

    def __str__(self) -> str:
        return f"{self.party}@{self.checkpoint}"


class OrderingFailed(AssertionError):
    def __init__(self, name: str, ordering: int, picks: Sequence[Pick], error: BaseException):
        self.picks = [p.party for p in picks]
        steps = " -> ".join(map(str, picks)) or "(no choice)"
        super().__init__(
            f"{name}: ordering {ordering} failed: {type(error).__name__}: {error}\n"
            f"  schedule: {steps}"
        )


class Hang(AssertionError):
    """Parties unfinished, none parked, nothing woke them within `hang_after_s`."""


@dataclass
class _Parked:
    checkpoint: str
    go: asyncio.Future[None]


@dataclass
class Run:
    """One ordering: the parties, where each is parked, the picks made so far."""

    prefix: Sequence[str]  # the parties to pick at the first decisions (replayed)
    hang_after_s: float
    picks: list[Pick] = field(default_factory=list)
    diverged: int = 0  # replayed picks whose party was not parked (a nondeterministic run)
    _names: dict[asyncio.Task[Any], str] = field(default_factory=dict)
    _parked: dict[str, _Parked] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _adopted: int = 0
    _scheduling: bool = False  # inside `parties`: checkpoints park; outside they pass
    _at: frozenset[str] | None = None  # the checkpoints that park (None: every one)

    async def hook(self, name: str) -> None:
        task = asyncio.current_task()
        if task is None or not self._scheduling or (self._at is not None and name not in self._at):
            return
        party = self._names.get(task)
        if party is None:  # a task a party started: a party from now on
            self._adopted += 1
            task_name = task.get_name()
            party = task_name if not task_name.startswith("Task-") else f"task#{self._adopted}"
            while party in self._names.values():
                party += "'"
            self._track(task, party)
        go = asyncio.get_running_loop().create_future()
        self._parked[party] = _Parked(name, go)
        self._changed.set()
        try:
            await go
        finally:
            self._parked.pop(party, None)

    def _track(self, task: asyncio.Task[Any], party: str) -> None:
        self._names[task] = party
        task.add_done_callback(lambda _: self._changed.set())

    async def parties(
        self,
        parties: Mapping[str, Callable[[], Awaitable[Any]]],
        *,
        at: Iterable[str] | None = None,
    ) -> dict[str, Outcome]:
        """Run `parties` (name -> coroutine function) to their ends under the schedule;
        each one's value or exception. `at`: the checkpoints that are decisions (others
        pass, as if the code between them were one step); None: every checkpoint."""

        async def outcome(make: Callable[[], Awaitable[Any]]) -> Outcome:
            try:
                return Outcome(value=await make())
            except Exception as exc:
                return Outcome(error=exc)

        tasks = {}
        for name, make in parties.items():
            task = asyncio.get_running_loop().create_task(outcome(make), name=name)
            self._track(task, name)
            tasks[name] = task
        self._scheduling, self._at = True, None if at is None else frozenset(at)
        try:
            await self._schedule(set(tasks.values()))
        finally:
            self._scheduling, self._at = False, None
        return {name: task.result() for name, task in tasks.items()}

    async def settle(self) -> None:
        """Until the loop is quiet (twice in a row: the test is taken after a full pass)."""
        loop = asyncio.get_running_loop()
        assert isinstance(loop, ExploringLoop)
        calm = 0
        while calm < 2:
            await asyncio.sleep(0)
            if loop.jobs:
                calm = 0
                await loop.jobs_idle.wait()
                continue
            calm = calm + 1 if loop.quiet() else 0

    async def _schedule(self, mine: set[asyncio.Task[Any]]) -> None:
        while True:
            await self.settle()
            live = [t for t in self._names if not t.done()]
            if all(t.done() for t in mine) and not self._parked:
                return
            if not self._parked:
                self._changed.clear()
                try:
                    async with asyncio.timeout(self.hang_after_s):  # wait_for drops cancels
                        await self._changed.wait()
                except TimeoutError:
                    where = ", ".join(sorted(self._names[t] for t in live))
                    raise Hang(
                        f"parties {where} are unfinished, none is parked and nothing woke "
                        f"them in {self.hang_after_s:g} s (after {len(self.picks)} picks: "
                        f"{' -> '.join(map(str, self.picks))})"
                    ) from None
                continue
            options = tuple(sorted(self._parked))
            party = options[0]
            if len(options) > 1:
                decision = sum(1 for p in self.picks if len(p.options) > 1)
                if decision < len(self.prefix):
                    wanted = self.prefix[decision]
                    if wanted in options:
                        party = wanted
                    else:
                        self.diverged += 1
            parked = self._parked[party]
            self.picks.append(Pick(party, parked.checkpoint, options))
            parked.go.set_result(None)


@dataclass
class Exploration:
    name: str
    orderings: int
    exhaustive: bool
    max_depth: int  # the most decisions in one ordering
    diverged: int  # orderings whose replay met other parties than recorded
    seconds: float

    def __str__(self) -> str:
        span = "all" if self.exhaustive else "bounded"
        return (
            f"{self.name}: {self.orderings} orderings ({span}), depth {self.max_depth}"
            + (f", {self.diverged} diverged" if self.diverged else "")
            + f", {self.seconds:.1f} s"
        )


def _next_prefix(picks: Sequence[Pick]) -> list[str] | None:
    """The deepest decision with an untried choice after the one taken (options are sorted:
    the choices after it are untried), the picks before it kept."""
    decisions = [p for p in picks if len(p.options) > 1]
    for depth in range(len(decisions) - 1, -1, -1):
        pick = decisions[depth]
        at = pick.options.index(pick.party)
        if at + 1 < len(pick.options):
            return [p.party for p in decisions[:depth]] + [pick.options[at + 1]]
    return None


def explore(
    scenario: Callable[[Run], Awaitable[None]],
    *,
    name: str,
    max_orderings: int = 1000,
    hang_after_s: float = 60.0,
    replay: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> Exploration:
    """Run `scenario` under every schedule of its parties (depth-first, up to
    `max_orderings`); `replay`: run only the schedule whose picks are these parties. Raises
    `OrderingFailed` for the first ordering whose scenario raised. `log` (default: print to
    stderr) gets the summary line."""
    started = time.perf_counter()
    prefix: list[str] | None = list(replay) if replay is not None else []
    orderings = max_depth = diverged = 0
    while prefix is not None and orderings < max_orderings:
        run = Run(prefix, hang_after_s)
        orderings += 1
        error = _run_one(scenario, run)
        if error is not None:
            raise OrderingFailed(name, orderings, run.picks, error) from error
        max_depth = max(max_depth, sum(1 for p in run.picks if len(p.options) > 1))
        diverged += bool(run.diverged)
        prefix = None if replay is not None else _next_prefix(run.picks)
    report = Exploration(
        name, orderings, prefix is None, max_depth, diverged, time.perf_counter() - started
    )
    (log or (lambda line: print(line, file=sys.stderr)))(str(report))
    return report


def _run_one(scenario: Callable[[Run], Awaitable[None]], run: Run) -> BaseException | None:
    loop = ExploringLoop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(4))
    remove = checkpoints.install(run.hook)
    try:
        # a fresh context: nothing of a previous ordering's context variables leaks in
        contextvars.Context().run(loop.run_until_complete, _guarded(scenario, run))
        return None
    except BaseException as exc:  # the scenario's failure, reported with its schedule
        if isinstance(exc, KeyboardInterrupt):
            raise
        return exc
    finally:
        remove()
        try:
            _cancel_left(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


async def _guarded(scenario: Callable[[Run], Awaitable[None]], run: Run) -> None:
    await scenario(run)


def _cancel_left(loop: asyncio.AbstractEventLoop) -> None:
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in left:
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
