#!/usr/bin/env bash
# The CUDA check, for a machine with a GPU: ALL gpu-marked tests (each listed pass / fail /
# skip), then the transfer benchmark on CUDA for both host layouts, then ONE table of
# everything (each test, each ratio, each step's status and time). Every step is bounded
# (`timeout`), and a step that fails or times out is recorded in the table, never stops it;
# the exit status is non-zero when any step failed. Budget: under 10 minutes on one GPU
# (tests <= 270 s, each benchmark <= 90 s, the checks before them seconds). Logs go to $OUT
# (default /tmp/hicache-gpu-check).
#
# Uses that machine's own CUDA build of torch (python3, or $PYTHON), never the CPU wheel
# dev.py installs; nothing is built but the native row-copy kernel (the system C compiler,
# on first use, as on the CPU). Pure-Python packages it lacks (on the lent H100/H200 image:
# pydantic, pydantic-core, annotated-types, typing-inspection, pytest-asyncio) can be
# carried as wheels in .whl/ (docs/benchmarks.md, "GPU check", says how to fetch them);
# they are installed to /tmp/site. The `deps` step names any still missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-/tmp/hicache-gpu-check}
mkdir -p "$out"
TEST_LIMIT_S=${TEST_LIMIT_S:-270}
BENCH_LIMIT_S=${BENCH_LIMIT_S:-90}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$out/pip.log" 2>&1 || echo "pip install of .whl/ failed (see $out/pip.log)"
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

# step NAME LIMIT_S CMD...: run bounded, log to $out/NAME.log, status and seconds to NAME.rc
step() {
  local name=$1 limit=$2 rc=0 t0
  shift 2
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  echo "$rc $(($(date +%s) - t0))" >"$out/$name.rc"
  echo "[gpu_check] $name: rc=$rc in $(($(date +%s) - t0))s (log: $out/$name.log)"
}

step device 60 "$PY" -c '
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
      "x", torch.cuda.device_count())
'
step deps 60 "$PY" -c '
import importlib.util, sys
need = {"pydantic": "pydantic pydantic-core annotated-types typing-inspection",
        "pytest": "pytest", "pytest_asyncio": "pytest-asyncio", "msgpack": "msgpack",
        "aiohttp": "aiohttp", "prometheus_client": "prometheus-client", "yaml": "PyYAML",
        "xxhash": "xxhash", "numpy": "numpy"}
missing = [wheel for module, wheel in need.items() if importlib.util.find_spec(module) is None]
if missing:
    sys.exit("missing: " + " ".join(missing) + "; carry their wheels in .whl/ (docs/benchmarks.md, GPU check)")
print("all of", ", ".join(need), "import")
'
# each test bounded too where pytest-timeout is there (the lent image has it): a test that
# hangs fails alone, and the others still report
per_test=()
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then per_test=(--timeout=120); fi
step gpu_tests "$TEST_LIMIT_S" "$PY" -m pytest -v -m gpu tests -p no:cacheprovider -rfE \
  "${per_test[@]}" --junitxml="$out/gpu_tests.xml"
for layout in layer_first page_first; do
  step "transfer_cuda_$layout" "$BENCH_LIMIT_S" "$PY" benchmarks/transfer.py --device cuda \
    --layout "$layout" --move-mib 256 --trials 9
done

overall=0
"$PY" - "$out" <<'PYEOF' || overall=$?
import json, pathlib, sys
import xml.etree.ElementTree as ET

out = pathlib.Path(sys.argv[1])
failed_steps = 0


def status(name):
    global failed_steps
    try:
        rc, secs = (out / f"{name}.rc").read_text().split()
    except (OSError, ValueError):
        failed_steps += 1
        return "not run"
    if rc != "0":
        failed_steps += 1
        what = "TIMEOUT" if rc in ("124", "137") else f"FAILED rc={rc}"
        return f"{what} {secs}s"
    return f"ok {secs}s"


def last_json(name):
    try:
        for line in reversed((out / f"{name}.log").read_text().splitlines()):
            if line.startswith("{"):
                return json.loads(line)
    except (OSError, ValueError):
        pass
    return None


def fmt(value, spec=".2f"):
    return "-" if value is None or value == "" else (format(value, spec) if isinstance(value, (int, float)) else str(value))


rows = []  # (item, backup, load, churn backup, churn load, vs_loop, GB/s, status)
device_log = (out / "device.log").read_text().strip().splitlines() if (out / "device.log").exists() else []
rows.append(("device", "", "", "", "", "", "", status("device") + ("  " + device_log[-1] if device_log else "")))
deps_log = (out / "deps.log").read_text().strip().splitlines() if (out / "deps.log").exists() else []
rows.append(("deps", "", "", "", "", "", "", status("deps") + ("  " + deps_log[-1] if deps_log else "")))

tests = "no junit report"
failures = []
cases = []  # (pass / FAIL / skip, test id and seconds), every gpu-marked test
try:
    root = ET.parse(out / "gpu_tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    tests = f"{n - f - e - s} passed, {f} failed, {e} errors, {s} skipped"
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failures.append(name)
            verdict = "FAIL"
        elif case.find("skipped") is not None:
            verdict = "skip"
        else:
            verdict = "pass"
        cases.append((verdict, f"{name} ({float(case.get('time', 0)):.1f}s)"))
except (OSError, ET.ParseError, AttributeError):
    # no report (the step was killed at its limit): the verdicts pytest -v printed so far
    try:
        import re
        said = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED)\b")
        for text in (out / "gpu_tests.log").read_text().splitlines():
            word, node = said.search(text), [t for t in text.split() if "::" in t]
            if word and node and not text.startswith(("FAILED ", "ERROR ")):  # not -rfE's summary
                verdict = {"PASSED": "pass", "SKIPPED": "skip"}.get(word.group(1), "FAIL")
                cases.append((verdict, node[0]))
                if verdict == "FAIL":
                    failures.append(node[0])
    except OSError:
        pass
rows.append(("gpu tests", "", "", "", "", "", "", f"{status('gpu_tests')}: {tests}"))


for layout in ("layer_first", "page_first"):
    name = f"transfer_cuda_{layout}"
    state = status(name)
    r = last_json(name)
    rows.append((f"transfer {layout}", "", "", "", "", "", "", state if r else state + " (no JSON result)"))
    if not r:
        continue
    for p in (1, 16, 64, 256):
        if f"backup_ratio_p{p}" not in r:
            continue
        rows.append((
            f"  {layout} p{p}",
            fmt(r.get(f"backup_ratio_p{p}")),
            fmt(r.get(f"load_ratio_p{p}")),
            fmt(r.get(f"churn_backup_ratio_p{p}")),
            fmt(r.get(f"churn_load_ratio_p{p}")),
            fmt(r.get(f"vs_loop_p{p}")),
            fmt(r.get(f"load_gbps_p{p}"), ".1f"),
            f"baseline {fmt(r.get(f'baseline_gbps_p{p}'), '.1f')} GB/s",
        ))

head = ("item", "backup", "load", "churn bk", "churn ld", "vs_loop", "GB/s", "status")
widths = [max(len(str(row[i])) for row in (head, *rows)) for i in range(len(head) - 1)]
line = lambda row: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + "  " + str(row[-1])
print("\n== hicache GPU check (ratios: ours / pinned contiguous cudaMemcpy of the same bytes; "
      "vs_loop: a per-page copy loop's time / ours)")
print(line(head))
print("-" * (sum(widths) + 2 * len(widths) + 6))
for row in rows:
    print(line(row))
print(f"\n== every gpu-marked test ({len(cases)}): pass / FAIL / skip")
for verdict, name in cases:
    print(f"{verdict:<5} {name}")
sys.exit(1 if failed_steps or failures else 0)
PYEOF
echo "[gpu_check] logs in $out; exit $overall"
exit "$overall"
