"""The sidecar's overheads against the embedded stack, measured in one run.

Starts `hicache serve` (a real child process) for gpt-oss-20b's layout (sliding + full) and
drives it from this process with the blocking client, then runs the same pages through the
embedded `TieredCache` in this process. Figures:

  rtt_p50_us               a small request (lookup of one page of tokens), round trip; beside
                           it, rtt_floor_us: a bare uvloop echo of the same bytes over a Unix
                           socket between two Python processes (the floor of any design here)
  ops_per_s                small requests back to back from one engine
  layer_signal_p50_us      a layer landing in the sidecar's copy thread -> the engine's
                           wait_layer seeing it through shared memory (both stamp
                           CLOCK_MONOTONIC; only layers the engine was waiting for count)
  load_ratio_vs_embedded   sidecar load GB/s / embedded load GB/s, same pages, each load timed
                           from the request to every layer seen and the op done. The embedded
                           baseline is that path at its best: one long-lived consumer thread
                           waits the layers (no thread started per load), the event loop
                           waits the op and then the consumer without another thread hop
  lookup_{1k,32k,128k}_us  round trip p50 of a lookup by page keys (`lookup_keys`, the keys
                           computed once per prompt) of a 1k / 32k / 128k-token prompt whose
                           pages are all in L2; beside them lookup_tokens_*_us, the same
                           lookups by token list (`lookup`), and keys_128k_us, the client's
                           cost of computing a 128k prompt's keys once (`page_keys`);
                           lookup_many_8x32k_us: eight 32k lookups in one frame
                           These run on a second sidecar whose layout is gpt-oss's pattern
                           (sliding window 128 + full attention, page 16) with one small layer
                           per group: a lookup's cost is in pages and groups, not bytes, and
                           gpt-oss-20b's own 128k prompt would need 3 GiB of L2 per copy

    python benchmarks/sidecar.py        # last line: one JSON object
"""

from __future__ import annotations

import asyncio
import json
import queue
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from hicache.assembly import embedded_cache
from hicache.channel.protocol import frame
from hicache.client import connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.scheduler import run

REPO = Path(__file__).resolve().parents[1]
PAGES, SMALL, TRIALS, LOADS_PER_TRIAL = 64, 5000, 5, 10
LOOKUP_SIZES = {"1k": 1024, "32k": 32768, "128k": 131072}


ECHO_SERVER = """
import asyncio, os, sys, uvloop
class Echo(asyncio.Protocol):
    def connection_made(self, transport): self.transport = transport
    def data_received(self, data): self.transport.write(data)
async def main():
    server = await asyncio.get_running_loop().create_unix_server(Echo, sys.argv[1])
    print("ready", flush=True)
    await asyncio.sleep(3600)
uvloop.run(main())
"""


def echo_floor_us(tmp: Path, frame: bytes) -> float:
    """p50 round trip of `frame` through a bare uvloop echo server in another process."""
    path = tmp / "echo.sock"
    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, str(path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        samples = []
        for i in range(2500):
            t0 = time.perf_counter_ns()
            sock.sendall(frame)
            got = 0
            while got < len(frame):
                got += len(sock.recv(65536))
            if i >= 500:
                samples.append(time.perf_counter_ns() - t0)
        sock.close()
        return statistics.median(samples) / 1e3
    finally:
        proc.kill()
        proc.wait()


def write_config(tmp: Path) -> Path:
    data = {
        "model": {"config_path": str(REPO / "configs/models/gpt-oss-20b.json")},
        "device": {"pool_capacity_bytes": "128MiB"},
        "host": {"capacity_bytes": "256MiB"},
        "storage": {"kind": "none"},
        "service": {"socket_path": str(tmp / "e.sock"), "http_port": None},
    }
    path = tmp / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def write_lookup_config(tmp: Path) -> Path:
    """gpt-oss's pattern (sliding 128 + full), one small layer per group, room for 128k."""
    data = {
        "model": {
            "model_type": "gpt-oss-pattern",
            "page_size_tokens": 16,
            "layers": [
                {"kind": "sliding", "kv_heads": 1, "head_dim": 64, "window_tokens": 128},
                {"kind": "full", "kv_heads": 1, "head_dim": 64},
            ],
        },
        "device": {"pool_capacity_bytes": "128MiB"},
        "host": {"capacity_bytes": "96MiB"},
        "storage": {"kind": "none"},
        "service": {"socket_path": str(tmp / "k.sock"), "http_port": None},
    }
    path = tmp / "lookup.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def p50_us(fn, runs: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(max(2, runs // 10)):
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return round(statistics.median(samples) / 1e3, 1)


def lookup_figures(tmp: Path) -> dict[str, float]:
    """Lookups of long prompts, all pages in L2: by page keys and by token list."""
    config = write_lookup_config(tmp)
    loaded = load_deployment(config)
    page = loaded.deployment.model.page_size_tokens
    longest = max(LOOKUP_SIZES.values())
    rng = random.Random(15)
    tokens = [rng.randrange(200_000) for _ in range(longest)]
    figures: dict[str, float] = {}
    with SidecarProcess(config) as sidecar:
        client = connect(sidecar.socket, loaded.layer_map(), heartbeat=False)
        client.register_pools(client.create_pools(longest // page))
        pages = {name: list(range(longest // page)) for name in client.geometries}
        client.store(tokens, pages)
        for name, size in LOOKUP_SIZES.items():
            prompt = tokens[:size]
            keys = client.page_keys(prompt)
            by_keys, by_tokens = client.lookup_keys(keys), client.lookup(prompt)
            assert by_keys == by_tokens, (by_keys, by_tokens)
            assert by_keys.tokens_l2 == size, by_keys
            runs = 2000 if size <= 1024 else 400 if size <= 32768 else 200
            figures[f"lookup_{name}_us"] = p50_us(lambda k=keys: client.lookup_keys(k), runs)
            figures[f"lookup_tokens_{name}_us"] = p50_us(
                lambda t=prompt: client.lookup(t), max(20, runs // 10)
            )
        figures["keys_128k_us"] = p50_us(lambda: client.page_keys(tokens), 30)
        many = [client.page_keys(tokens[: 32768 - 16 * i]) for i in range(8)]
        assert [h.tokens_l2 for h in client.lookup_many(many)] == [32768 - 16 * i for i in range(8)]
        figures["lookup_many_8x32k_us"] = p50_us(lambda: client.lookup_many(many), 200)
        client.close()
    return figures


def pages_of(geometries: dict, first: int) -> dict[str, list[int]]:  # type: ignore[type-arg]
    return {
        name: list(range(first, first + PAGES)) if g.group.kind.is_token_cache else [first]
        for name, g in geometries.items()
    }


def consume(handle, layer_ids) -> None:  # type: ignore[no-untyped-def]
    for layer_id in layer_ids:
        handle.wait_layer(layer_id)


def sidecar_trial(client, tokens, dst) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    signals: list[int] = []
    start = time.perf_counter()
    for _ in range(LOADS_PER_TRIAL):
        handle = client.load(tokens, dst)
        consume(handle, client.layer_map.stage_layer_ids)
        assert handle.done() == "done"
        signals += handle.signal_ns
    return time.perf_counter() - start, signals


class Consumer:
    """The embedded engine's forward thread, started once: waits each load's layers."""

    def __init__(self, layer_ids: list[int]):
        self.layer_ids = layer_ids
        self.jobs: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.seen: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="bench-consumer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (handle := self.jobs.get()) is not None:
            consume(handle, self.layer_ids)
            self.seen.put(True)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


async def embedded_trials(config: Path, tokens: list[int], results: list[float]) -> None:
    cache = embedded_cache(load_deployment(config))
    embedded = cache.embedded
    consumer = Consumer(list(embedded.layer_map.stage_layer_ids))
    async with cache.running():
        await cache.store(tokens, pages_of(embedded.geometries, 0))
        dst = pages_of(embedded.geometries, PAGES)
        for _ in range(TRIALS + 1):
            start = time.perf_counter()
            for _ in range(LOADS_PER_TRIAL):
                handle, _ = await cache.load(tokens, dst)
                assert handle is not None
                consumer.jobs.put(handle)
                result = await handle.done()
                consumer.seen.get()  # every layer was seen: at most microseconds after done
                assert result.ok
            results.append(time.perf_counter() - start)
            await asyncio.sleep(0)
    consumer.close()
    if cache.l3 is not None:
        await cache.l3.backend.close()
    embedded.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        config = write_config(tmp)
        loaded = load_deployment(config)
        tokens = list(range(PAGES * loaded.deployment.model.page_size_tokens))
        with SidecarProcess(config) as sidecar:
            client = connect(sidecar.socket, loaded.layer_map(), heartbeat=False)
            pools = client.create_pools(2 * PAGES)
            client.register_pools(pools)
            small = tokens[:16]
            for _ in range(500):
                client.lookup(small)
            rtts = []
            for _ in range(2000):
                t0 = time.perf_counter_ns()
                client.lookup(small)
                rtts.append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter()
            for _ in range(SMALL):
                client.lookup(small)
            ops_per_s = SMALL / (time.perf_counter() - t0)
            client.store(tokens, pages_of(client.geometries, 0))
            dst = pages_of(client.geometries, PAGES)
            sidecar_trial(client, tokens, dst)  # warm-up
            side_times, signals = [], []
            for _ in range(TRIALS):
                seconds, sig = sidecar_trial(client, tokens, dst)
                side_times.append(seconds)
                signals += sig
            bytes_per_load = client.stats()["load"]["bytes"] // client.stats()["load"]["ops"]
            client.close()
        request = frame({"op": "lookup", "id": 1, "args": {"tokens": small}})
        floor = echo_floor_us(tmp, request)
        emb_times: list[float] = []
        run(embedded_trials(config, tokens, emb_times))
        emb_times = emb_times[1:]  # the first is the warm-up
        lookups = lookup_figures(tmp)
    side = statistics.median(side_times)
    emb = statistics.median(emb_times)
    load_bytes = bytes_per_load * LOADS_PER_TRIAL
    figures = {
        "rtt_p50_us": round(statistics.median(rtts) / 1e3, 1),
        "rtt_p99_us": round(sorted(rtts)[int(len(rtts) * 0.99)] / 1e3, 1),
        "rtt_floor_us": round(floor, 1),
        "rtt_vs_floor": round(statistics.median(rtts) / 1e3 / floor, 2),
        "ops_per_s": round(ops_per_s),
        "layer_signal_p50_us": round(statistics.median(signals) / 1e3, 1) if signals else None,
        "layer_signals_measured": len(signals),
        "sidecar_load_gbps": round(load_bytes / side / 1e9, 3),
        "embedded_load_gbps": round(load_bytes / emb / 1e9, 3),
        "load_ratio_vs_embedded": round(emb / side, 3),
        "bytes_per_load": bytes_per_load,
        **lookups,
    }
    print(
        f"small request: rtt p50 {figures['rtt_p50_us']} us (target <= 100; bare echo "
        f"{figures['rtt_floor_us']} us), "
        f"{figures['ops_per_s']} ops/s (target >= 10000)"
    )
    print(
        f"layer signal p50 {figures['layer_signal_p50_us']} us over "
        f"{len(signals)} waited layers (target <= 50)"
    )
    print(
        f"load {bytes_per_load / 2**20:.1f} MiB: sidecar {figures['sidecar_load_gbps']} GB/s, "
        f"embedded {figures['embedded_load_gbps']} GB/s, ratio "
        f"{figures['load_ratio_vs_embedded']} (target >= 0.9)"
    )
    print(
        "lookup p50 by keys / by tokens: "
        + ", ".join(
            f"{name} {figures[f'lookup_{name}_us']} / {figures[f'lookup_tokens_{name}_us']} us"
            for name in LOOKUP_SIZES
        )
        + f" (target 128k <= 500); keys of 128k computed once {figures['keys_128k_us']} us; "
        f"8 x 32k in one lookup_many {figures['lookup_many_8x32k_us']} us"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
