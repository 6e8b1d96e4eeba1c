"""`python -m hicache.defaults configs/default.yaml`: regenerate the packaged default."""

import sys
from pathlib import Path

from hicache.defaults import default_config_path, packaged_text

if len(sys.argv) != 2:
    sys.exit("usage: python -m hicache.defaults configs/default.yaml")
target = default_config_path()
target.write_text(packaged_text(Path(sys.argv[1]).read_text()))
print(f"wrote {target}")
