"""Many engines, one namespace, against a real `hicache serve`: engine processes of one model,
tenant and tp_rank attach side by side (once the second was refused at hello), each with its
own pools; one hits and loads byte-exact what another stored; one SIGKILLed mid-load takes
only its own loads, pins and pools with it while the other keeps storing and loading; another
tenant stays isolated; nothing stays pinned, reserved or attached once all have gone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.client.process import SidecarProcess
from tests.service.conftest import engine, engine_result, read_event

DEADLINE_S = 60.0  # for anything awaited here; generous for a loaded machine


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Every engine process a test starts; killed and reaped at its end, even on failure."""
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in started:
            with contextlib.suppress(Exception):
                proc.communicate(timeout=30)


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def namespace(sidecar: SidecarProcess, name: str) -> dict[str, Any]:
    for ns in sidecar.get_json("/v1/stats")["namespaces"]:
        if ns["namespace"] == name:
            found: dict[str, Any] = ns
            return found
    raise AssertionError(f"no namespace {name}")


def quiet(ns: dict[str, Any]) -> bool:
    """Nothing pinned (index or host pool), nothing reserved, no attachment left."""
    return (
        not ns["attached_sessions"]
        and ns["attachments"] == 0
        and all(
            g["pinned_pages"] == g["host_pinned_pages"] == g["reserved_pages"] == 0
            for g in ns["groups"].values()
        )
    )


def totals(status: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(status.read_text()) if status.exists() else {}
    return data


def bystander(
    deploy: Path, tmp: Path, name: str, *args: str
) -> tuple[subprocess.Popen[str], Path, Path]:
    status, until = tmp / f"{name}.json", tmp / f"{name}.stop"
    proc = engine(
        "bystander", deploy, "--prompts", "3", "--until", str(until), "--status", str(status), *args
    )
    return proc, status, until


def test_a_second_engine_loads_what_the_first_stored_while_both_are_attached(
    sidecar: SidecarProcess, deploy: Path, procs: list[subprocess.Popen[str]]
) -> None:
    first = engine("load-loop", deploy)  # stores prompt 0, then loads it again and again
    procs.append(first)
    session_a = read_event(first)["session"]
    assert read_event(first)["event"] == "looping"
    second = engine("verify", deploy, "--prompts", "1")
    procs.append(second)
    assert read_event(second)["event"] == "registered"  # refused here once
    result = engine_result(second)
    assert result == {"verified": 7, "mismatches": 0, "prompts_hit": 1}
    assert first.poll() is None  # attached all along, loading
    ns = wait_for(
        lambda: (
            (ns := namespace(sidecar, "tp_rank=0 tenant=''"))["attached_sessions"] == [session_a]
            and ns
        ),
        "the second engine's session to end",
    )
    assert ns["attachments"] == 1


def test_an_engine_killed_mid_load_takes_only_its_own_pins(
    sidecar: SidecarProcess, deploy: Path, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    victim = engine("load-loop", deploy)
    procs.append(victim)
    victim_session = read_event(victim)["session"]
    assert read_event(victim)["event"] == "looping"
    # B shares the victim's namespace (the same system prompt starts every prompt); C is
    # another tenant
    b, b_status, b_until = bystander(deploy, tmp_path, "b", "--first", "10")
    c, c_status, c_until = bystander(deploy, tmp_path, "c", "--first", "20", "--tenant", "other")
    procs += [b, c]
    b_session = read_event(b)["session"]
    read_event(c)
    wait_for(lambda: totals(b_status).get("rounds", 0) >= 2, "B's first rounds")
    wait_for(lambda: totals(c_status).get("rounds", 0) >= 2, "C's first rounds")
    shared = "tp_rank=0 tenant=''"
    assert sorted(namespace(sidecar, shared)["attached_sessions"]) == sorted(
        [victim_session, b_session]
    )
    os.kill(victim.pid, signal.SIGKILL)  # mid-load: it does nothing else
    victim.wait(timeout=DEADLINE_S)
    ns = wait_for(
        lambda: (ns := namespace(sidecar, shared))["attached_sessions"] == [b_session] and ns,
        "the victim's session to end",
    )
    assert ns["attachments"] == 1  # B's pools only
    after = totals(b_status)["rounds"]
    wait_for(lambda: totals(b_status)["rounds"] >= after + 3, "B's rounds after the kill")
    b_until.touch()
    c_until.touch()
    for proc in (b, c):
        final = engine_result(proc, DEADLINE_S)
        assert (final["errors"], final["mismatches"], final["short"]) == (0, 0, 0), final
        assert final["verified"] > 0
    # every engine gone: nothing pinned, reserved or attached (L3 writes behind the acked
    # stores pin their pages while they read them, and let go when written)
    for name in (shared, "tp_rank=0 tenant='other'"):
        wait_for(lambda name=name: quiet(namespace(sidecar, name)), f"{name} to be quiet")
    # tenants stay apart: C's prompts hit in C's tenant only, B's in B's only (a hybrid
    # model's hit needs the conv snapshot of the whole prompt: no partial hits here)
    own = engine_result(
        engine("verify", deploy, "--first", "20", "--prompts", "3", "--tenant", "other")
    )
    assert (own["prompts_hit"], own["mismatches"]) == (3, 0)
    seen = engine_result(engine("verify", deploy, "--first", "20", "--prompts", "3"))
    assert seen["prompts_hit"] == 0
    own = engine_result(engine("verify", deploy, "--first", "10", "--prompts", "3"))
    assert (own["prompts_hit"], own["mismatches"]) == (3, 0)
    seen = engine_result(
        engine("verify", deploy, "--first", "10", "--prompts", "3", "--tenant", "other")
    )
    assert seen["prompts_hit"] == 0
