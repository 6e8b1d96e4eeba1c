"""The package's import rules (docs/structure.md), read from the source of every module under
hicache/ (imports inside functions and `TYPE_CHECKING` blocks count too)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hicache"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from hicache import service` imports hicache.service
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            found.append((node.lineno, base))
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(
    importers: tuple[str, ...], allowed: tuple[str, ...], target: str, root: Path = PACKAGE
) -> list[str]:
    """Imports of `target` by modules under `importers` (all of the package at `root` when
    empty), except by modules under `allowed`."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        if importers and not any(_within(name, p) for p in importers):
            continue
        if any(_within(name, p) for p in allowed):
            continue
        bad += [
            f"{path.relative_to(root.parent)}:{line} imports {module}"
            for line, module in _imports(path, root)
            if _within(module, target)
        ]
    return sorted(set(bad))


def test_only_the_cli_the_service_and_the_harness_import_the_service() -> None:
    allowed = ("hicache.service", "hicache.cli", "hicache.testing")
    assert _violations((), allowed, "hicache.service") == []


def test_the_product_never_imports_the_harness() -> None:
    """Test harnesses live in hicache.testing only, so nothing a deployment runs reads a test
    switch or builds a fake."""
    assert _violations((), ("hicache.testing",), "hicache.testing") == []
    for module in ("local_servers", "netns_hosts", "faulty_storage", "fake_copies", "serve"):
        assert (PACKAGE / "testing" / f"{module}.py").is_file()


def test_the_channel_imports_neither_end() -> None:
    for end in ("hicache.service", "hicache.client", "hicache.demo", "hicache.integrations"):
        assert _violations(("hicache.channel",), (), end) == []


def test_the_service_does_not_import_the_engine_side() -> None:
    for end in ("hicache.client", "hicache.demo", "hicache.integrations", "hicache.cli"):
        assert _violations(("hicache.service",), (), end) == []


def test_the_connection_talks_to_a_dispatcher_not_to_the_server() -> None:
    """connection.py knows the server only as `service/dispatch.py`'s protocol: no import of
    server.py (no `TYPE_CHECKING` one either), so the two form no cycle."""
    assert _violations(("hicache.service.connection",), (), "hicache.service.server") == []
    assert (PACKAGE / "service" / "connection.py").is_file()
    assert "hicache.service.dispatch" in {
        m for _, m in _imports(PACKAGE / "service" / "connection.py", PACKAGE)
    }


def test_the_rule_sees_an_import(tmp_path: Path) -> None:
    """The reader finds absolute, relative, `from hicache import` and function-local imports."""
    root = tmp_path / "hicache"
    (root / "client").mkdir(parents=True)
    (root / "client" / "probe.py").write_text(
        "from . import base\n"
        "from hicache import service\n"
        "def f():\n"
        "    from ..service.app import serve\n"
        "    import hicache.service.ops\n"
    )
    assert _violations(("hicache.client",), (), "hicache.service", root) == [
        "hicache/client/probe.py:2 imports hicache.service",
        "hicache/client/probe.py:4 imports hicache.service.app",
        "hicache/client/probe.py:4 imports hicache.service.app.serve",
        "hicache/client/probe.py:5 imports hicache.service.ops",
    ]
    assert _violations(("hicache.client",), ("hicache.client",), "hicache.service", root) == []
