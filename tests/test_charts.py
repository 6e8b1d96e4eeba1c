"""The benchmarks' line charts (`hicache.demo.charts` on `hicache.demo.raster`): valid PNGs
(chunks, CRCs, rows) whose pixels sit where the data says, SVG with one polyline per series,
bad input refused by name; `benchmarks/transfer.py --plot` from a real run; and the committed
README images are valid PNGs."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.demo import charts
from hicache.demo.charts import LineChart, Series, frame, render_png, render_svg
from hicache.demo.raster import FONT, WHITE, Canvas, Color, encode_png
from tests.conftest import REPO

SVG = "{http://www.w3.org/2000/svg}"
IMAGES = REPO / "docs" / "images"


@dataclass
class Png:
    width: int
    height: int
    rows: list[bytes]  # RGB, 3 bytes a pixel

    def at(self, x: int, y: int) -> Color:
        r, g, b = self.rows[y][3 * x : 3 * x + 3]
        return (r, g, b)

    def colors(self) -> set[bytes]:
        return {row[i : i + 3] for row in self.rows for i in range(0, len(row), 3)}


def decode_png(data: bytes) -> Png:
    """Parse our PNGs back: signature, chunks with their CRCs, IHDR, IDAT rows, IEND last."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), f"chunk {kind!r}: CRC mismatch"
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data), "trailing bytes after the last chunk"
    assert chunks[0][0] == b"IHDR"
    assert chunks[-1] == (b"IEND", b"")
    width, height, depth, color_type, *_rest = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color_type) == (8, 2), "not 8-bit RGB"
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride, f"{len(raw)} bytes of rows for {width}x{height}"
    rows = [raw[y * stride : (y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows), "a row with a filter other than None"
    return Png(width, height, [row[1:] for row in rows])


def _chart(*series: Series) -> LineChart:
    return LineChart("Copies by page size", "page size (tokens)", "GB/s", series, "a subtitle")


LOW = Series.of("low", [1, 16, 256], [2.0, 2.0, 2.0], charts.BLUE)
HIGH = Series.of("high", [1, 16, 256], [8.0, 8.0, 8.0], charts.ORANGE, dashed=True)
RISING = Series.of("rising", [1, 10, 100], [1.0, 2.0, 4.0], charts.GREEN)


def test_png_is_valid_and_draws_axes_text_and_every_series() -> None:
    png = decode_png(render_png(_chart(LOW, HIGH)))
    f = frame(_chart(LOW, HIGH))
    assert (png.width, png.height) == (f.width, f.height)
    assert png.width >= 800
    colors = png.colors()
    for color in (WHITE, charts.INK, charts.GRID, charts.BLUE, charts.ORANGE):
        assert bytes(color) in colors, f"{color} not drawn"


def test_each_point_is_drawn_where_its_value_says_higher_values_higher() -> None:
    chart = _chart(LOW, HIGH)
    png, f = decode_png(render_png(chart)), frame(chart)
    for series in (LOW, HIGH):
        for x, y in zip(series.xs, series.ys, strict=True):
            px, py = f.point(x, y)
            assert png.at(px, py) == series.color, f"{series.label} at ({x}, {y})"
    for x in LOW.xs:  # scan the column: the higher series' pixels come first from the top
        px, _ = f.point(x, 0)
        column = [png.at(px, y) for y in range(f.plot_top, f.plot_bottom)]
        assert column.index(charts.ORANGE) < column.index(charts.BLUE)


def test_y_is_linear_from_zero_and_x_is_logarithmic() -> None:
    chart = _chart(RISING)
    f = frame(chart)
    (x1, y1), (x10, y10), (x100, y100) = (
        f.point(x, y) for x, y in zip(RISING.xs, RISING.ys, strict=True)
    )
    assert abs((x10 - x1) - (x100 - x10)) <= 1  # equal decades
    assert abs((f.plot_bottom - y100) - 2 * (f.plot_bottom - y10)) <= 2  # 4 = 2 x 2
    assert abs((f.plot_bottom - y10) - 2 * (f.plot_bottom - y1)) <= 2
    assert f.y_top >= 4
    assert f.y_ticks[0] == 0
    png = decode_png(render_png(chart))
    assert png.at((x1 + x10) // 2, (y1 + y10) // 2) == charts.GREEN  # the segment between


def test_svg_has_one_polyline_per_series_with_every_point() -> None:
    chart = _chart(LOW, HIGH, RISING)
    root = ET.fromstring(render_svg(chart))
    assert root.tag == f"{SVG}svg"
    lines = root.findall(f"{SVG}polyline")
    assert [p.get("data-label") for p in lines] == ["low", "high", "rising"]
    f = frame(chart)
    for line, series in zip(lines, chart.series, strict=True):
        points = [tuple(int(v) for v in p.split(",")) for p in line.get("points", "").split()]
        assert points == [f.point(x, y) for x, y in zip(series.xs, series.ys, strict=True)]
        assert ("stroke-dasharray" in line.attrib) == series.dashed
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert {"Copies by page size", "a subtitle", "GB/s", "page size (tokens)"} <= set(texts)
    assert {"low", "high", "rising", "1", "16", "256"} <= set(texts)


def test_write_makes_the_folder_and_both_files(tmp_path: Path) -> None:
    svg, png = charts.write(_chart(LOW), tmp_path / "sub" / "chart")
    assert (svg.name, png.name) == ("chart.svg", "chart.png")
    ET.fromstring(svg.read_text())
    decode_png(png.read_bytes())


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


def test_one_x_value_still_gets_a_range_and_zeros_a_y_axis() -> None:
    chart = _chart(Series.of("flat", [16], [0.0], charts.BLUE))
    f = frame(chart)
    assert f.log_lo < f.log_hi
    assert f.y_top > 0
    png = decode_png(render_png(chart))
    px, py = f.point(16, 0)
    assert png.at(px, py) == charts.BLUE


def test_font_text_and_canvas_guards() -> None:
    assert set("0123456789GBs/()%:.,-_ abcxyzABCXYZ") <= set(FONT)
    canvas = Canvas(40, 12)
    assert canvas.text(0, 0, "GB/s", charts.INK) == 4 * 6 - 1
    assert len(decode_png(canvas.png()).colors()) == 2
    unknown, question = Canvas(8, 10), Canvas(8, 10)
    unknown.text(0, 0, "\u00e9", charts.INK)
    question.text(0, 0, "?", charts.INK)
    assert unknown.pixels == question.pixels  # outside the font: drawn as "?"
    with pytest.raises(ValueError, match=r"canvas size 0x5: both sides must be >= 1 pixel"):
        Canvas(0, 5)
    with pytest.raises(ValueError, match=r"5 bytes of pixels for a 2x1 RGB image: it needs 6"):
        encode_png(2, 1, b"\x00" * 5)


def _series_points(svg: str) -> dict[str, list[tuple[int, int]]]:
    root = ET.fromstring(svg)
    return {
        str(p.get("data-label")): [
            (int(a), int(b)) for a, b in (q.split(",") for q in p.get("points", "").split())
        ]
        for p in root.iter(f"{SVG}polyline")
    }


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
    png = decode_png(png_path.read_bytes())
    assert png.width >= 800
    assert len(png.colors()) >= 5
    lines = _series_points(svg_path.read_text())
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
    assert set(lines) == set(keys)
    assert all(len(points) == 2 for points in lines.values())
    # the drawing follows this run's figures: a larger GB/s is drawn no lower
    for i, page in enumerate((1, 16)):
        for a, key_a in keys.items():
            for b, key_b in keys.items():
                if results[f"{key_a}_gbps_p{page}"] > results[f"{key_b}_gbps_p{page}"]:
                    assert lines[a][i][1] <= lines[b][i][1], (a, b, page)


@pytest.mark.parametrize(
    "name", ["transfer_layer_first.png", "transfer_page_first.png", "timeline.png"]
)
def test_committed_readme_images_are_valid_small_pngs(name: str) -> None:
    data = (IMAGES / name).read_bytes()
    assert len(data) < 150_000, f"{name}: {len(data)} bytes"
    png = decode_png(data)
    assert png.width >= 800
    assert png.height >= 300
    assert len(png.colors()) >= 4
