"""`hicache stats`: a live view of a running sidecar, read from its HTTP API (`/v1/stats`,
`/metrics`, `/readyz`; none of them needs the token): hit rate per tier, L2 use per group,
queue depth, layer-stall percentiles and the L3 breaker, redrawn in place every `--interval`
seconds until Ctrl-C; `--once` prints one frame, `--json` one JSON object.

The address is `--url`, or `service.http_host` / `http_port` of `--config` (the packaged
default when neither is given). `--token` (or `--config`'s `service.token`, which its
`HICACHE_SERVICE__TOKEN` override sets like any other; prefer it to `--token`, which `ps`
shows) is sent as a bearer token when given.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.errors import HicacheError

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
QUANTILES = (0.5, 0.9, 0.99)
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class SidecarUnreachableError(HicacheError):
    """The sidecar's HTTP API did not answer (or answered with an error)."""


def add_stats_parser(sub: Any, default_config: Path) -> argparse.ArgumentParser:
    stats: argparse.ArgumentParser = sub.add_parser(
        "stats",
        help="a live view of a running sidecar (hit rates, L2 use, queues, stalls, L3)",
        description=__doc__.split("\n\n")[0],
    )
    where = stats.add_mutually_exclusive_group()
    where.add_argument(
        "--url", help="the sidecar's HTTP API, e.g. http://127.0.0.1:9400 (default: --config's)"
    )
    where.add_argument(
        "--config",
        type=Path,
        default=None,
        help="deployment YAML whose service.http_host / http_port to read (default: the "
        f"packaged default, {default_config})",
    )
    stats.add_argument(
        "--token", default=None, help="bearer token to send (default: --config's service.token)"
    )
    stats.add_argument(
        "--interval", type=float, default=2.0, help="seconds between frames (default: 2)"
    )
    stats.add_argument("--once", action="store_true", help="print one frame and exit")
    stats.add_argument("--json", action="store_true", help="print one JSON object and exit")
    stats.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for each request (default: 5)"
    )
    stats.set_defaults(default_config=default_config)
    return stats


def _address(args: argparse.Namespace) -> tuple[str, str | None]:
    """The API's base URL and the token to send."""
    if args.url:
        url = args.url if "://" in args.url else f"http://{args.url}"
        return url.rstrip("/"), args.token
    from hicache.config import load_deployment

    path = args.config if args.config is not None else args.default_config
    service = load_deployment(path).deployment.service
    if service.http_port is None:
        raise SidecarUnreachableError(
            f"{path}: service.http_port is not set, so that sidecar has no HTTP API; "
            "pass --url, or --config with an http_port"
        )
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(
        service.http_host, service.http_host
    )
    if ":" in host:
        host = f"[{host}]"
    token = args.token
    if token is None and service.token is not None:
        token = service.token.get_secret_value()
    return f"http://{host}:{service.http_port}", token


def _get(url: str, token: str | None, timeout: float, ok: tuple[int, ...] = (200,)) -> str:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return str(reply.read().decode())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        if exc.code in ok:
            return body
        raise SidecarUnreachableError(f"GET {url}: HTTP {exc.code}: {body.strip()[:200]}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SidecarUnreachableError(
            f"cannot reach the sidecar at {url}: {reason}; is `hicache serve` running with "
            "its HTTP API there? (--url, or --config's service.http_host / http_port)"
        ) from None


@dataclass
class Metrics:
    """Samples of a Prometheus text exposition: name -> [(labels, value)]."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        out = cls()
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            labels = dict(_LABEL.findall(m.group(2) or ""))
            out.samples.setdefault(m.group(1), []).append((labels, value))
        return out

    def by(self, name: str, label: str) -> dict[str, float]:
        return {labels.get(label, ""): v for labels, v in self.samples.get(name, [])}

    def value(self, name: str) -> float | None:
        found = self.samples.get(name)
        return found[0][1] if found else None


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """`histogram_quantile` over cumulative (upper bound, count) buckets: linear within the
    bucket the rank falls in; the last finite bound if it falls in +Inf; None when empty."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def snapshot(url: str, token: str | None, timeout: float) -> dict[str, Any]:
    """One reading of the sidecar: the figures the frame and `--json` show."""
    stats = json.loads(_get(url + "/v1/stats", token, timeout))
    metrics = Metrics.parse(_get(url + "/metrics", token, timeout))
    ready = json.loads(_get(url + "/readyz", token, timeout, ok=(200, 503)))
    tokens = metrics.by("hicache_lookup_tokens_total", "tier")
    pages = metrics.by("hicache_lookup_pages_total", "tier")

    def rates(counts: dict[str, float]) -> dict[str, float | None]:
        total = sum(counts.values())
        return {t: (counts.get(t, 0.0) / total if total else None) for t in ("l2", "l3", "miss")}

    buckets = [
        (float(labels["le"]), v)
        for labels, v in metrics.samples.get("hicache_layer_stall_seconds_bucket", [])
        if "le" in labels
    ]
    queues = metrics.by("hicache_queue_depth", "kind")
    l2 = []
    for ns in stats.get("namespaces", []):
        for group, g in ns.get("groups", {}).items():
            capacity = g.get("l2_capacity_pages", 0)
            l2.append(
                {
                    "namespace": ns.get("namespace"),
                    "group": group,
                    "pages": g.get("l2_pages", 0),
                    "capacity_pages": capacity,
                    "use": g.get("l2_pages", 0) / capacity if capacity else None,
                    "pinned_pages": g.get("pinned_pages", 0),
                    "l2_bytes": g.get("l2_bytes", 0),
                    "budget": g.get("l2_budget"),
                }
            )
    store = stats.get("l3")
    tenants = [_tenant_row(name, t) for name, t in stats.get("tenants", {}).items()]
    degraded = [d for d in ready.get("degraded", []) if d.get("tier") == "l3"]
    return {
        "url": url,
        "time": time.time(),
        "status": ready.get("status"),
        "sessions": len(stats.get("sessions", [])),
        "namespaces": len(stats.get("namespaces", [])),
        "namespace_states": sorted(
            f"{n.get('state')}: {len(n.get('sessions', []))} attached"
            + (f", {len(n['waiting_sessions'])} waiting" if n.get("waiting_sessions") else "")
            for n in stats.get("namespace_states", [])
        ),
        "lookup_tokens": {t: int(tokens.get(t, 0)) for t in ("l2", "l3", "miss")},
        "lookup_pages": {t: int(pages.get(t, 0)) for t in ("l2", "l3", "miss")},
        "hit_rate_tokens": rates(tokens),
        "hit_rate_pages": rates(pages),
        "queue_depth": {k: int(queues.get(k, 0)) for k in ("load", "backup")},
        "in_flight_bytes": int(metrics.value("hicache_inflight_bytes") or 0),
        "layer_stall_seconds": {
            "count": int(metrics.value("hicache_layer_stall_seconds_count") or 0),
            "sum": metrics.value("hicache_layer_stall_seconds_sum") or 0.0,
            **{f"p{round(q * 100)}": quantile(buckets, q) for q in QUANTILES},
        },
        "l2": l2,
        "tenants": tenants,
        "l3": None
        if store is None
        else {
            "kind": ready.get("l3"),
            "breaker": store.get("breaker"),
            "reason": (degraded[0].get("breaker") or {}).get("why") if degraded else None,
            "hits": store.get("hits", 0),
            "misses": store.get("misses", 0),
            "stored": store.get("stored", 0),
            "failures": store.get("failures", {}),
        },
    }


def _tenant_row(name: str, t: dict[str, Any]) -> dict[str, Any]:
    """One tenant's line: its lookups' L2 hit rate (tokens) and, on an L2 shared by tenants,
    its pages summed over ranks and groups (held, its holder's share, evicted)."""
    asked = t.get("lookup_tokens", {})
    total = sum(asked.values())
    groups = [g for rank in t.get("l2", {}).values() for g in rank.values()]
    return {
        "tenant": name,
        "holder": t.get("holder"),
        "lookup_tokens": total,
        "hit_rate_l2": asked.get("l2", 0) / total if total else None,
        "l2_pages": sum(g["held_pages"] for g in groups) if groups else None,
        "share_pages": sum(g["share_pages"] for g in groups) if groups else None,
        "evicted_pages": sum(g["evicted_pages"] for g in groups) if groups else None,
        "evicted_by_others_pages": (
            sum(g["evicted_by_others_pages"] for g in groups) if groups else None
        ),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def render(s: dict[str, Any], interval: float | None = None) -> str:
    from hicache.config.sizes import format_bytes

    stamp = time.strftime("%H:%M:%S", time.localtime(s["time"]))
    head = f"hicache stats  {s['url']}  {stamp}  {s['status']}"
    if interval is not None:
        head += f"  (every {interval:g}s, Ctrl-C to stop)"
    t, p = s["lookup_tokens"], s["hit_rate_tokens"]
    stall = s["layer_stall_seconds"]
    lines = [
        head,
        f"sessions {s['sessions']}  namespaces {s['namespaces']}"
        + (f" ({'; '.join(s['namespace_states'])})" if s.get("namespace_states") else ""),
        "",
        f"hit rate (tokens looked up: {sum(t.values()):,}):  L2 {_pct(p['l2'])}  "
        f"L3 {_pct(p['l3'])}  miss {_pct(p['miss'])}",
        f"hit rate (pages looked up: {sum(s['lookup_pages'].values()):,}):   "
        f"L2 {_pct(s['hit_rate_pages']['l2'])}  L3 {_pct(s['hit_rate_pages']['l3'])}  "
        f"miss {_pct(s['hit_rate_pages']['miss'])}",
        f"queue depth: loads {s['queue_depth']['load']}  backups {s['queue_depth']['backup']}"
        f"  in flight {format_bytes(s['in_flight_bytes'])}",
        f"layer stalls ({stall['count']:,} waits):  p50 {_seconds(stall['p50'])}  "
        f"p90 {_seconds(stall['p90'])}  p99 {_seconds(stall['p99'])}",
    ]
    l3 = s["l3"]
    if l3 is None:
        lines.append("L3: none")
    else:
        line = f"L3 ({l3['kind']}): breaker {l3['breaker']}"
        if l3["reason"]:
            line += f" ({l3['reason']})"
        line += f"  hits {l3['hits']:,}  misses {l3['misses']:,}  stored {l3['stored']:,}"
        failures = sum(l3["failures"].values())
        lines.append(line + (f"  failures {failures:,}" if failures else ""))
    lines += ["", "L2 per group:"]
    rows = [["namespace", "group", "pages", "capacity", "use", "pinned", "bytes"]]
    for g in s["l2"]:
        rows.append(
            [
                str(g["namespace"]),
                g["group"],
                f"{g['pages']:,}",
                f"{g['capacity_pages']:,}",
                _pct(g["use"]),
                f"{g['pinned_pages']:,}",
                format_bytes(g["l2_bytes"]),
            ]
        )
    if len(rows) == 1:
        lines.append("  (no namespace yet: no engine has said hello)")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            cells = [
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells))
    if s.get("tenants"):
        lines += ["", "Tenants (L2 pages summed over ranks and groups; - : L2 not shared):"]
        rows = [["tenant", "hit L2", "tokens", "pages", "share", "evicted", "by others"]]
        for t in s["tenants"]:
            rows.append(
                [
                    repr(t["tenant"]) + (" (rest)" if t["holder"] == "*" else ""),
                    _pct(t["hit_rate_l2"]),
                    f"{t['lookup_tokens']:,}",
                    *(
                        "-" if t[k] is None else f"{t[k]:,}"
                        for k in (
                            "l2_pages",
                            "share_pages",
                            "evicted_pages",
                            "evicted_by_others_pages",
                        )
                    ),
                ]
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            cells = [
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells))
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise HicacheError(f"--interval {args.interval}: allowed: a positive number of seconds")
    url, token = _address(args)
    first = snapshot(url, token, args.timeout)  # unreachable at first: one clear error, exit 2
    if args.json:
        print(json.dumps(first))
        return 0
    if args.once:
        print(render(first))
        return 0
    current: dict[str, Any] | None = first
    error = ""
    try:
        while True:
            frame = render(current, args.interval) if current else ""
            if error:
                frame += f"\n\n{error} (retrying)"
            sys.stdout.write(CLEAR + frame + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
            try:
                current, error = snapshot(url, token, args.timeout), ""
            except SidecarUnreachableError as exc:
                error = str(exc)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 0
