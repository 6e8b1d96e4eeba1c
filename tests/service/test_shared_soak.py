"""The many-engines soak (issue #25): `ENGINES` real engine processes of one namespace against
a real `hicache serve`, storing and loading overlapping prompts concurrently for `SOAK_S`
seconds (`soak_engine.py`); every loaded byte is checked against what its tokens determine.
At the end, with the engines still attached, no session holds an unreleased load; once all
have detached, the namespace has no pinned page (index or host pool), no page reserved by an
op, no attachment left, no failed op and no background error."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
from pathlib import Path
from typing import Any

from hicache.client.process import SidecarProcess
from tests.conftest import REPO
from tests.service.conftest import write_config
from tests.service.test_shared_namespace import namespace, quiet, wait_for

SOAK_S = 30.0  # the duration
ENGINES = 4
SHARED = "tp_rank=0 tenant=''"
LINE_TIMEOUT_S = SOAK_S + 180.0  # an engine's totals come SOAK_S after it registered


def soak_engine(config: Path, seed: int, until: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.service.soak_engine",
            "--config",
            str(config),
            "--seconds",
            str(SOAK_S),
            "--seed",
            str(seed),
            "--until",
            str(until),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """The engine's next JSON line, within `timeout_s` (a hung engine fails the test)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout_s), f"engine {proc.pid} said nothing for {timeout_s} s"
    line = proc.stdout.readline()
    assert line, f"engine {proc.pid} exited early: {proc.stderr.read() if proc.stderr else ''}"
    event: dict[str, Any] = json.loads(line)
    return event


def quiet_namespace(sidecar: SidecarProcess) -> dict[str, Any] | None:
    ns = namespace(sidecar, SHARED)
    return ns if quiet(ns) else None


def test_four_engines_of_one_namespace_soak(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    until = tmp_path / "stop"
    procs: list[subprocess.Popen[str]] = []
    with SidecarProcess(config) as sidecar:
        try:
            procs = [soak_engine(config, seed, until) for seed in range(ENGINES)]
            sessions = [read_line(p, 120)["session"] for p in procs]
            results = [read_line(p, LINE_TIMEOUT_S) for p in procs]
            # all still attached: one namespace, four attachments, no load left unreleased
            ns = namespace(sidecar, SHARED)
            assert sorted(ns["attached_sessions"]) == sorted(sessions)
            assert ns["attachments"] == ENGINES
            engines = sidecar.get_json("/v1/stats")["sessions"]
            assert sorted(s["id"] for s in engines) == sorted(sessions)
            assert all(s["loads_unreleased"] == 0 for s in engines), engines
            until.touch()
            for proc in procs:
                _, err = proc.communicate(timeout=60)
                assert proc.returncode == 0, err
            wait_for(lambda: not sidecar.get_json("/v1/stats")["sessions"], "sessions to end")
            ns = wait_for(lambda: quiet_namespace(sidecar), "the namespace to be quiet")
            assert ns["background_errors"] == 0
            assert ns["ops_by_state"].get("failed", 0) == 0, ns["ops_by_state"]
            assert ns["ops_by_state"].get("expired", 0) == 0, ns["ops_by_state"]
        finally:
            until.touch()
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    proc.communicate(timeout=30)
    for result in results:
        assert (result["errors"], result["mismatches"]) == (0, 0), result
        assert result["stores"] > 0
        assert result["hits"] > 0
        assert result["verified"] > 0
    assert sum(r["foreign_hits"] for r in results) > 0, results  # pages another engine stored
    print(json.dumps({"soak_s": SOAK_S, "engines": results}))
