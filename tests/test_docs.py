"""The README's runnable example runs as written, and docker/ references files that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
    from hicache.client.process import SidecarProcess

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


def test_generated_references_are_current() -> None:
    from hicache.cli.docs import REFERENCE, SECTIONS, generated, section_pattern

    assert REFERENCE == REPO / "docs" / "reference.md"
    text = REFERENCE.read_text()
    for name in SECTIONS:
        match = section_pattern(name).search(text)
        assert match, f"docs/reference.md lost its {name} reference"
        assert match.group(2) == generated(name), f"run `python3 dev.py docs` ({name})"


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces
    to hyphens."""
    words = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return words.replace(" ", "-")


def markdown_links(path: Path) -> list[tuple[str, str]]:
    """(target path, fragment) of every relative link and image in a Markdown file."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, fragment = target.partition("#")
        out.append((file, fragment))
    return out


def test_every_relative_link_in_the_docs_resolves() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        for file, fragment in markdown_links(page):
            target = (page.parent / file).resolve() if file else page
            assert target.exists(), f"{page.relative_to(REPO)}: link to missing {file}"
            if fragment:
                headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
                anchors = {github_anchor(h) for h in headings}
                assert fragment in anchors, (
                    f"{page.relative_to(REPO)}: #{fragment} is no heading of "
                    f"{target.relative_to(REPO)}; headings: {sorted(anchors)}"
                )
            checked += 1
    assert checked >= 10  # the README links its docs and images


def test_readme_is_a_tutorial_with_the_reference_in_docs() -> None:
    text = (REPO / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[:2] == ["Quick start", "Tutorial"]
    assert len(text.splitlines()) < 320  # reference tables and benchmark logs live in docs/
    assert "<!-- reference:" not in text
    assert "| `hicache_" not in text
    for page in ("engines.md", "reference.md", "deployment.md", "benchmarks.md"):
        assert f"(docs/{page}" in text, f"README does not link docs/{page}"
    assert "](docs/images/timeline.png)" in text


def test_readme_code_layout_names_every_package_of_the_tree() -> None:
    """The README's code layout is the tree: each package under hicache/ named once, and no
    name that is not a package (a package added, moved or removed fails here)."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"## Code layout\n.*?```\n(.*?)```", text, re.S)
    assert match, "README lost its Code layout section"
    named = set(re.findall(r"[a-z]+", re.sub(r"\([^)]*\)", "", match.group(1))))  # no remarks
    packages = {
        path.name
        for path in (REPO / "hicache").iterdir()
        if path.is_dir() and (path / "__init__.py").exists() and path.name != "defaults"
    } | {"embedded"}  # a module of its own floor
    assert named == packages, (
        f"README's code layout names {sorted(named - packages)} that are no packages and "
        f"misses {sorted(packages - named)}"
    )
