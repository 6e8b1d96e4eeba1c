"""Does a subscriber that stops reading slow the sidecar? Store round trips against one real
`hicache serve` with KV events on (`service.kv_events`), in three modes interleaved trial by
trial in one run, so the machine's load falls on all of them alike — and, as the baseline of
the feature's own cost, a second sidecar alike but with KV events off:

  off       the second sidecar (no `service.kv_events`)
  none      no subscriber connected
  live      a subscriber reading every batch on a thread of this process
  stalled   a subscriber connected and subscribed that never reads (RCVHWM 1, a 4 KiB
            receive buffer): past the sidecar's high-water mark ZMQ drops its batches

Every store is a new one-page prompt into an L2 of 16 pages, so each one publishes a
`BlockStored` and (once L2 is full) a `BlockRemoved`: the worst case per op. Figures:

  store_p50_us_{mode}, store_p99_us_{mode}   store round trip, this process's clock
  ratio_stalled_vs_none                      p50 stalled / p50 none (1.0: no effect)
  ratio_live_vs_none                         p50 live / p50 none
  ratio_none_vs_off                          p50 none / p50 off: what publishing costs a store
  batches_sent, batches_dropped              the sidecar's counts at the end
  stalled_received                           batches the stalled subscriber got, of all

    python benchmarks/kv_events.py [--trials 5] [--stores 400]   # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
import zmq

from hicache.client import connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment

PAGE = 16
PAGE_BYTES = 2 * 2 * 2 * 64 * 2 * PAGE  # 2 layers x K,V x 2 heads x 64 x bf16 x 16 tokens


def deployment(tmp: Path, events: bool = True) -> Path:
    data = {
        "model": {
            "model_type": "tiny",
            "layers": [{"repeat": 2, "kind": "full", "kv_heads": 2, "head_dim": 64}],
            "page_size_tokens": PAGE,
        },
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": 16 * PAGE_BYTES},
        "storage": {"kind": "none"},
        "service": {
            "socket_path": str(tmp / ("e.sock" if events else "off.sock")),
            "http_port": 0,
            **({"kv_events": {"endpoint": "tcp://127.0.0.1:0", "hwm": 64}} if events else {}),
        },
    }
    path = tmp / ("deploy.yaml" if events else "off.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def subscriptions(sidecar: SidecarProcess) -> int:
    count: int = sidecar.get_json("/v1/stats")["kv_events"]["subscriptions"]
    return count


def wait_subscriptions(sidecar: SidecarProcess, count: int) -> None:
    deadline = time.monotonic() + 60
    while subscriptions(sidecar) != count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sidecar never counted {count} subscriptions")
        time.sleep(0.02)


class Live:
    """A subscriber reading every batch on its own thread."""

    def __init__(self, context: Any, endpoint: str):
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.stop = threading.Event()
        self.received = 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.socket.poll(50):
                self.socket.recv_multipart()
                self.received += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close(linger=0)


def stalled(context: Any, endpoint: str) -> Any:
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.setsockopt(zmq.RCVBUF, 4096)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    return socket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--stores", type=int, default=400, help="stores per mode per trial")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="hicache-kv-bench-") as tmp_dir:
        deploy = deployment(Path(tmp_dir))
        sidecar = SidecarProcess(deploy).start()
        off_deploy = deployment(Path(tmp_dir), events=False)
        off = SidecarProcess(off_deploy).start()
        context = zmq.Context()
        client = off_client = None
        stalled_received = 0
        try:
            endpoint = sidecar.get_json("/v1/stats")["kv_events"]["endpoint"]
            client = connect(
                sidecar.socket,
                load_deployment(deploy).layer_map(),
                page_size_tokens=PAGE,
                heartbeat=False,
            )
            client.register_pools(client.create_pools(4))
            off_client = connect(
                off.socket,
                load_deployment(off_deploy).layer_map(),
                page_size_tokens=PAGE,
                heartbeat=False,
            )
            off_client.register_pools(off_client.create_pools(4))
            modes = ("off", "none", "live", "stalled")
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.trials):
                for mode in times:
                    live, stuck = None, None
                    if mode == "live":
                        live = Live(context, endpoint)
                    elif mode == "stalled":
                        stuck = stalled(context, endpoint)
                    wait_subscriptions(sidecar, 0 if mode in ("off", "none") else 1)
                    engine = off_client if mode == "off" else client
                    for _ in range(args.stores):
                        tokens = [rng.randrange(100_000) for _ in range(PAGE)]
                        start = time.perf_counter()
                        engine.store(tokens, {"full": [0]})
                        times[mode].append(time.perf_counter() - start)
                    if live is not None:
                        live.close()
                    if stuck is not None:
                        while stuck.poll(0):
                            stuck.recv_multipart()
                            stalled_received += 1
                        stuck.close(linger=0)
                    wait_subscriptions(sidecar, 0)
            stats = sidecar.get_json("/v1/stats")["kv_events"]
        finally:
            for engine in (client, off_client):
                if engine is not None:
                    engine.close()
            context.term()
            sidecar.stop()
            off.stop()
    p50 = {m: statistics.median(t) for m, t in times.items()}
    figures: dict[str, Any] = {}
    for mode, samples in times.items():
        ordered = sorted(samples)
        figures[f"store_p50_us_{mode}"] = round(p50[mode] * 1e6, 1)
        figures[f"store_p99_us_{mode}"] = round(ordered[int(0.99 * (len(ordered) - 1))] * 1e6, 1)
    figures["ratio_stalled_vs_none"] = round(p50["stalled"] / p50["none"], 3)
    figures["ratio_live_vs_none"] = round(p50["live"] / p50["none"], 3)
    figures["ratio_none_vs_off"] = round(p50["none"] / p50["off"], 3)
    figures["batches_sent"] = stats["batches_sent"]
    figures["batches_dropped"] = stats["batches_dropped"]
    figures["stalled_received"] = stalled_received
    figures["stalled_sent_to"] = args.trials * args.stores
    for key, value in figures.items():
        print(f"{key:28} {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
