"""Structured logs: one line per event, as `key=value` text or one JSON object per line.

Events pass their fields as `log.info("session ended", extra={"fields": {...}})`; the formatter
puts them after the message (text) or beside it (JSON). Nothing on the per-page hot path logs.

The sidecar's events: `serving` (socket, ports, model, L3), `session started` (session, pid,
tp_rank, tenant, role, engine, transport) and `session ended` (the same ids, the reason, loads
cancelled); `refused` (warning: session, pid, op, code, reason — once per refused hello or pool
registration, or any request before hello, or any `refused` reply; never the token) and
`connection refused` (draining, or at `service.max_sessions`); `engine missed heartbeats`;
`draining` and `stopped` (loads finished and cancelled, pages flushed to L3, pages and bytes
still unflushed when `service.drain_timeout_s` ran out); `engine memory prefaulted` (session,
pid, bytes, seconds, stopped: the sidecar's page tables for a registered pool filled in a
thread) and, as a warning, `engine memory not prefaulted` (session, pid, reason).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool):
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {}) or {}
        if self.as_json:
            event: dict[str, Any] = {
                "ts": round(record.created, 6),
                "level": record.levelname.lower(),
                "logger": record.name,
                "event": record.getMessage(),
                **fields,
            }
            if record.exc_info:
                event["exception"] = self.formatException(record.exc_info)
            return json.dumps(event, default=str)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [f"{stamp}Z {record.levelname.lower():7} {record.getMessage()}"]
        parts += [f"{k}={v}" for k, v in fields.items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(fmt: Literal["text", "json"] = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(fmt == "json"))
    root = logging.getLogger("hicache")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
