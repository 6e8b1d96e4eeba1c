"""Line charts for the benchmarks' figures, drawn with matplotlib (`demo.plotting`): x on a log
scale (page size in tokens) with a tick at every measured x, y linear from 0 (GB/s), one line
per series with a marker at each point (dashed when asked), a grid, a legend below the plot, a
title and a subtitle; written as SVG and PNG.

Lifecycle: build `Series` (checked when built: a bad point raises ValueError naming the series,
the index, the value and what is allowed), put them in a `LineChart` (a title, a subtitle, axis
labels; at least one series), then `figure(chart)` (a matplotlib `Figure`, whose artists the
tests read) or `write(chart, base)` for `base`.svg and `base`.png from that one figure, so the
two files agree. `Series` and `LineChart` need no matplotlib; `figure` and `write` raise
`plotting.PlotsUnavailable` (saying what to install) without it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hicache.demo import plotting

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Color = str  # a matplotlib colour: "#rrggbb"

# a palette of distinct, print-safe colours for callers' series (matplotlib's "tab" colours)
BLUE: Color = "#1f77b4"
ORANGE: Color = "#ff7f0e"
GREEN: Color = "#2ca02c"
RED: Color = "#d62728"
PURPLE: Color = "#9467bd"
GREY: Color = "#5a5a5a"

WIDTH_IN = 9.0  # 900 pixels at plotting.DPI
PLOT_HEIGHT_IN = 4.2
LEGEND_ROW_IN = 0.28
LEGEND_COLUMNS = 2
LINE_WIDTH = 2.2
MARKER_SIZE = 6


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

    @property
    def gid(self) -> str:
        """The id of this series' line in the SVG: `series-` and the label, slugged."""
        return "series-" + re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")


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


def tick_label(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def figure(chart: LineChart) -> Figure:
    """The chart drawn on a new matplotlib figure (one Axes, one Line2D per series)."""
    rows = math.ceil(len(chart.series) / LEGEND_COLUMNS)
    fig = plotting.new_figure(WIDTH_IN, PLOT_HEIGHT_IN + rows * LEGEND_ROW_IN)
    ax = fig.add_subplot()
    for s in chart.series:
        ax.plot(
            s.xs,
            s.ys,
            color=s.color,
            linestyle="--" if s.dashed else "-",
            linewidth=LINE_WIDTH,
            marker="s",
            markersize=MARKER_SIZE,
            label=s.label,
            gid=s.gid,
        )
    xs = sorted({x for s in chart.series for x in s.xs})
    ax.set_xscale("log")
    ax.set_xticks(xs, [tick_label(x) for x in xs])
    ax.minorticks_off()
    if len(xs) == 1:  # one x value: a decade around it, so the point is not on the frame
        ax.set_xlim(xs[0] / math.sqrt(10), xs[0] * math.sqrt(10))
    else:
        ax.margins(x=0.05)
    y_max = max(y for s in chart.series for y in s.ys)
    ax.set_ylim(0, y_max * 1.08 if y_max > 0 else 1.0)
    ax.grid(True, color="#e1e1e1")
    ax.set_axisbelow(True)
    ax.set_xlabel(chart.x_label)
    ax.set_ylabel(chart.y_label)
    ax.set_title(chart.subtitle, fontsize="medium", color=GREY, loc="left")
    fig.suptitle(chart.title, x=0.01, ha="left", fontsize="large")
    fig.legend(loc="outside lower center", ncols=LEGEND_COLUMNS, frameon=False)
    return fig


def write(chart: LineChart, base: Path) -> tuple[Path, Path]:
    """`base`.svg and `base`.png (the folder made if missing); returns their paths."""
    fig = figure(chart)
    svg = plotting.save(fig, base.with_name(base.name + ".svg"))
    png = plotting.save(fig, base.with_name(base.name + ".png"))
    return svg, png
