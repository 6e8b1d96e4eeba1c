"""The one door to matplotlib, an optional extra (`pip install 'hicache[plots]'`; `dev.py`
installs it): the demo's timeline and the benchmarks' charts draw through it, and without it the
demo still runs and says how to get the pictures.

Lifecycle of a picture: `require()` (raises `PlotsUnavailable`, an ImportError whose message
says what to install, when matplotlib is missing) -> `new_figure(width_in, height_in)` (a
`Figure` on its own Agg canvas: no pyplot, no global figure registry, no display) -> the caller
draws on its axes -> `save(figure, path)` (PNG or SVG by the path's suffix) or `svg_markup`
(the SVG as text, for an HTML page) as often as wanted. Output is deterministic: no dates or
software versions in the files, SVG ids from a fixed salt, text kept as `<text>` in SVGs (smaller,
searchable, and what the tests read).
"""

from __future__ import annotations

import io
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

INSTALL_HINT = "pip install 'hicache[plots]' (python3 dev.py installs it)"
DPI = 100
SAVE_FORMATS = ("png", "svg")

# around every save (with `_METADATA`): text as text in SVGs, stable ids, no timestamps
_METADATA: dict[str, dict[str, Any]] = {
    "png": {"Software": None},
    "svg": {"Date": None, "Creator": None},
}


class PlotsUnavailable(ImportError):
    """matplotlib is not installed: the message says how to get the pictures."""


def available() -> bool:
    try:
        require()
    except PlotsUnavailable:
        return False
    return True


def require() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotsUnavailable(
            f"the pictures need matplotlib, which is not installed here ({exc}): {INSTALL_HINT}"
        ) from exc


def new_figure(width_in: float, height_in: float) -> Figure:
    """An empty figure of `width_in` x `height_in` inches at `DPI`, on an Agg canvas."""
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _saving() -> AbstractContextManager[None]:
    import matplotlib

    context: AbstractContextManager[None] = matplotlib.rc_context(
        {"svg.fonttype": "none", "svg.hashsalt": "hicache"}
    )
    return context


def save(figure: Figure, path: Path) -> Path:
    """`figure` to `path`, PNG or SVG by its suffix (the folder made if missing)."""
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in SAVE_FORMATS:
        raise ValueError(
            f"cannot save a picture as {path}: its suffix {path.suffix!r} is not one of "
            f"{', '.join('.' + f for f in SAVE_FORMATS)}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with _saving():
        figure.savefig(path, format=fmt, metadata=_METADATA[fmt], facecolor="white")
    return path


def svg_markup(figure: Figure) -> str:
    """The figure as one `<svg>` element (no XML prolog or doctype), to inline in HTML."""
    buffer = io.StringIO()
    with _saving():
        figure.savefig(buffer, format="svg", metadata=_METADATA["svg"], facecolor="white")
    text = buffer.getvalue()
    return text[text.index("<svg") :]
