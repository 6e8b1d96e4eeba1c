"""How the suite's tests share pytest-xdist workers (tests/conftest.py): a module's tests
stay together unless the module is split, and a split names only tests that exist."""

from __future__ import annotations

import ast

from tests.conftest import EACH_ITS_OWN, REPO, SPLIT_MODULES, xdist_group_of


def test_a_module_stays_on_one_worker_unless_split() -> None:
    assert xdist_group_of("tests/service/test_hostile.py::test_x[a]") == (
        "tests/service/test_hostile.py"
    )
    vllm = "tests/integrations/test_vllm.py"
    assert xdist_group_of(f"{vllm}::test_hits_from_l2_and_l3_equal_recompute[llama]") == (
        f"{vllm}:part1"
    )
    assert xdist_group_of(f"{vllm}::test_detector_other_weights_x[llama]") == f"{vllm}:part1"
    assert xdist_group_of(f"{vllm}::test_tensor_parallel_ranks_x") == vllm
    one = "tests/test_demo.py::test_demo_passes_at_its_defaults_for_every_model[lfm2_350m]"
    assert xdist_group_of(one) == one
    assert xdist_group_of("tests/test_demo.py::test_trace_is_x") == "tests/test_demo.py"


def test_every_split_names_tests_that_exist() -> None:
    """A renamed test would silently fall back into its module's group: the split must
    name functions the module defines."""
    for module, parts in SPLIT_MODULES.items():
        tree = ast.parse((REPO / module).read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        for prefixes in parts:
            for prefix in prefixes:
                assert any(n.startswith(prefix) for n in names), (module, prefix)
    for nodeid in EACH_ITS_OWN:
        module, _, name = nodeid.partition("::")
        tree = ast.parse((REPO / module).read_text())
        assert name.rstrip("[") in [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
