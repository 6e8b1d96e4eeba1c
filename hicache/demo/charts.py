"""Line charts for the benchmarks' figures: x on a log scale (page size in tokens), y linear
from 0 (GB/s), one line per series, with axis ticks and labels, a legend and a title; as SVG
(text as <text>) and as PNG (drawn on `raster.Canvas`, text in its bitmap font).

Lifecycle: build `Series` (checked when built: a bad point raises ValueError naming the
series, the index, the value and what is allowed), put them in a `LineChart` (a title, a
subtitle, axis labels), then `render_svg` / `render_png`, or `write(chart, base)` for
`base`.svg and `base`.png. Both renderings place every point through one `Frame`, so the SVG
and the PNG agree pixel for pixel on where the data sits.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hicache.demo.raster import WHITE, Canvas, Color, text_width

# a palette of distinct, print-safe colours for callers' series
BLUE: Color = (31, 119, 180)
ORANGE: Color = (230, 120, 20)
GREEN: Color = (44, 160, 44)
RED: Color = (214, 39, 40)
PURPLE: Color = (148, 103, 189)
GREY: Color = (90, 90, 90)

INK: Color = (30, 30, 30)  # text, axes
GRID: Color = (225, 225, 225)

WIDTH = 860  # at least; a wider title widens the chart
PLOT_HEIGHT = 320
LEFT = 76  # y tick labels
RIGHT = 36
TOP = 100  # title, subtitle, the y axis label
SCALE = 2  # font pixels per bitmap font pixel
LEGEND_ROW = 24
LEGEND_SAMPLE = 36  # the line sample before a legend label
LINE_THICKNESS = 3
MARKER = 7  # square marker side at each point
DASH = (10, 6)  # pixels on, off: a dashed series


@dataclass(frozen=True, slots=True)
class Series:
    """One line: points (xs[i], ys[i]), drawn in `color`, dashed when `dashed`."""

    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    color: Color
    dashed: bool = False

    def __post_init__(self) -> None:
        if not self.xs and not self.ys:
            raise ValueError(
                f"series {self.label!r} has no points: a line needs at least one (x, y) pair"
            )
        if len(self.xs) != len(self.ys):
            raise ValueError(
                f"series {self.label!r}: {len(self.xs)} x values but {len(self.ys)} y values: "
                "every x needs exactly one y"
            )
        for i, x in enumerate(self.xs):
            if not (isinstance(x, int | float) and math.isfinite(x) and x > 0):
                raise ValueError(
                    f"series {self.label!r}: x[{i}] is {x!r}; the x axis is log-scaled, so "
                    "every x must be a finite number > 0"
                )
        for i, y in enumerate(self.ys):
            if not (isinstance(y, int | float) and math.isfinite(y) and y >= 0):
                raise ValueError(
                    f"series {self.label!r}: y[{i}] is {y!r}; the y axis starts at 0, so "
                    "every y must be a finite number >= 0"
                )

    @classmethod
    def of(
        cls,
        label: str,
        xs: Sequence[float],
        ys: Sequence[float],
        color: Color,
        dashed: bool = False,
    ) -> Series:
        return cls(label, tuple(xs), tuple(ys), color, dashed)


@dataclass(frozen=True, slots=True)
class LineChart:
    title: str
    x_label: str
    y_label: str
    series: tuple[Series, ...]
    subtitle: str = ""

    def __post_init__(self) -> None:
        if not self.series:
            raise ValueError(f"chart {self.title!r} has no series: it needs at least one line")


def nice_step(top: float, ticks: int = 5) -> float:
    """A 1 / 2 / 2.5 / 5 x 10^k step giving about `ticks` ticks from 0 to `top` (> 0)."""
    raw = top / ticks
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))


def tick_label(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True, slots=True)
class Frame:
    """Where everything goes, for one chart: canvas size, plot area, axis ranges."""

    width: int
    height: int
    plot_left: int
    plot_top: int
    plot_right: int
    plot_bottom: int
    log_lo: float
    log_hi: float
    y_top: float
    y_ticks: tuple[float, ...]
    x_ticks: tuple[float, ...]
    legend_columns: int = 2

    def point(self, x: float, y: float) -> tuple[int, int]:
        """The pixel of data point (x, y)."""
        fx = (math.log10(x) - self.log_lo) / (self.log_hi - self.log_lo)
        fy = y / self.y_top
        px = self.plot_left + round(fx * (self.plot_right - self.plot_left))
        py = self.plot_bottom - round(fy * (self.plot_bottom - self.plot_top))
        return px, py

    def legend_slot(self, n: int) -> tuple[int, int]:
        """Top-left of the n-th legend entry."""
        column_width = (self.plot_right - self.plot_left) // self.legend_columns
        row, column = divmod(n, self.legend_columns)
        return (
            self.plot_left + column * column_width,
            self.plot_bottom + 64 + row * LEGEND_ROW,
        )


def frame(chart: LineChart) -> Frame:
    xs = sorted({x for s in chart.series for x in s.xs})
    lo, hi = math.log10(xs[0]), math.log10(xs[-1])
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.06 * (hi - lo)
    y_max = max(y for s in chart.series for y in s.ys)
    step = nice_step(y_max) if y_max > 0 else 0.2
    y_top = step * max(1, math.ceil(y_max / step - 1e-9))
    y_ticks = tuple(step * i for i in range(round(y_top / step) + 1))
    labels = [chart.title, chart.subtitle]
    widest_label = max(text_width(t, SCALE) for t in labels) + 20
    columns = 2
    widest_entry = max(LEGEND_SAMPLE + 10 + text_width(s.label, SCALE) for s in chart.series)
    width = max(WIDTH, widest_label, LEFT + RIGHT + columns * (widest_entry + 16))
    rows = math.ceil(len(chart.series) / columns)
    plot_bottom = TOP + PLOT_HEIGHT
    height = plot_bottom + 64 + rows * LEGEND_ROW + 12
    return Frame(
        width,
        height,
        LEFT,
        TOP,
        width - RIGHT,
        plot_bottom,
        lo - pad,
        hi + pad,
        y_top,
        y_ticks,
        tuple(xs),
        columns,
    )


# ---- PNG ----------------------------------------------------------------------------------------


def render_png(chart: LineChart) -> bytes:
    f = frame(chart)
    canvas = Canvas(f.width, f.height, WHITE)
    glyph_h = 7 * SCALE  # cap height: text is centred on it
    canvas.text(10, 10, chart.title, INK, SCALE)
    if chart.subtitle:
        canvas.text(10, 34, chart.subtitle, GREY, SCALE)
    canvas.text(10, f.plot_top - 24, chart.y_label, INK, SCALE)
    for value in f.y_ticks:
        _, y = f.point(f.x_ticks[0], value)
        canvas.fill(f.plot_left, y, f.plot_right - f.plot_left, 1, GRID)
        label = tick_label(value)
        canvas.fill(f.plot_left - 6, y, 6, 1, INK)
        canvas.text(
            f.plot_left - 10 - text_width(label, SCALE), y - glyph_h // 2, label, INK, SCALE
        )
    for value in f.x_ticks:
        x, _ = f.point(value, 0)
        canvas.fill(x, f.plot_top, 1, f.plot_bottom - f.plot_top, GRID)
        canvas.fill(x, f.plot_bottom, 1, 6, INK)
        label = tick_label(value)
        canvas.text(x - text_width(label, SCALE) // 2, f.plot_bottom + 10, label, INK, SCALE)
    canvas.fill(f.plot_left, f.plot_top, 1, f.plot_bottom - f.plot_top + 1, INK)  # y axis
    canvas.fill(f.plot_left, f.plot_bottom, f.plot_right - f.plot_left + 1, 1, INK)  # x axis
    mid = (f.plot_left + f.plot_right) // 2
    canvas.text(
        mid - text_width(chart.x_label, SCALE) // 2, f.plot_bottom + 34, chart.x_label, INK, SCALE
    )
    for s in chart.series:
        points = [f.point(x, y) for x, y in zip(s.xs, s.ys, strict=True)]
        dash = DASH if s.dashed else None
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            canvas.line(x0, y0, x1, y1, s.color, LINE_THICKNESS, dash)
        for x, y in points:
            canvas.fill(x - MARKER // 2, y - MARKER // 2, MARKER, MARKER, s.color)
    for n, s in enumerate(chart.series):
        x, y = f.legend_slot(n)
        mid_y = y + glyph_h // 2
        canvas.line(
            x, mid_y, x + LEGEND_SAMPLE, mid_y, s.color, LINE_THICKNESS, DASH if s.dashed else None
        )
        canvas.fill(
            x + LEGEND_SAMPLE // 2 - MARKER // 2, mid_y - MARKER // 2, MARKER, MARKER, s.color
        )
        canvas.text(x + LEGEND_SAMPLE + 10, y, s.label, INK, SCALE)
    return canvas.png()


# ---- SVG ----------------------------------------------------------------------------------------


def _rgb(c: Color) -> str:
    return f"rgb({c[0]},{c[1]},{c[2]})"


def _text(x: int, y: int, text: str, color: Color, anchor: str = "start") -> str:
    """SVG text whose cap top is at y, as the PNG's is (baseline = top + cap height)."""
    return (
        f'<text x="{x}" y="{y + 7 * SCALE}" fill="{_rgb(color)}" text-anchor="{anchor}">'
        f"{html.escape(text)}</text>"
    )


def render_svg(chart: LineChart) -> str:
    f = frame(chart)
    font_px = 7 * SCALE * 10 // 7  # a sans-serif whose capitals match the PNG's
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{f.width}" height="{f.height}" '
        f'viewBox="0 0 {f.width} {f.height}" font-family="sans-serif" font-size="{font_px}">',
        f"<title>{html.escape(chart.title)}</title>",
        f'<rect x="0" y="0" width="{f.width}" height="{f.height}" fill="{_rgb(WHITE)}"/>',
        _text(10, 10, chart.title, INK),
    ]
    if chart.subtitle:
        out.append(_text(10, 34, chart.subtitle, GREY))
    out.append(_text(10, f.plot_top - 24, chart.y_label, INK))
    glyph_h = 7 * SCALE
    for value in f.y_ticks:
        _, y = f.point(f.x_ticks[0], value)
        out.append(
            f'<line class="grid" x1="{f.plot_left}" y1="{y}" x2="{f.plot_right}" y2="{y}" '
            f'stroke="{_rgb(GRID)}"/>'
        )
        out.append(_text(f.plot_left - 10, y - glyph_h // 2, tick_label(value), INK, "end"))
    for value in f.x_ticks:
        x, _ = f.point(value, 0)
        out.append(
            f'<line class="grid" x1="{x}" y1="{f.plot_top}" x2="{x}" y2="{f.plot_bottom}" '
            f'stroke="{_rgb(GRID)}"/>'
        )
        out.append(_text(x, f.plot_bottom + 10, tick_label(value), INK, "middle"))
    out.append(
        f'<path class="axes" d="M{f.plot_left},{f.plot_top} V{f.plot_bottom} H{f.plot_right}" '
        f'fill="none" stroke="{_rgb(INK)}"/>'
    )
    mid = (f.plot_left + f.plot_right) // 2
    out.append(_text(mid, f.plot_bottom + 34, chart.x_label, INK, "middle"))
    for s in chart.series:
        points = " ".join(
            f"{x},{y}" for x, y in (f.point(*p) for p in zip(s.xs, s.ys, strict=True))
        )
        dash = f' stroke-dasharray="{DASH[0]},{DASH[1]}"' if s.dashed else ""
        out.append(
            f'<polyline class="series" data-label="{html.escape(s.label)}" points="{points}" '
            f'fill="none" stroke="{_rgb(s.color)}" stroke-width="{LINE_THICKNESS}"{dash}/>'
        )
    for n, s in enumerate(chart.series):
        x, y = f.legend_slot(n)
        mid_y = y + glyph_h // 2
        dash = f' stroke-dasharray="{DASH[0]},{DASH[1]}"' if s.dashed else ""
        out.append(
            f'<line class="legend" x1="{x}" y1="{mid_y}" x2="{x + LEGEND_SAMPLE}" y2="{mid_y}" '
            f'stroke="{_rgb(s.color)}" stroke-width="{LINE_THICKNESS}"{dash}/>'
        )
        out.append(_text(x + LEGEND_SAMPLE + 10, y, s.label, INK))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write(chart: LineChart, base: Path) -> tuple[Path, Path]:
    """`base`.svg and `base`.png (the folder made if missing); returns their paths."""
    base.parent.mkdir(parents=True, exist_ok=True)
    svg, png = base.with_name(base.name + ".svg"), base.with_name(base.name + ".png")
    svg.write_text(render_svg(chart))
    png.write_bytes(render_png(chart))
    return svg, png
