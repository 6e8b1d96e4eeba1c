"""Regenerate the README's images from real runs on this machine: the page-copy benchmark
for both host layouts (`transfer.py --plot`: `transfer_layer_first.png` / `.svg`,
`transfer_page_first.png` / `.svg`) and a `hicache demo` run's per-layer timeline
(`timeline.png`; its HTML page is left out: the README shows the PNG).

    python benchmarks/plots.py [--out docs/images] [--move-mib 32] [--trials 7]

Each step is a child process of this interpreter, run from the repository root; a step that
fails stops the script with its exit status, leaving the earlier images written. About a
minute on two cores at the defaults.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = ("layer_first", "page_first")


def step(argv: list[str]) -> None:
    print("$", " ".join(argv), flush=True)
    done = subprocess.run(argv, cwd=REPO, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)}: exit status {done.returncode}; images so far are kept")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--move-mib", type=int, default=32, help="transfer.py: bytes per op")
    parser.add_argument("--trials", type=int, default=7, help="transfer.py: trials")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for layout in LAYOUTS:
        step(
            [
                sys.executable,
                "benchmarks/transfer.py",
                "--layout",
                layout,
                "--move-mib",
                str(args.move_mib),
                "--trials",
                str(args.trials),
                "--plot",
                str(out),
            ]
        )
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "timeline"
        step([sys.executable, "-m", "hicache", "demo", "--timeline", str(base)])
        shutil.copyfile(base.with_suffix(".png"), out / "timeline.png")
    for name in sorted(p.name for p in out.glob("*.png")):
        print(f"{out / name}: {(out / name).stat().st_size} bytes")


if __name__ == "__main__":
    main()
