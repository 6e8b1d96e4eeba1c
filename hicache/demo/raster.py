"""The demo's pixel primitives: an RGB canvas (rectangles, thick and dashed lines, text in a
5x7 bitmap font) and its PNG encoding with zlib + struct, no imaging library.

Lifecycle: `Canvas(width, height)` starts filled with the background; `fill`, `line` and
`text` paint into it (anything outside the canvas is clipped); `png()` encodes what it holds,
as often as wanted. Used by `timeline.py` (the per-layer timeline) and `charts.py` (the
benchmarks' line charts).

The font is data below: each glyph is 5 columns by 7 rows above the baseline, plus 2 rows
below it for descenders (g, j, p, q, y, the comma). A character outside the font is drawn as
`?`: labels come from code and benchmark names, and a missing glyph must not stop a run.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

Color = tuple[int, int, int]

WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)

GLYPH_COLUMNS = 5
GLYPH_ROWS = 9  # 7 above the baseline, 2 below
ADVANCE = GLYPH_COLUMNS + 1  # font pixels from one character to the next

_GLYPH_ROWS_TEXT = {
    " ": ".....|.....|.....|.....|.....|.....|.....",
    "0": ".###.|#...#|#..##|#.#.#|##..#|#...#|.###.",
    "1": "..#..|.##..|..#..|..#..|..#..|..#..|.###.",
    "2": ".###.|#...#|....#|...#.|..#..|.#...|#####",
    "3": "#####|...#.|..#..|...#.|....#|#...#|.###.",
    "4": "...#.|..##.|.#.#.|#..#.|#####|...#.|...#.",
    "5": "#####|#....|####.|....#|....#|#...#|.###.",
    "6": "..##.|.#...|#....|####.|#...#|#...#|.###.",
    "7": "#####|....#|...#.|..#..|.#...|.#...|.#...",
    "8": ".###.|#...#|#...#|.###.|#...#|#...#|.###.",
    "9": ".###.|#...#|#...#|.####|....#|...#.|.##..",
    "A": ".###.|#...#|#...#|#####|#...#|#...#|#...#",
    "B": "####.|#...#|#...#|####.|#...#|#...#|####.",
    "C": ".###.|#...#|#....|#....|#....|#...#|.###.",
    "D": "####.|#...#|#...#|#...#|#...#|#...#|####.",
    "E": "#####|#....|#....|####.|#....|#....|#####",
    "F": "#####|#....|#....|####.|#....|#....|#....",
    "G": ".###.|#...#|#....|#.###|#...#|#...#|.####",
    "H": "#...#|#...#|#...#|#####|#...#|#...#|#...#",
    "I": ".###.|..#..|..#..|..#..|..#..|..#..|.###.",
    "J": "..###|...#.|...#.|...#.|...#.|#..#.|.##..",
    "K": "#...#|#..#.|#.#..|##...|#.#..|#..#.|#...#",
    "L": "#....|#....|#....|#....|#....|#....|#####",
    "M": "#...#|##.##|#.#.#|#.#.#|#...#|#...#|#...#",
    "N": "#...#|#...#|##..#|#.#.#|#..##|#...#|#...#",
    "O": ".###.|#...#|#...#|#...#|#...#|#...#|.###.",
    "P": "####.|#...#|#...#|####.|#....|#....|#....",
    "Q": ".###.|#...#|#...#|#...#|#.#.#|#..#.|.##.#",
    "R": "####.|#...#|#...#|####.|#.#..|#..#.|#...#",
    "S": ".####|#....|#....|.###.|....#|....#|####.",
    "T": "#####|..#..|..#..|..#..|..#..|..#..|..#..",
    "U": "#...#|#...#|#...#|#...#|#...#|#...#|.###.",
    "V": "#...#|#...#|#...#|#...#|#...#|.#.#.|..#..",
    "W": "#...#|#...#|#...#|#.#.#|#.#.#|#.#.#|.#.#.",
    "X": "#...#|#...#|.#.#.|..#..|.#.#.|#...#|#...#",
    "Y": "#...#|#...#|.#.#.|..#..|..#..|..#..|..#..",
    "Z": "#####|....#|...#.|..#..|.#...|#....|#####",
    "a": ".....|.....|.###.|....#|.####|#...#|.####",
    "b": "#....|#....|#.##.|##..#|#...#|#...#|####.",
    "c": ".....|.....|.###.|#....|#....|#...#|.###.",
    "d": "....#|....#|.##.#|#..##|#...#|#...#|.####",
    "e": ".....|.....|.###.|#...#|#####|#....|.###.",
    "f": "..##.|.#..#|.#...|###..|.#...|.#...|.#...",
    "g": ".....|.....|.####|#...#|#...#|#...#|.####|....#|.###.",
    "h": "#....|#....|#.##.|##..#|#...#|#...#|#...#",
    "i": "..#..|.....|.##..|..#..|..#..|..#..|.###.",
    "j": "...#.|.....|..##.|...#.|...#.|...#.|...#.|#..#.|.##..",
    "k": "#....|#....|#..#.|#.#..|##...|#.#..|#..#.",
    "l": ".##..|..#..|..#..|..#..|..#..|..#..|.###.",
    "m": ".....|.....|##.#.|#.#.#|#.#.#|#.#.#|#.#.#",
    "n": ".....|.....|#.##.|##..#|#...#|#...#|#...#",
    "o": ".....|.....|.###.|#...#|#...#|#...#|.###.",
    "p": ".....|.....|####.|#...#|#...#|#...#|####.|#....|#....",
    "q": ".....|.....|.####|#...#|#...#|#...#|.####|....#|....#",
    "r": ".....|.....|#.##.|##..#|#....|#....|#....",
    "s": ".....|.....|.####|#....|.###.|....#|####.",
    "t": ".#...|.#...|###..|.#...|.#...|.#..#|..##.",
    "u": ".....|.....|#...#|#...#|#...#|#..##|.##.#",
    "v": ".....|.....|#...#|#...#|#...#|.#.#.|..#..",
    "w": ".....|.....|#...#|#...#|#.#.#|#.#.#|.#.#.",
    "x": ".....|.....|#...#|.#.#.|..#..|.#.#.|#...#",
    "y": ".....|.....|#...#|#...#|#...#|#...#|.####|....#|.###.",
    "z": ".....|.....|#####|...#.|..#..|.#...|#####",
    ".": ".....|.....|.....|.....|.....|.##..|.##..",
    ",": ".....|.....|.....|.....|.....|.##..|.##..|..#..|.#...",
    ":": ".....|.##..|.##..|.....|.##..|.##..|.....",
    ";": ".....|.##..|.##..|.....|.....|.##..|.##..|..#..|.#...",
    "(": "...#.|..#..|.#...|.#...|.#...|..#..|...#.",
    ")": ".#...|..#..|...#.|...#.|...#.|..#..|.#...",
    "[": ".###.|.#...|.#...|.#...|.#...|.#...|.###.",
    "]": ".###.|...#.|...#.|...#.|...#.|...#.|.###.",
    "/": ".....|....#|...#.|..#..|.#...|#....|.....",
    "-": ".....|.....|.....|#####|.....|.....|.....",
    "+": ".....|..#..|..#..|#####|..#..|..#..|.....",
    "_": ".....|.....|.....|.....|.....|.....|#####",
    "=": ".....|.....|#####|.....|#####|.....|.....",
    "%": "##...|##..#|...#.|..#..|.#...|#..##|...##",
    "<": "...#.|..#..|.#...|#....|.#...|..#..|...#.",
    ">": ".#...|..#..|...#.|....#|...#.|..#..|.#...",
    "'": "..#..|..#..|.#...|.....|.....|.....|.....",
    '"': ".#.#.|.#.#.|.....|.....|.....|.....|.....",
    "!": "..#..|..#..|..#..|..#..|..#..|.....|..#..",
    "?": ".###.|#...#|....#|...#.|..#..|.....|..#..",
    "#": ".#.#.|.#.#.|#####|.#.#.|#####|.#.#.|.#.#.",
    "*": ".....|..#..|#.#.#|.###.|#.#.#|..#..|.....",
    "&": ".##..|#..#.|#.#..|.#...|#.#.#|#..#.|.##.#",
    "~": ".....|.....|.#...|#.#.#|...#.|.....|.....",
}


def _parse_glyph(char: str, text: str) -> tuple[tuple[int, int], ...]:
    rows = text.split("|")
    if len(rows) not in (7, GLYPH_ROWS) or any(len(r) != GLYPH_COLUMNS for r in rows):
        raise ValueError(
            f"glyph {char!r}: {text!r} is not 7 or {GLYPH_ROWS} rows of {GLYPH_COLUMNS} "
            "'#' / '.' characters"
        )
    return tuple((x, y) for y, row in enumerate(rows) for x, c in enumerate(row) if c == "#")


# per character: the (column, row) of each lit font pixel
FONT: dict[str, tuple[tuple[int, int], ...]] = {
    char: _parse_glyph(char, text) for char, text in _GLYPH_ROWS_TEXT.items()
}


def text_width(text: str, scale: int = 1) -> int:
    """Pixels `text` spans at `scale` (no trailing gap)."""
    return max(0, len(text) * ADVANCE - 1) * scale


def text_height(scale: int = 1) -> int:
    """Pixels from the top of a capital to the bottom of a descender at `scale`."""
    return GLYPH_ROWS * scale


class Canvas:
    """An RGB image in memory, rows top to bottom, 3 bytes a pixel."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"canvas size {width}x{height}: both sides must be >= 1 pixel")
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill(self, x: int, y: int, w: int, h: int, color: Color) -> None:
        """A w x h rectangle from (x, y), clipped to the canvas."""
        x0, x1 = max(0, x), min(self.width, x + w)
        if x1 <= x0:
            return
        line = bytes(color) * (x1 - x0)
        for row in range(max(0, y), min(self.height, y + h)):
            start = (row * self.width + x0) * 3
            self.pixels[start : start + len(line)] = line

    def pixel(self, x: int, y: int) -> Color:
        start = (y * self.width + x) * 3
        r, g, b = self.pixels[start : start + 3]
        return (r, g, b)

    def line(
        self,
        x0: int,
        y0: int,
        x1: int,
        y1: int,
        color: Color,
        thickness: int = 1,
        dash: tuple[int, int] | None = None,
    ) -> None:
        """A straight line, a square brush of `thickness` centred on it; `dash` is (pixels
        on, pixels off) along the line's longer axis."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, step = dx + dy, 0
        lo = thickness // 2
        x, y = x0, y0
        while True:
            if dash is None or step % (dash[0] + dash[1]) < dash[0]:
                self.fill(x - lo, y - lo, thickness, thickness, color)
            if x == x1 and y == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x += sx
            if e2 <= dx:
                err += dx
                y += sy
            step += 1

    def text(self, x: int, y: int, text: str, color: Color, scale: int = 1) -> int:
        """`text` with its top-left at (x, y); returns the width drawn."""
        for n, char in enumerate(text):
            left = x + n * ADVANCE * scale
            for col, row in FONT.get(char, FONT["?"]):
                self.fill(left + col * scale, y + row * scale, scale, scale, color)
        return text_width(text, scale)

    def png(self) -> bytes:
        return encode_png(self.width, self.height, self.pixels)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(width: int, height: int, rgb: bytes | bytearray | Sequence[int]) -> bytes:
    """An 8-bit RGB PNG of `rgb` (rows top to bottom, 3 bytes a pixel)."""
    stride = width * 3
    if len(rgb) != stride * height:
        raise ValueError(
            f"{len(rgb)} bytes of pixels for a {width}x{height} RGB image: it needs "
            f"{stride * height} (3 a pixel)"
        )
    data = bytes(rgb)
    raw = b"".join(b"\x00" + data[y * stride : (y + 1) * stride] for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )
