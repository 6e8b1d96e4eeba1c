"""`python -m hicache.testing.serve`: the real sidecar on a fake copy backend. Its copy faults
are checked before anything starts and refused by name; a deployment that is not CPU is
refused. (That the faults really reach an engine: tests/service/test_layer_failure.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.config import load_deployment
from hicache.errors import ConfigError
from hicache.testing.fake_copies import FakeCopyBackend
from hicache.testing.serve import command, copy_faults
from tests.service.conftest import write_config

BAD_SPECS = [
    (
        "[2]",
        r"'\[2\]'; a JSON object with keys from \['backup_hold_path', 'backup_layer_delay_s', "
        r"'fail_load_layers', 'load_layer_delay_s'\]",
    ),
    ('{"backup_hold_path": 3}', r"backup_hold_path 3; a file path"),
    ('{"fail_load_layers": [-1]}', r"fail_load_layers \[-1\]; a list of layer positions >= 0"),
    ('{"load_layer_delay_s": "1"}', r"load_layer_delay_s '1'; a number of seconds >= 0"),
    ('{"backup_layer_delay_s": -1}', r"backup_layer_delay_s -1; a number of seconds >= 0"),
    ("{", r"'\{' is not JSON \(Expecting property name enclosed in double quotes\)"),
]


def test_the_factory_builds_the_fake_with_its_faults(tmp_path: Path) -> None:
    factory = copy_faults(
        '{"fail_load_layers": [2], "load_layer_delay_s": 0.01, "backup_layer_delay_s": 0.02}'
    )
    made = factory(load_deployment(write_config(tmp_path)))
    try:
        assert isinstance(made, FakeCopyBackend)
        assert made.fail_load_layers == frozenset({2})
        assert made.load_layer_delay_s == 0.01
        assert made.backup_layer_delay_s == 0.02
    finally:
        made.close()


def test_a_cuda_deployment_is_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path, device="cuda")
    with pytest.raises(
        ConfigError,
        match=r"^--copy-faults \(test-only copy faults\) is given but device\.kind is 'cuda' "
        rf"\({config}\); the fake copy backend is CPU only$",
    ):
        copy_faults("{}")(load_deployment(config))


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS)
def test_a_bad_spec_is_refused_before_anything_starts(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^--copy-faults \(test-only copy faults\): {message}$"):
        copy_faults(spec)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=dict(os.environ))


def test_the_entry_point_exits_2_on_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    done = _run([*command({"fail_load_layers": [-1]}), "--config", str(config)])
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "hicache: error: --copy-faults (test-only copy faults): fail_load_layers [-1]; a list "
        "of layer positions >= 0\n"
    )
    assert not (tmp_path / "e.sock").exists()  # nothing started
    cuda = write_config(tmp_path, device="cuda")
    done = _run([*command({}), "--config", str(cuda)])
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]  # past the logs
    assert errors == [
        "hicache: error: --copy-faults (test-only copy faults) is given but device.kind is "
        f"'cuda' ({cuda}); the fake copy backend is CPU only"
    ], done.stderr
    assert command({})[:3] == [sys.executable, "-m", "hicache.testing.serve"]
