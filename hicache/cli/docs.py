"""Keep the generated sections of `docs/reference.md` current: the configuration reference
(from the schema) and the metrics reference (from a sidecar's registry). `python3 dev.py docs`
rewrites them; a test fails when the file and the generators disagree."""

from __future__ import annotations

import re
from pathlib import Path

from hicache.config.reference import config_reference
from hicache.service.metrics import metrics_reference

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
SECTIONS = {"config": config_reference, "metrics": metrics_reference}


def section_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- reference: {name} -->\n)(.*?)(<!-- end: {name} -->)", re.S)


def generated(name: str) -> str:
    return SECTIONS[name]()


def refresh_reference(path: Path = REFERENCE) -> bool:
    """Rewrite the generated sections; True when something changed."""
    text = path.read_text()
    new = text
    for name in SECTIONS:
        pattern = section_pattern(name)
        if not pattern.search(new):
            raise ValueError(f"{path}: no '<!-- reference: {name} -->' section")
        match = pattern.search(new)
        assert match is not None
        new = new[: match.start(2)] + generated(name) + new[match.end(2) :]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    print(f"{REFERENCE} updated" if refresh_reference() else f"{REFERENCE} already current")
