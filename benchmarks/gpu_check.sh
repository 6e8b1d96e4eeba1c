#!/usr/bin/env bash
# The CUDA check, for a machine with a GPU: gpu-marked tests, then the transfer benchmark on
# CUDA for both host layouts, then a short table. Uses that machine's own CUDA build of torch
# (python3), never the CPU wheel dev.py installs. Packages it lacks (pydantic, pytest-asyncio,
# msgpack, aiohttp, prometheus-client, PyYAML, xxhash, uvloop)
# can be carried as wheels in .whl/ (see README: "GPU check"); they are installed to /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "device", torch.cuda.get_device_name(0))
PYEOF
out=${OUT:-/tmp}
"$PY" -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
for layout in layer_first page_first; do
  "$PY" benchmarks/transfer.py --device cuda --layout "$layout" --move-mib 256 --trials 9 \
    | tee "$out/transfer_cuda_$layout.log"
done
"$PY" - "$out" <<'PYEOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("\n== CUDA transfer (ratio vs pinned contiguous cudaMemcpy; vs_loop = per-page loop / ours)")
for layout in ("layer_first", "page_first"):
    r = json.loads((out / f"transfer_cuda_{layout}.log").read_text().strip().splitlines()[-1])
    for p in (1, 16, 64, 256):
        loop = r.get(f"vs_loop_p{p}", "")
        print(f"{layout:<12} p{p:<4} backup {r[f'backup_ratio_p{p}']:.2f}  load {r[f'load_ratio_p{p}']:.2f}"
              f"  ({r[f'load_gbps_p{p}']} GB/s)  {('vs_loop ' + str(loop)) if loop else ''}")
PYEOF
