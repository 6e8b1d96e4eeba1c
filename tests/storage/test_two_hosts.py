"""Cross-host prefix sharing (issue #17): two real `hicache serve` processes on two test hosts
(network namespaces joined by a veth pair, `hicache.testing.netns_hosts`) sharing one L3: a
prompt stored through host A is a hit on host B and loads byte-exact; B's link cut while it
loads gives misses and an open breaker, never an engine error or a crash, with /readyz
"ready, degraded"; the link back, B hits again, byte-exact.

Parametrised by `storage`: `mooncake` (a mooncake_master in A's namespace bound to A's
address; each sidecar's Mooncake client names its own address, so A's pages lie in A's
segment and B reads them over the veth) and `redis_cluster` (nodes in A's namespace; skipped
until `hicache.testing.local_servers` has `RedisClusterServers`).

The engines run outside both namespaces and reach each sidecar by its Unix socket; each is
one long-lived process driven over stdin (`python -m tests.storage.test_two_hosts engine
--config FILE`: one JSON command per line, one JSON answer per line), so the module pays for
two sidecar starts and two engine starts per storage kind. Skipped only where namespaces
cannot be created (`netns_hosts.available()`, e.g. not root), and failed for that under CI
(which runs as root).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, shared_model

PAGE = 16
SHORT_PAGES = 6  # test (a)'s prompts
LONG_PAGES = 48  # the prompts B loads while its link goes down: ~9 MiB each on LFM2-350M
LONG_PROMPTS = 4  # more than B's L2 holds, so B's loads keep reading L3
POOL_PAGES = 2 * LONG_PAGES + 8
BREAKER_RESET_S = 2.0
LIVENESS_S = 90.0  # how long B may take to hit again once its link is back (not a timing assert)


def prompt(i: int, pages: int) -> list[int]:
    """Prompt `i`'s tokens: its own ids, so no two prompts share a page."""
    return [(i + 1) * 1_000_003 + t for t in range(pages * PAGE)]


# ---------------------------------------------------------------------------------------------
# the engine: one process, commands on stdin


def engine_main(argv: list[str]) -> int:
    """Answer one JSON line per command line on stdin:
    {"op": "store", "first", "count", "pages"}       -> {"stored": n}
    {"op": "load", "first", "count", "pages"}        -> {"results": [per prompt]}
    {"op": "loop_start", "first", "count", "pages"}  -> {"started": true}; loads on a thread
    {"op": "loop_stop"}                              -> {"events": [per load]}
    A per-prompt result: lookup_tokens (the lookup's hit), loaded (tokens the load brought),
    verified and mismatches (pages checked byte by byte), error (an exception, as text)."""
    from hicache.client import connect_deployment
    from hicache.config import load_deployment
    from tests.service.engine_proc import load_and_verify, pages_for, prefill, store, wipe

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    loaded = load_deployment(args.config)
    client = connect_deployment(loaded, engine="two-hosts")
    pools = client.create_pools(POOL_PAGES)
    client.register_pools(pools)

    def load_one(i: int, pages: int) -> dict[str, Any]:
        tokens = prompt(i, pages)
        out: dict[str, Any] = {"prompt": i, "tokens": len(tokens), "t": time.time()}
        try:
            out["lookup_tokens"] = client.lookup(tokens).tokens_total
            wipe(pools)
            verified, mismatches, got = load_and_verify(
                client, pools, tokens, pages_for(client, pools, pages, pages)
            )
            out.update(loaded=got, verified=verified, mismatches=mismatches)
        except (Exception, SystemExit) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    stop = threading.Event()
    events: list[dict[str, Any]] = []
    looper: threading.Thread | None = None

    def loop(first: int, count: int, pages: int) -> None:
        n = 0
        while not stop.is_set():
            events.append(load_one(first + n % count, pages))
            n += 1

    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            reply: dict[str, Any]
            if op == "store":
                for i in range(cmd["first"], cmd["first"] + cmd["count"]):
                    tokens = prompt(i, cmd["pages"])
                    src = pages_for(client, pools, 0, cmd["pages"])
                    prefill(client, pools, tokens, src)
                    store(client, tokens, src)
                reply = {"stored": cmd["count"]}
            elif op == "load":
                first, count = cmd["first"], cmd["count"]
                reply = {
                    "results": [load_one(i, cmd["pages"]) for i in range(first, first + count)]
                }
            elif op == "loop_start":
                stop.clear()
                events.clear()
                looper = threading.Thread(
                    target=loop, args=(cmd["first"], cmd["count"], cmd["pages"])
                )
                looper.start()
                reply = {"started": True}
            elif op == "loop_stop":
                stop.set()
                if looper is not None:
                    looper.join()
                reply = {"events": list(events)}
            else:
                reply = {"error": f"unknown op {op!r} (store, load, loop_start, loop_stop)"}
            print(json.dumps(reply), flush=True)
    finally:
        stop.set()
        client.close()
    return 0


class Engine:
    """The test's side of an engine process."""

    def __init__(self, config: Path):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.storage.test_two_hosts",
                "engine",
                "--config",
                str(config),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self._read()  # {"ready": true}: connected and pools registered

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"engine exited ({self.proc.wait()}):\n{err[-3000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        assert "error" not in reply, reply
        return reply

    def close(self) -> None:
        """End of stdin ends the engine (communicate closes it)."""
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        assert self.proc.returncode == 0, f"engine failed ({self.proc.returncode}):\n{err[-3000:]}"


# ---------------------------------------------------------------------------------------------
# the two hosts, their L3 and their sidecars

if __name__ != "__main__":  # the test (the engine process needs none of this)
    from hicache.client.process import SidecarProcess
    from hicache.testing import local_servers, netns_hosts
    from hicache.testing.netns_hosts import Host, TwoHosts


@pytest.fixture(scope="module", autouse=True)
def _namespaces() -> None:
    """Every test here needs two test hosts: skipped where network namespaces and veth
    cannot be made, failed under CI (root, which can), in the test, not at collection (a
    collection error would stop the whole run)."""
    why_not = netns_hosts.available()
    if why_not is not None:
        if os.environ.get("CI"):
            pytest.fail(f"two test hosts need network namespaces: {why_not}", pytrace=False)
        pytest.skip(f"two test hosts need network namespaces: {why_not}")


def storage_section(kind: str, l3_address: str, local_address: str) -> dict[str, Any]:
    # 5 s, not the default 1 s: on a busy machine a healthy 9 MiB get over the veth took
    # longer than 1 s, so once the link was back every trial timed out and the breaker
    # never stayed closed; a cut link still times out (and opens the breaker) well inside
    # the tests' 60 s deadlines
    guard = {"breaker_reset_after_s": BREAKER_RESET_S, "base_timeout_s": 5.0}
    if kind == "mooncake":
        return {
            "kind": "mooncake",
            "master_address": l3_address,
            "local_hostname": local_address,
            "global_segment_bytes": "256MiB",
            "local_buffer_bytes": "64MiB",
            **guard,
        }
    return {"kind": "redis", "url": l3_address, **guard}


def write_config(workdir: Path, storage: dict[str, Any], host_bytes: str) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    data = {
        "model": {"config_path": str(shared_model("lfm2_350m.json")), "page_size_tokens": PAGE},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": host_bytes},
        "storage": storage,
        "cache": {"prefetch_policy": "wait_complete"},
        "service": {
            "socket_path": str(workdir / "e.sock"),
            "http_port": 0,
            "heartbeat_timeout_s": 10,
            "admin_without_token": True,  # the HTTP port is inside the host's namespace
        },
    }
    path = workdir / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class Cluster:
    hosts: TwoHosts
    sidecars: dict[str, SidecarProcess]
    configs: dict[str, Path]

    def http(self, host: Host, path: str, method: str = "GET") -> tuple[int, Any]:
        """An HTTP call to `host`'s sidecar, made from inside its namespace."""
        url = self.sidecars[host].http + path

        def call() -> tuple[int, Any]:
            request = urllib.request.Request(url, method=method)
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    return int(reply.status), json.loads(reply.read())
            except urllib.error.HTTPError as exc:
                return int(exc.code), json.loads(exc.read())

        return self.hosts.within(host, call)

    def stats(self, host: Host) -> dict[str, Any]:
        status, body = self.http(host, "/v1/stats")
        assert status == 200, body
        return dict(body)

    def l3(self, host: Host) -> dict[str, Any]:
        return dict(self.stats(host)["l3"])

    def clear_l2(self, host: Host) -> None:
        status, body = self.http(host, "/v1/admin/clear?tier=l2", method="POST")
        assert status == 200, body

    def l2_pages(self, host: Host) -> int:
        return sum(
            g["l2_pages"] for ns in self.stats(host)["namespaces"] for g in ns["groups"].values()
        )

    def wait_persisted(self, host: Host, pages: int, timeout_s: float = 60.0) -> None:
        """Until `host`'s persist queue is empty and idle with at least `pages` pages written."""
        deadline = time.monotonic() + timeout_s
        persist: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            persist = [ns["persist"] for ns in self.stats(host)["namespaces"]]
            queued = sum(p["queued_pages"] + p["writing_pages"] for p in persist)
            if persist and queued == 0 and sum(p["written_pages"] for p in persist) >= pages:
                return
            time.sleep(0.2)
        raise AssertionError(
            f"host {host} did not persist {pages} pages in {timeout_s} s: {persist}"
        )


def _start_l3(kind: str, hosts: TwoHosts, workdir: Path) -> tuple[Any, str]:
    """The shared L3's servers in A's namespace bound to A's address, and the address the
    sidecars' storage section names."""
    prefix = hosts.command_prefix("a")
    if kind == "mooncake":
        master = local_servers.MooncakeMaster(host=hosts.address["a"], command_prefix=prefix)
        master.start()
        return master, master.address
    servers = local_servers.RedisClusterServers(
        workdir / "redis", host=hosts.address["a"], command_prefix=prefix
    )
    hosts.within("a", servers.start)  # its readiness probes, if any, from A's namespace
    return servers, servers.seed_url


@pytest.fixture(scope="module", params=["mooncake", "redis_cluster"])
def storage(request: pytest.FixtureRequest) -> str:
    """Each L3 kind, skipped (failed under CI, which installs both) when its parts are
    missing: the Mooncake wheel, or redis-server and redis-cli."""
    kind = str(request.param)
    if kind == "mooncake":
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on the platform's wheel
            missing = f"mooncake-transfer-engine cannot be imported: {exc}"
        else:
            missing = ""
    else:
        gone = [b for b in ("redis-server", "redis-cli") if local_servers.find_binary(b) is None]
        missing = f"{' and '.join(gone)} not installed" if gone else ""
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing, pytrace=False)
        pytest.skip(missing)
    return kind


@pytest.fixture(scope="module")
def cluster(storage: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Hosts, L3, A's sidecar with everything the tests load stored and persisted by A's
    engine, then B's sidecar (started after A's writes, so with Mooncake every page lies in
    A's segment: B's reads cross the veth)."""
    workdir = tmp_path_factory.mktemp(f"hosts-{storage}")
    hosts = TwoHosts()
    servers: Any = None
    sidecars: dict[str, SidecarProcess] = {}
    try:
        servers, l3_address = _start_l3(storage, hosts, workdir)
        configs = {
            # A holds all it stores (nothing leaves its L2 before it is persisted); B's L2
            # is smaller than the long prompts together, so its loads keep reading L3
            h: write_config(
                workdir / h,
                storage_section(storage, l3_address, hosts.address[h]),
                "64MiB" if h == "a" else "24MiB",
            )
            for h in ("a", "b")
        }
        sidecars["a"] = hosts.within("a", SidecarProcess(configs["a"]).start)
        cluster = Cluster(hosts, sidecars, configs)
        writer = Engine(configs["a"])
        try:
            writer.ask("store", first=0, count=2, pages=SHORT_PAGES)
            writer.ask("store", first=100, count=LONG_PROMPTS, pages=LONG_PAGES)
        finally:
            writer.close()
        cluster.wait_persisted("a", 2 * SHORT_PAGES + LONG_PROMPTS * LONG_PAGES)
        sidecars["b"] = hosts.within("b", SidecarProcess(configs["b"]).start)
        yield cluster
    finally:
        codes: dict[str, int | None] = {}
        try:
            for h, s in sidecars.items():
                try:
                    codes[h] = s.stop()
                except Exception as exc:  # the rest is still stopped
                    codes[h] = None
                    print(f"host {h}: its sidecar did not stop cleanly: {exc!r}")
        finally:
            try:
                if servers is not None:
                    servers.stop()
            finally:
                hosts.close()  # the namespaces go even when a server's stop failed
    for h, code in codes.items():
        assert code == 0, sidecars[h].log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def reader(cluster: Cluster) -> Iterator[Engine]:
    engine = Engine(cluster.configs["b"])
    try:
        yield engine
    finally:
        engine.close()


def _exact_hits(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "error" not in r, r
        assert r["lookup_tokens"] == r["tokens"], r
        assert r["loaded"] == r["tokens"], r
        assert r["verified"] > 0, r
        assert r["mismatches"] == 0, r


# ---------------------------------------------------------------------------------------------
# the harness itself


def _connects(hosts: TwoHosts, host: Host, address: tuple[str, int]) -> bool:
    def attempt() -> bool:
        try:
            socket.create_connection(address, timeout=2).close()
        except OSError:
            return False
        return True

    return hosts.within(host, attempt)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def test_hosts_reach_each_other_only_over_their_link() -> None:
    with TwoHosts() as hosts:
        listener = hosts.within("a", lambda: socket.create_server((hosts.address["a"], 0)))
        with listener:
            address = (hosts.address["a"], listener.getsockname()[1])
            assert _connects(hosts, "b", address), f"B cannot reach A's listener at {address}"
            hosts.link_down()
            assert not _connects(hosts, "b", address), "B reaches A with its link down"
            hosts.link_up()
            assert _connects(hosts, "b", address), "B cannot reach A once its link is back"
        names = set(hosts.namespace.values())
        assert names <= _namespaces()
    assert not names & _namespaces(), f"close() left namespaces behind: {names & _namespaces()}"


def test_a_failed_set_up_removes_what_it_created(monkeypatch: pytest.MonkeyPatch) -> None:
    real_ip = netns_hosts._ip

    def refusing(*args: str) -> subprocess.CompletedProcess[str]:
        if args[:2] == ("link", "add"):
            return subprocess.CompletedProcess(["ip", *args], 2, "", "RTNETLINK answers: nope")
        return real_ip(*args)

    before = _namespaces()
    monkeypatch.setattr(netns_hosts, "_ip", refusing)
    with pytest.raises(RuntimeError, match=r"`ip link add hc\d+-\d+a .*` failed \(2\): RTNETLINK"):
        TwoHosts()
    assert _namespaces() == before, f"left behind: {_namespaces() - before}"


def test_the_sweep_removes_namespaces_of_dead_processes() -> None:
    dead = subprocess.Popen(["true"])  # a pid that has just exited
    dead.wait()
    stale = f"hc{dead.pid}-0a"
    mine = f"hc{os.getpid()}-999b"
    for name in (stale, mine):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in netns_hosts.sweep_stale()
        assert stale not in _namespaces()
        assert mine in _namespaces(), "the sweep removed a namespace of a live process"
    finally:
        for name in (stale, mine):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


# ---------------------------------------------------------------------------------------------
# the tests, in order: (a) a hit across hosts, (b) the link cut, (c) the link back


def test_a_prompt_stored_on_a_is_a_hit_on_b(cluster: Cluster, reader: Engine) -> None:
    assert cluster.l2_pages("b") == 0, "B's L2 holds pages before B loaded anything"
    before = cluster.l3("b")
    received = cluster.hosts.received_bytes("b")
    _exact_hits(reader.ask("load", first=0, count=2, pages=SHORT_PAGES)["results"])
    after = cluster.l3("b")
    assert after["hits"] > before["hits"], f"B's hits did not come from L3: {before} -> {after}"
    read = after["get_bytes"] - before["get_bytes"]
    crossed = cluster.hosts.received_bytes("b") - received
    assert read > 0, after
    assert crossed >= read, f"B read {read} bytes from L3 but its veth received only {crossed}"


def test_b_cut_off_mid_load_gets_misses_and_a_breaker(cluster: Cluster, reader: Engine) -> None:
    cluster.clear_l2("b")
    hits_before = cluster.l3("b")["hits"]
    reader.ask("loop_start", first=100, count=LONG_PROMPTS, pages=LONG_PAGES)
    ready: dict[str, Any] = {}
    down_at = float("inf")
    try:
        deadline = time.monotonic() + 60
        while cluster.l3("b")["hits"] == hits_before:
            assert time.monotonic() < deadline, f"B's loop reads nothing from L3: {cluster.l3('b')}"
            time.sleep(0.1)
        cluster.hosts.link_down()
        down_at = time.time()
        deadline = time.monotonic() + 60
        while cluster.l3("b")["breaker"] == "closed":
            assert time.monotonic() < deadline, f"B's breaker never opened: {cluster.l3('b')}"
            time.sleep(0.2)
        status, ready = cluster.http("b", "/readyz")
        assert status == 200, ready
        assert ready["status"] == "ready, degraded", ready
        assert ready["degraded"][0]["tier"] == "l3", ready
        time.sleep(1.0)  # loads while the breaker is open: L2 only
    finally:
        events = reader.ask("loop_stop")["events"]
    assert events, "B's engine finished no load"
    errors = [e for e in events if "error" in e]
    assert not errors, (
        f"{len(errors)} engine errors while B's link was down, the first: {errors[0]}"
    )
    assert all(e["mismatches"] == 0 for e in events), "a loaded page held wrong bytes"
    cut = [e for e in events if e["t"] >= down_at]  # loads that began with the link down
    short = [e for e in cut if e["loaded"] < e["tokens"]]
    assert short, f"no load missed while B's link was down: {cut}"
    print(
        f"B's loop: {len(events) - len(cut)} loads before its link went down, {len(cut)} "
        f"after, {len(short)} of them short (misses); "
        f"readyz {ready['status']}: {ready['degraded'][0]['breaker']}"
    )
    proc = cluster.sidecars["b"].proc
    assert proc is not None
    assert proc.poll() is None, f"B's sidecar exited ({proc.returncode})"


def test_b_hits_again_once_its_link_is_back(cluster: Cluster, reader: Engine) -> None:
    cluster.hosts.link_up()
    back = time.monotonic()
    while cluster.l3("b")["breaker"] != "closed":
        assert time.monotonic() - back < LIVENESS_S, f"B's breaker stays open: {cluster.l3('b')}"
        time.sleep(0.2)
    print(f"B's breaker closed {time.monotonic() - back:.1f} s after its link came back")
    cluster.clear_l2("b")
    hits_before = cluster.l3("b")["hits"]
    while True:
        results = reader.ask("load", first=100, count=1, pages=LONG_PAGES)["results"]
        if results[0].get("loaded") == results[0]["tokens"]:
            break
        assert time.monotonic() - back < LIVENESS_S, f"B does not hit again: {results}"
        time.sleep(0.5)
    print(f"B hit again {time.monotonic() - back:.1f} s after its link came back")
    _exact_hits(results)
    _exact_hits(reader.ask("load", first=0, count=2, pages=SHORT_PAGES)["results"])
    assert cluster.l3("b")["hits"] > hits_before


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        sys.exit(engine_main(sys.argv[2:]))
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else __file__} engine --config FILE")
