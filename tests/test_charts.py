"""The pictures, drawn with matplotlib (`hicache.demo.plotting`, `charts`, `timeline`): what is
drawn read back from matplotlib's artists (lines, their data and styles, axes scales, legends,
bar collections) rather than from pixels; the PNGs and SVGs valid; bad input refused by name;
`benchmarks/transfer.py --plot` from a real run; the committed README images valid and small;
and without matplotlib, the demo and the benchmark saying what to install. Tests that draw skip
(saying what to install) where matplotlib is missing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from hicache.demo import charts, plotting, timeline
from hicache.demo.charts import LineChart, Series
from hicache.demo.timeline import LayerSpan, LoadTimeline
from tests.conftest import REPO

SVG = "{http://www.w3.org/2000/svg}"
IMAGES = REPO / "docs" / "images"
needs_matplotlib = pytest.mark.skipif(
    not plotting.available(),
    reason=f"matplotlib is not installed: {plotting.INSTALL_HINT}",
)
# a child interpreter in which `import matplotlib` fails, as where it is not installed
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; "


def _png(path_or_bytes: Path | bytes) -> Any:
    """The PNG opened and fully decoded by Pillow (matplotlib's own dependency): a corrupt
    chunk, CRC or truncated data raises here."""
    import io

    from PIL import Image

    data = path_or_bytes if isinstance(path_or_bytes, bytes) else path_or_bytes.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    Image.open(io.BytesIO(data)).verify()  # chunk CRCs, structure
    image = Image.open(io.BytesIO(data))
    image.load()  # every row decoded
    return image


def _chart(*series: Series) -> LineChart:
    return LineChart("Copies by page size", "page size (tokens)", "GB/s", series, "a subtitle")


LOW = Series.of("low", [1, 16, 256], [2.0, 2.0, 2.0], charts.BLUE)
HIGH = Series.of("high", [1, 16, 256], [8.0, 8.0, 8.0], charts.ORANGE, dashed=True)
RISING = Series.of("rising", [1, 10, 100], [1.0, 2.0, 4.0], charts.GREEN)


@needs_matplotlib
def test_chart_draws_each_series_with_its_data_style_and_legend() -> None:
    from matplotlib.colors import to_hex

    chart = _chart(LOW, HIGH, RISING)
    fig = charts.figure(chart)
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["low", "high", "rising"]
    for line, series in zip(lines, chart.series, strict=True):
        assert tuple(line.get_xdata()) == series.xs
        assert tuple(line.get_ydata()) == series.ys
        assert to_hex(line.get_color()) == series.color
        assert line.get_linestyle() == ("--" if series.dashed else "-")
        assert line.get_marker() == "s"
        assert line.get_gid() == series.gid
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["low", "high", "rising"]
    assert fig.get_suptitle() == "Copies by page size"
    assert ax.get_title(loc="left") == "a subtitle"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("page size (tokens)", "GB/s")


@needs_matplotlib
def test_chart_axes_x_logarithmic_ticked_at_every_x_and_y_linear_from_zero() -> None:
    fig = charts.figure(_chart(LOW, RISING))
    (ax,) = fig.axes
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "linear")
    assert list(ax.get_xticks()) == [1, 10, 16, 100, 256]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "10", "16", "100", "256"]
    bottom, top = ax.get_ylim()
    assert bottom == 0
    assert top >= 4
    left, right = ax.get_xlim()
    assert left < 1 < 256 < right  # every point inside the frame
    # where the data lands on the figure: equal decades equal widths, y proportional
    to_px = ax.transData.transform
    (x1, y1), (x10, y10), (x100, y100) = to_px([(1, 1.0), (10, 2.0), (100, 4.0)])
    _, y0 = to_px((1, 0.0))
    assert abs((x10 - x1) - (x100 - x10)) < 1e-6
    assert abs((y100 - y0) - 2 * (y10 - y0)) < 1e-6
    assert abs((y10 - y0) - 2 * (y1 - y0)) < 1e-6


@needs_matplotlib
def test_one_x_value_still_gets_a_range_and_zeros_a_y_axis() -> None:
    fig = charts.figure(_chart(Series.of("flat", [16], [0.0], charts.BLUE)))
    (ax,) = fig.axes
    left, right = ax.get_xlim()
    assert left < 16 < right
    assert ax.get_ylim() == (0, 1.0)


@needs_matplotlib
def test_write_makes_the_folder_and_a_valid_svg_and_png_of_one_figure(tmp_path: Path) -> None:
    chart = _chart(LOW, HIGH)
    svg, png = charts.write(chart, tmp_path / "sub" / "chart")
    assert (svg.name, png.name) == ("chart.svg", "chart.png")
    root = ET.fromstring(svg.read_text())
    assert root.tag == f"{SVG}svg"
    texts = {t.text for t in root.iter(f"{SVG}text")}  # text kept as text
    assert {"Copies by page size", "a subtitle", "GB/s", "page size (tokens)"} <= texts
    assert {"low", "high", "1", "16", "256"} <= texts
    assert [g.get("id") for g in root.iter(f"{SVG}g") if g.get("id", "").startswith("series-")] == [
        "series-low",
        "series-high",
    ]
    image = _png(png)
    assert image.size == (900, round(100 * (charts.PLOT_HEIGHT_IN + charts.LEGEND_ROW_IN)))
    # the same chart twice gives the same bytes (no dates in the files)
    again_svg, again_png = charts.write(chart, tmp_path / "again")
    assert again_svg.read_bytes() == svg.read_bytes()
    assert again_png.read_bytes() == png.read_bytes()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Series.of("s", [], [], charts.BLUE), "series 's' has no points: a line needs"),
        (
            lambda: Series.of("s", [1, 2], [1.0], charts.BLUE),
            r"series 's': 2 x values but 1 y values: every x needs exactly one y",
        ),
        (
            lambda: Series.of("s", [1, 0], [1.0, 2.0], charts.BLUE),
            r"series 's': x\[1\] is 0; the x axis is log-scaled, so every x must be a finite "
            r"number > 0",
        ),
        (
            lambda: Series.of("s", [-4], [1.0], charts.BLUE),
            r"series 's': x\[0\] is -4; the x axis is log-scaled",
        ),
        (
            lambda: Series.of("s", [1], [float("nan")], charts.BLUE),
            r"series 's': y\[0\] is nan; the y axis starts at 0, so every y must be a finite "
            r"number >= 0",
        ),
        (
            lambda: Series.of("s", [1], [-0.5], charts.BLUE),
            r"series 's': y\[0\] is -0.5; the y axis starts at 0",
        ),
        (
            lambda: LineChart("T", "x", "y", ()),
            r"chart 'T' has no series: it needs at least one line",
        ),
    ],
    ids=["empty", "lengths", "zero-x", "negative-x", "nan-y", "negative-y", "no-series"],
)
def test_bad_input_is_refused_naming_the_value_and_what_is_allowed(
    make: object, message: str
) -> None:
    assert callable(make)
    with pytest.raises(ValueError, match=message):
        make()


@needs_matplotlib
def test_save_refuses_a_suffix_it_cannot_write(tmp_path: Path) -> None:
    fig = charts.figure(_chart(LOW))
    with pytest.raises(
        ValueError,
        match=r"cannot save a picture as .*chart\.jpg: its suffix '\.jpg' is not one of "
        r"\.png, \.svg",
    ):
        plotting.save(fig, tmp_path / "chart.jpg")
    assert not (tmp_path / "chart.jpg").exists()


# ---- the demo's timeline -------------------------------------------------------------------


def _loads() -> list[LoadTimeline]:
    """Two loads: 10 layers, only layer 2 stalling past the mark; 3 layers, none stalling."""
    spans = [
        LayerSpan(
            i, i * 1e-4, (i + 1) * 1e-4, i * 1e-4 + (5e-5 if i == 2 else 1e-4), (i + 2) * 1e-4
        )
        for i in range(10)
    ]
    short = [LayerSpan(i, 0.0, (i + 1) * 1e-5, i * 1e-5, (i + 2) * 1e-5) for i in range(3)]
    return [
        LoadTimeline("conv0/turn1", "L2 64 + L3 0 tokens loaded", spans),
        LoadTimeline("conv1/turn1", "L2 16 + L3 16 tokens loaded", short),
    ]


def _collections(ax: Any) -> dict[str, Any]:
    return {c.get_gid().rsplit("-", 1)[1]: c for c in ax.collections}


@needs_matplotlib
def test_timeline_draws_a_panel_per_load_and_a_bar_per_layer_where_its_times_say() -> None:
    loads = _loads()
    fig = timeline.figure(loads, "a title")
    assert [ax.get_gid() for ax in fig.axes] == ["load-0", "load-1"]
    assert fig.get_suptitle() == "a title"
    first, second = (_collections(ax) for ax in fig.axes)
    assert {kind: len(c.get_paths()) for kind, c in first.items()} == {
        "copy": 10,
        "compute": 10,
        "stall": 1,  # only layer 2 waited longer than the mark
    }
    assert {kind: len(c.get_paths()) for kind, c in second.items()} == {
        "copy": 3,
        "compute": 3,
        "stall": 0,
    }
    # each bar spans its times (ms) on its layer's row; copy above compute within a row
    for row, span in enumerate(loads[0].layers):
        copy = first["copy"].get_paths()[row].get_extents()
        compute = first["compute"].get_paths()[row].get_extents()
        assert (copy.x0, copy.x1) == pytest.approx((span.copy_start * 1e3, span.landed * 1e3))
        assert (compute.x0, compute.x1) == pytest.approx(
            (span.landed * 1e3, span.compute_end * 1e3)
        )
        assert row <= copy.y0 < copy.y1 <= compute.y0 < compute.y1 <= row + 1
    stall = first["stall"].get_paths()[0].get_extents()
    assert (stall.x0, stall.x1) == pytest.approx((0.25, 0.3))
    assert 2.5 <= stall.y0 < stall.y1 <= 3  # on layer 2's compute row
    ax = fig.axes[0]
    assert ax.get_ylim() == (10, 0)  # layer 0 at the top
    assert ax.get_xlim() == pytest.approx((0, loads[0].end * 1e3))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["L0", "L8"]
    assert ax.get_title(loc="left") == (
        "conv0/turn1: L2 64 + L3 0 tokens loaded, 10 layers, 1.10 ms, stalled 0.05 ms"
    )
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "copy of layer i",
        "compute of layer i",
        "stall (engine waited over 20 us)",
    ]


@needs_matplotlib
def test_timeline_write_gives_an_html_page_with_the_svg_and_a_valid_png(tmp_path: Path) -> None:
    page, png = timeline.write(_loads(), tmp_path / "tl", "hicache demo: a title")
    assert (page.name, png.name) == ("tl.html", "tl.png")
    text = page.read_text()
    assert text.count("<svg") == 1
    assert "<?xml" not in text
    assert "<title>hicache demo: a title</title>" in text
    assert "type='range'" in text  # the zoom slider
    svg = ET.fromstring(text[text.index("<svg") : text.index("</svg>") + len("</svg>")])
    groups = {g.get("id"): g for g in svg.iter(f"{SVG}g") if g.get("id")}
    assert {"load-0", "load-1"} <= groups.keys()
    assert len(list(groups["load-0-copy"].iter(f"{SVG}path"))) == 10
    assert len(list(groups["load-0-stall"].iter(f"{SVG}path"))) == 1
    assert len(list(groups["load-1-compute"].iter(f"{SVG}path"))) == 3
    image = _png(png)
    assert image.size[0] == 900
    assert image.size[1] > 13 * 100 * timeline.LAYER_IN


def test_timeline_pick_keeps_the_most_stalled_loads_in_trace_order() -> None:
    def load(name: str, stall_s: float, end_s: float) -> LoadTimeline:
        return LoadTimeline(name, "", [LayerSpan(0, 0.0, stall_s, 0.0, end_s)])

    loads = [load("a", 0.0, 1.0), load("b", 0.3, 1.0), load("c", 0.1, 2.0), load("d", 0.3, 3.0)]
    assert [x.name for x in timeline.pick(loads, 2)] == ["b", "d"]
    assert [x.name for x in timeline.pick(loads, 3)] == ["b", "c", "d"]


# ---- without matplotlib ----------------------------------------------------------------------


def test_without_matplotlib_drawing_raises_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    assert not plotting.available()
    with pytest.raises(
        plotting.PlotsUnavailable,
        match=r"the pictures need matplotlib, which is not installed here \(.*\): "
        r"pip install 'hicache\[plots\]' \(python3 dev.py installs it\)",
    ):
        charts.figure(_chart(LOW))
    with pytest.raises(plotting.PlotsUnavailable, match=r"pip install 'hicache\[plots\]'"):
        timeline.figure(_loads())


def test_without_matplotlib_the_demo_says_how_to_get_the_timeline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from hicache.demo import run

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    figures: dict[str, Any] = {}
    run._write_timeline(_loads(), tmp_path, None, False, figures)
    assert capsys.readouterr().out == (
        "\n== timeline: not drawn (matplotlib is not installed): pip install 'hicache[plots]' "
        "(python3 dev.py installs it)\n"
    )
    assert figures == {}
    assert list(tmp_path.iterdir()) == []


def test_without_matplotlib_demo_timeline_and_transfer_plot_are_refused_before_starting(
    tmp_path: Path,
) -> None:
    """Asked for by name, a picture that cannot be drawn stops the run before anything starts
    (a real `hicache demo` / `benchmarks/transfer.py` process in which matplotlib is missing)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    demo = subprocess.run(
        [
            sys.executable,
            "-c",
            NO_MATPLOTLIB + "from hicache.cli.main import main; sys.exit(main(sys.argv[1:]))",
            "demo",
            "--timeline",
            str(tmp_path / "tl"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert demo.returncode == 2, demo.stderr
    assert demo.stderr.strip().splitlines()[-1] == (
        f"hicache demo: --timeline {tmp_path / 'tl'}: the timeline is drawn with matplotlib, "
        "which is not installed here: pip install 'hicache[plots]' (python3 dev.py installs it)"
    )
    assert "== sidecar" not in demo.stdout
    bench = subprocess.run(
        [
            sys.executable,
            "-c",
            NO_MATPLOTLIB + "import runpy; sys.argv[:] = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')",
            "benchmarks/transfer.py",
            "--plot",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bench.returncode == 2, bench.stderr
    assert (
        f"error: --plot {tmp_path}: the charts are drawn with matplotlib, which is not "
        "installed here: pip install 'hicache[plots]'" in bench.stderr
    )
    assert "row kernel" not in bench.stdout  # nothing was measured
    assert list(tmp_path.iterdir()) == []


# ---- the benchmark's charts and the committed images ------------------------------------------


def _series_paths(svg: str) -> dict[str, list[tuple[float, float]]]:
    """Per series gid, the vertices of its line in the SVG (pixels, y down)."""
    root = ET.fromstring(svg)
    out = {}
    for group in root.iter(f"{SVG}g"):
        gid = group.get("id", "")
        if gid.startswith("series-"):
            path = next(p for p in group.iter(f"{SVG}path") if p.get("d", "").startswith("M"))
            numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", path.get("d", ""))]
            out[gid] = list(zip(numbers[::2], numbers[1::2], strict=True))
    return out


@needs_matplotlib
@pytest.mark.parametrize(
    ("layout", "churn"), [("layer_first", "--churn"), ("page_first", "--no-churn")]
)
def test_transfer_benchmark_plots_what_it_just_measured(
    tmp_path: Path, layout: str, churn: str
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/transfer.py",
            "--move-mib",
            "1",
            "--trials",
            "1",
            "--pages",
            "1,16",
            "--layout",
            layout,
            churn,
            "--plot",
            str(tmp_path),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    svg_path, png_path = tmp_path / f"transfer_{layout}.svg", tmp_path / f"transfer_{layout}.png"
    assert f"plot: {svg_path}, {png_path}" in done.stdout
    assert _png(png_path).size[0] == 900
    lines = _series_paths(svg_path.read_text())
    keys = {
        "ours, fresh pool: load": "load",
        "ours, fresh pool: backup": "backup",
        "contiguous copy: load": "baseline",
        "contiguous copy: backup": "baseline_backup",
    }
    if churn == "--churn":
        keys |= {
            "ours, churned pool: load": "churn_load",
            "ours, churned pool: backup": "churn_backup",
        }
    gids = {Series.of(label, [1], [0], charts.BLUE).gid: key for label, key in keys.items()}
    assert set(lines) == set(gids)
    assert all(len(points) == 2 for points in lines.values())
    # the drawing follows this run's figures: a larger GB/s is drawn higher (smaller SVG y)
    for i, page in enumerate((1, 16)):
        for a, key_a in gids.items():
            for b, key_b in gids.items():
                if results[f"{key_a}_gbps_p{page}"] > results[f"{key_b}_gbps_p{page}"]:
                    assert lines[a][i][1] < lines[b][i][1], (a, b, page)


@pytest.mark.parametrize(
    "name", ["transfer_layer_first.png", "transfer_page_first.png", "timeline.png"]
)
def test_committed_readme_images_are_valid_small_pngs(name: str) -> None:
    pytest.importorskip("PIL", reason="Pillow (a matplotlib dependency) decodes the PNGs")
    data = (IMAGES / name).read_bytes()
    assert len(data) < 150_000, f"{name}: {len(data)} bytes"
    image = _png(data)
    assert image.size[0] >= 800
    assert image.size[1] >= 300
    assert len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) >= 4
