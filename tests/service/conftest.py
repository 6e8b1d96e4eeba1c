"""Fixtures for the sidecar tests: a deployment file for a hybrid model (LFM2: conv state +
full attention) with a file L3 in the test's directory, and real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.client.process import SidecarProcess
from tests.conftest import REPO, shared_model


def write_config(tmp_path: Path, device: str = "cpu", **service: Any) -> Path:
    # Unix socket paths are limited to ~108 bytes; keep the socket short and in the test dir
    data = {
        "model": {"config_path": str(shared_model("lfm2_350m.json")), "page_size_tokens": 16},
        "device": {"kind": device},
        "host": {"capacity_bytes": "16MiB"},
        "storage": {"kind": "file", "path": str(tmp_path / "l3")},
        "cache": {"prefetch_policy": "wait_complete"},
        "service": {
            "socket_path": str(tmp_path / "e.sock"),
            "http_port": 0,
            "heartbeat_timeout_s": 2,
            **service,
        },
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    return write_config(tmp_path)


@pytest.fixture
def sidecar(deploy: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(deploy).start()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, (deploy.with_suffix(".serve.log")).read_text()


def engine(mode: str, config: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.service.engine_proc", mode, "--config", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def engine_result(proc: subprocess.Popen[str], timeout_s: float = 120) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"engine failed ({proc.returncode}):\n{err}\n{out}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def read_event(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"engine exited early: {proc.stderr.read() if proc.stderr else ''}"
    event: dict[str, Any] = json.loads(line)
    return event


def wait_persisted(proc: SidecarProcess, pages: int, timeout_s: float = 120.0) -> None:
    """Until the sidecar's persist workers have written at least `pages` pages in all and are
    idle (nothing waits, no batch is being written). A written page's L3 object is visible
    before its write returns and lets go of the L2 page (an L2 clear in between keeps the
    page, #32), so tests wait for these counters, never for the objects. The deadline only
    bounds a hang."""
    deadline = time.monotonic() + timeout_s
    persist: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        persist = [ns["persist"] for ns in proc.get_json("/v1/stats")["namespaces"]]
        written = sum(p["written_pages"] for p in persist)
        busy = sum(p["queued_pages"] + p["writing_pages"] for p in persist)
        if written >= pages and not busy:
            return
        time.sleep(0.02)
    raise AssertionError(f"the sidecar did not persist {pages} pages in {timeout_s} s: {persist}")
