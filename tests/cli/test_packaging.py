"""The default deployment ships inside the package: a wheel holds it (and the model config it
names), an installed copy's `hicache serve` default lies inside that package and serves
outside any repository, and the packaged copy is the repository's `configs/default.yaml` with
only its state paths moved."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

import hicache
from hicache.defaults import default_config_path, packaged_text
from tests.conftest import CONFIGS, REPO

PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q")
PACKAGED = ("hicache/defaults/default.yaml", "hicache/defaults/models/gpt-oss-20b.json")


def test_packaged_default_matches_configs_default() -> None:
    repo_text = (CONFIGS / "default.yaml").read_text()
    packaged = default_config_path()
    assert packaged.read_text() == packaged_text(repo_text), (
        "hicache/defaults/default.yaml is stale: run "
        "`python -m hicache.defaults configs/default.yaml`"
    )
    ours, theirs = yaml.safe_load(packaged.read_text()), yaml.safe_load(repo_text)
    assert ours["storage"].pop("path") == "~/.cache/hicache/l3"
    assert ours["service"].pop("socket_path") == "~/.cache/hicache/engine.sock"
    theirs["storage"].pop("path")
    theirs["service"].pop("socket_path")
    assert ours == theirs  # the same deployment otherwise
    model = theirs["model"]["config_path"]
    assert (packaged.parent / model).read_bytes() == (CONFIGS / model).read_bytes()


def test_cli_default_is_the_packaged_file() -> None:
    from hicache.cli.main import DEFAULT_CONFIG

    assert default_config_path() == DEFAULT_CONFIG
    assert DEFAULT_CONFIG.is_relative_to(Path(hicache.__file__).parent)
    assert DEFAULT_CONFIG.exists()


def test_wheel_ships_the_default_and_serves_it_outside_a_repo(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside it
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "hicache", src / "hicache", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheels"
    build = subprocess.run(
        [*PIP_WHEEL, "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = out.glob("hicache-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert set(PACKAGED) <= names
        site = tmp_path / "site"
        zf.extractall(site)  # a pure-Python wheel: unpacked is installed
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "elsewhere"  # no configs/ here, no repository above
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HOME": str(home)}
    env["HICACHE_SERVICE__HTTP_PORT"] = "0"
    where = subprocess.run(
        [sys.executable, "-c", "import hicache.cli.main as m; print(m.DEFAULT_CONFIG)"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=60,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == site / "hicache/defaults/default.yaml"
    serve = subprocess.Popen(
        [sys.executable, "-m", "hicache", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=work,
        env=env,
    )
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        assert line.startswith("hicache serve: ready"), serve.communicate(timeout=30)
        fields = dict(part.split("=", 1) for part in line.split()[3:] if "=" in part)
        assert fields["socket"] == str(home / ".cache/hicache/engine.sock")
        assert fields["model_name"].startswith(str(site / "hicache/defaults/models"))
    finally:
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err
    assert (home / ".cache/hicache/l3").is_dir()
