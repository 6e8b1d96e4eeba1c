"""The demo's picture: per-layer timelines of a few loads, as an HTML page (inline SVG) and a
PNG (drawn on `raster.Canvas`: zlib + struct, no plotting library).

Per layer of a load, in time since the load was issued: the copy of layer i (from when layer
i-1 was seen landed to when layer i was: layers land in order, so this is the window its copy
finished in), the simulated compute of layer i (after its wait), and the stall (the engine
blocked in `wait_layer` instead of computing), marked in red on the compute row when it is
longer than `STALL_MARK_S`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.demo.raster import Canvas, text_width

STALL_MARK_S = 20e-6
MAX_LOADS = 4

COPY = (66, 133, 244)  # blue
COMPUTE = (52, 168, 83)  # green
STALL = (219, 68, 55)  # red
BACKGROUND = (255, 255, 255)
AXIS = (160, 160, 160)


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


# ---- geometry shared by both renderings -------------------------------------------------------

WIDTH = 900
LEFT = 60  # layer labels
RIGHT = 20
ROW = 8  # per layer
GAP = 2
TITLE = 28  # per panel, above its rows
BOTTOM = 16


def _panel_height(load: LoadTimeline) -> int:
    return TITLE + len(load.layers) * ROW + BOTTOM


def _rects(load: LoadTimeline, top: int) -> list[tuple[int, list[tuple[str, int, int, int, int]]]]:
    """Per layer: (layer id, [(kind, x, y, w, h)]) for the copy, compute and stall bars."""
    scale = (WIDTH - LEFT - RIGHT) / max(load.end, 1e-9)
    half = (ROW - GAP) // 2
    out = []
    for row, span in enumerate(load.layers):
        y = top + TITLE + row * ROW

        def bar(
            kind: str, start: float, end: float, y0: int, h: int
        ) -> tuple[str, int, int, int, int]:
            x0 = LEFT + int(start * scale)
            return (kind, x0, y0, max(1, int(end * scale) + LEFT - x0), h)

        bars = [
            bar("copy", span.copy_start, span.landed, y, half),
            bar("compute", span.landed, span.compute_end, y + half, half),
        ]
        if span.stall > STALL_MARK_S:
            bars.append(bar("stall", span.wait_start, span.landed, y + half, half))
        out.append((span.layer_id, bars))
    return out


# ---- HTML (inline SVG) --------------------------------------------------------------------------

_FILL = {"copy": COPY, "compute": COMPUTE, "stall": STALL}


def _rgb(c: tuple[int, int, int]) -> str:
    return f"rgb({c[0]},{c[1]},{c[2]})"


def _label(load: LoadTimeline) -> str:
    return (
        f"{load.name}: {load.tokens}, {len(load.layers)} layers, "
        f"{load.end * 1e3:.2f} ms, stalled {load.stall * 1e3:.2f} ms"
    )


def render_html(loads: Sequence[LoadTimeline], title: str) -> str:
    height = sum(_panel_height(load) for load in loads) or TITLE
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">'
    ]
    top = 0
    for n, load in enumerate(loads):
        label = _label(load)
        parts.append(f'<g class="load" data-load="{n}">')
        parts.append(f'<text x="4" y="{top + 18}">{html.escape(label)}</text>')
        for layer_id, bars in _rects(load, top):
            y = bars[0][2]
            parts.append(f'<g class="layer" data-layer="{layer_id}">')
            if layer_id % 8 == 0:
                parts.append(f'<text x="4" y="{y + ROW - 2}" font-size="8">L{layer_id}</text>')
            for kind, x, by, w, h in bars:
                parts.append(
                    f'<rect class="{kind}" x="{x}" y="{by}" width="{w}" height="{h}" '
                    f'fill="{_rgb(_FILL[kind])}"/>'
                )
            parts.append("</g>")
        parts.append("</g>")
        top += _panel_height(load)
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="color:{_rgb(c)}">&#9632;</span> {k}'
        for k, c in (("copy of layer i", COPY), ("compute of layer i", COMPUTE))
    )
    legend += (
        f' <span style="color:{_rgb(STALL)}">&#9632;</span> stall '
        f"(engine waited over {STALL_MARK_S * 1e6:.0f} us for layer i)"
    )
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head>\n<body style='font-family:sans-serif'>\n"
        f"<h2>{html.escape(title)}</h2>\n<p>Per layer, time since the load was issued: "
        f"{legend}.</p>\n" + "\n".join(parts) + "\n</body></html>\n"
    )


# ---- PNG --------------------------------------------------------------------------------------


PNG_LEGEND = 24  # the PNG's key, below the panels (the HTML page says it in words)
INK = (30, 30, 30)


def render_png(loads: Sequence[LoadTimeline]) -> bytes:
    """The panels as in the HTML page (labels in the bitmap font), then a key."""
    panels = sum(_panel_height(load) for load in loads) or TITLE
    canvas = Canvas(WIDTH, panels + PNG_LEGEND, BACKGROUND)
    top = 0
    for load in loads:
        canvas.fill(LEFT - 2, top + TITLE, 1, len(load.layers) * ROW, AXIS)  # time axis origin
        canvas.fill(0, top + 4, WIDTH, 1, AXIS)  # a rule between panels
        label = _label(load)
        scale = 2 if text_width(label, 2) <= WIDTH - 8 else 1
        canvas.text(4, top + 8, label, INK, scale)
        for layer_id, bars in _rects(load, top):
            if layer_id % 8 == 0:
                canvas.text(4, bars[0][2], f"L{layer_id}", INK)
            for kind, x, y, w, h in bars:
                canvas.fill(x, y, w, h, _FILL[kind])
        top += _panel_height(load)
    x = 4
    key = (
        ("copy of layer i", COPY),
        ("compute of layer i", COMPUTE),
        (f"stall (engine waited over {STALL_MARK_S * 1e6:.0f} us)", STALL),
    )
    for name, color in key:
        canvas.fill(x, panels + 8, 14, 10, color)
        x += 20 + canvas.text(x + 20, panels + 6, name, INK, 2) + 20
    return canvas.png()


def write(loads: Sequence[LoadTimeline], base: Path, title: str) -> tuple[Path, Path]:
    """`base`.html and `base`.png; returns their paths."""
    base.parent.mkdir(parents=True, exist_ok=True)
    page, png = base.with_suffix(".html"), base.with_suffix(".png")
    page.write_text(render_html(loads, title))
    png.write_bytes(render_png(loads))
    return page, png
