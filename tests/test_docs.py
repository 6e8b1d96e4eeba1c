"""The README's runnable example runs as written, and docker/ references files that exist."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def run_readme_example(name: str) -> subprocess.CompletedProcess[str]:
    """Run the README's `<!-- example: NAME -->` Python block as written, from the repo root."""
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"README lost its {name} example"
    return subprocess.run(
        [sys.executable, "-c", match.group(1)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_readme_embedded_example_runs() -> None:
    result = run_readme_example("embedded")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("done ")
    assert int(result.stdout.split()[1]) > 0


def test_readme_quick_start_is_exactly_two_commands() -> None:
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", text, re.S)
    assert block
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["python3 dev.py demo", "python3 dev.py test"]
    assert "python3 dev.py test" in (REPO / ".ci" / "run").read_text()


def test_docker_copies_only_existing_paths() -> None:
    dockerfiles = sorted((REPO / "docker").glob("Dockerfile*"))
    assert dockerfiles
    for dockerfile in dockerfiles:
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                *sources, _dest = line.split()[1:]
                for source in sources:
                    assert (REPO / source).exists(), f"{dockerfile.name}: {source} missing"
            if line.startswith("USER "):
                assert line.split()[1] not in ("root", "0")


def test_readme_client_example_runs_twice_against_one_sidecar(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hicache.service.process import SidecarProcess

    # the README's server command, on the default config (its socket), L3 and HTTP moved aside
    env = {"HICACHE_STORAGE__PATH": str(tmp_path / "l3"), "HICACHE_SERVICE__HTTP_PORT": "0"}
    with SidecarProcess(REPO / "configs" / "default.yaml", env=env, log_path=tmp_path / "s.log"):
        first = run_readme_example("client")
        second = run_readme_example("client")  # a user runs it again: the first run's pages hit
    for result in (first, second):
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[-1] == "done 64 tokens loaded"
    assert "tokens_total=0" in first.stdout.splitlines()[0]
    assert "tokens_total=64" in second.stdout.splitlines()[0]


def test_readme_generated_references_are_current() -> None:
    from hicache.cli.docs import SECTIONS, generated, section_pattern

    text = (REPO / "README.md").read_text()
    for name in SECTIONS:
        match = section_pattern(name).search(text)
        assert match, f"README lost its {name} reference"
        assert match.group(2) == generated(name), f"run `python3 dev.py docs` ({name})"
