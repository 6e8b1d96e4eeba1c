"""The product never calls `asyncio.wait_for`: on Python 3.11 it drops a cancel that lands in
the step its inner call completes, and the cancelled task lives on (the async client's
heartbeat task kept a crashed engine's process alive; docs/design.md, "stop 39's CI").
`asyncio.timeout` keeps the cancel. Tests may use `wait_for` to bound a hang."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hicache"


def wait_for_calls(path: Path) -> list[int]:
    """Lines of `path` that call asyncio's wait_for (as `asyncio.wait_for` or imported)."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "asyncio"
        for alias in node.names
        if alias.name == "wait_for"
    }
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "wait_for"
            and isinstance(func.value, ast.Name)
            and func.value.id == "asyncio"
        ) or (isinstance(func, ast.Name) and func.id in imported):
            lines.append(node.lineno)
    return lines


def test_the_product_never_calls_asyncio_wait_for() -> None:
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in wait_for_calls(path)
    }
    assert not found, f"asyncio.wait_for at {sorted(found)}: use `async with asyncio.timeout(s)`"


def test_the_rule_sees_both_spellings(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import asyncio\nfrom asyncio import wait_for as wf\n"
        "async def f(c):\n    await asyncio.wait_for(c, 1)\n    await wf(c, 1)\n"
        "    await cond.wait_for(lambda: True)\n"
    )
    assert wait_for_calls(module) == [4, 5]
