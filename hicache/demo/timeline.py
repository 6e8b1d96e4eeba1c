"""The demo's picture: per-layer timelines of a few loads, drawn with matplotlib
(`demo.plotting`) as a PNG and as an HTML page holding the same figure as inline SVG (vector:
it stays sharp when zoomed, and the page has a zoom slider).

Per layer of a load, in time since the load was issued: the copy of layer i (from when layer
i-1 was seen landed to when layer i was: layers land in order, so this is the window its copy
finished in), the simulated compute of layer i (after its wait), and the stall (the engine
blocked in `wait_layer` instead of computing), marked in red on the compute row when it is
longer than `STALL_MARK_S`. One panel per load, layer 0 at the top, each panel on its own time
scale (its title gives the load's length and its stall).

Lifecycle: `from_event` per engine event that carries a timeline -> `pick` the loads shown ->
`figure(loads)` (panel n is the Axes with gid `load-n`; its copy, compute and stall bars are one
collection each, gids `load-n-copy` / `-compute` / `-stall`, one rectangle per layer) ->
`write(loads, base, title)` for `base`.html and `base`.png. Without matplotlib, `figure` and
`write` raise `plotting.PlotsUnavailable`, whose message says what to install.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache.demo import plotting

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STALL_MARK_S = 20e-6
MAX_LOADS = 4

COPY = "#4285f4"  # blue
COMPUTE = "#34a853"  # green
STALL = "#db4437"  # red
KINDS = ("copy", "compute", "stall")


@dataclass(frozen=True, slots=True)
class LayerSpan:
    layer_id: int
    copy_start: float
    landed: float  # the layer was seen landed (end of the wait)
    wait_start: float
    compute_end: float

    @property
    def stall(self) -> float:
        return max(0.0, self.landed - self.wait_start)


@dataclass(frozen=True, slots=True)
class LoadTimeline:
    name: str  # the request, e.g. "conv3/turn2"
    tokens: str  # "L2 384 + L3 128 tokens"
    layers: list[LayerSpan]

    @property
    def end(self) -> float:
        return max((s.compute_end for s in self.layers), default=0.0)

    @property
    def stall(self) -> float:
        return sum(s.stall for s in self.layers)


def from_event(event: dict[str, Any]) -> LoadTimeline:
    """A timeline from an engine `request` event that carries one."""
    t = event["timeline"]
    spans: list[LayerSpan] = []
    previous = 0.0
    for layer_id, (wait_start, landed, ended) in zip(t["layers"], t["spans"], strict=True):
        spans.append(LayerSpan(layer_id, previous, landed, wait_start, ended))
        previous = landed
    return LoadTimeline(event["name"], f"L2 {event['l2']} + L3 {event['l3']} tokens loaded", spans)


def pick(loads: Sequence[LoadTimeline], n: int = MAX_LOADS) -> list[LoadTimeline]:
    """The loads shown: the ones that stalled most (then the longest), in trace order."""
    ranked = sorted(range(len(loads)), key=lambda i: (-loads[i].stall, -loads[i].end))
    return [loads[i] for i in sorted(ranked[:n])]


# ---- the figure ------------------------------------------------------------------------------

WIDTH_IN = 9.0
LAYER_IN = 0.07  # panel height per layer
PANEL_IN = 0.75  # per panel: its title and time axis
LEGEND_IN = 0.45
LAYER_TICK_EVERY = 8
_FILL = {"copy": COPY, "compute": COMPUTE, "stall": STALL}


def _label(load: LoadTimeline) -> str:
    return (
        f"{load.name}: {load.tokens}, {len(load.layers)} layers, "
        f"{load.end * 1e3:.2f} ms, stalled {load.stall * 1e3:.2f} ms"
    )


def bars(load: LoadTimeline) -> dict[str, list[tuple[float, float, float]]]:
    """Per kind, one (row, start_ms, width_ms) per bar: a copy and a compute bar per layer,
    a stall bar for a layer that waited over `STALL_MARK_S`."""
    out: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
    for row, span in enumerate(load.layers):
        out["copy"].append((row, span.copy_start * 1e3, (span.landed - span.copy_start) * 1e3))
        out["compute"].append((row, span.landed * 1e3, (span.compute_end - span.landed) * 1e3))
        if span.stall > STALL_MARK_S:
            out["stall"].append((row, span.wait_start * 1e3, span.stall * 1e3))
    return out


def figure(loads: Sequence[LoadTimeline], title: str = "") -> Figure:
    """One panel per load (layer rows top down; copy on the upper half of a row, compute and
    stall on the lower), a key below, `title` above."""
    heights = [max(1, len(load.layers)) * LAYER_IN + PANEL_IN for load in loads] or [PANEL_IN]
    fig = plotting.new_figure(WIDTH_IN, sum(heights) + LEGEND_IN)  # PlotsUnavailable first
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize="medium")
    if not loads:
        ax = fig.add_subplot()
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no loads to show", ha="center", va="center")
        return fig
    axes = fig.subplots(len(loads), 1, squeeze=False, height_ratios=heights)[:, 0]
    for n, (ax, load) in enumerate(zip(axes, loads, strict=True)):
        ax.set_gid(f"load-{n}")
        for kind, spans in bars(load).items():
            top = 0.05 if kind == "copy" else 0.5  # copy on a row's upper half
            rects = [_rect(start, width, row + top, 0.45) for row, start, width in spans]
            ax.add_collection(
                PolyCollection(rects, facecolors=_FILL[kind], linewidths=0, gid=f"load-{n}-{kind}")
            )
        rows = len(load.layers)
        ax.set_ylim(rows, 0)  # layer 0 at the top
        ax.set_xlim(0, max(load.end, 1e-9) * 1e3)
        ticks = list(range(0, rows, LAYER_TICK_EVERY))
        ax.set_yticks(
            [t + 0.5 for t in ticks], [f"L{load.layers[t].layer_id}" for t in ticks], fontsize=7
        )
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(_label(load), fontsize=9, loc="left")
        ax.grid(True, axis="x", color="#e6e6e6")
        ax.set_axisbelow(True)
    axes[-1].set_xlabel("ms since the load was issued (each panel on its own scale)")
    key = [
        Patch(color=COPY, label="copy of layer i"),
        Patch(color=COMPUTE, label="compute of layer i"),
        Patch(color=STALL, label=f"stall (engine waited over {STALL_MARK_S * 1e6:.0f} us)"),
    ]
    fig.legend(handles=key, loc="outside lower center", ncols=3, frameon=False)
    return fig


def _rect(x: float, width: float, y: float, height: float) -> list[tuple[float, float]]:
    return [(x, y), (x, y + height), (x + width, y + height), (x + width, y)]


def render_html(loads: Sequence[LoadTimeline], title: str, fig: Figure | None = None) -> str:
    """A self-contained page: the key in words, a zoom slider and the figure (`fig`, else
    `figure(loads, title)`) as inline SVG."""
    svg = plotting.svg_markup(fig if fig is not None else figure(loads, title))
    legend = (
        "copy of layer i (blue), compute of layer i (green), stall (red: the engine waited "
        f"over {STALL_MARK_S * 1e6:.0f} us for layer i)"
    )
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>\n"
        "<style>#zoom svg{width:100%;height:auto}</style></head>\n"
        "<body style='font-family:sans-serif'>\n"
        "<p>Per layer, time since the load was issued: "
        f"{html.escape(legend)}.</p>\n"
        "<p><label>zoom <input type='range' min='100' max='800' value='100' "
        "oninput=\"document.getElementById('zoom').style.width=this.value+'%'\"></label></p>\n"
        "<div style='overflow-x:auto'><div id='zoom' style='width:100%'>\n"
        f"{svg}</div></div>\n</body></html>\n"
    )


def write(loads: Sequence[LoadTimeline], base: Path, title: str) -> tuple[Path, Path]:
    """`base`.html and `base`.png, from one figure; returns their paths."""
    fig = figure(loads, title)
    base.parent.mkdir(parents=True, exist_ok=True)
    page = base.with_suffix(".html")
    page.write_text(render_html(loads, title, fig))
    return page, plotting.save(fig, base.with_suffix(".png"))
