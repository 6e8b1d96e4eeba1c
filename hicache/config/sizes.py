"""Byte sizes written the way people write them: `64GiB`, `512 MiB`, `1.5GB`, `4096`."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
ALLOWED = "a byte count such as 4096, or a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"


def parse_bytes(value: object) -> int:
    """Bytes as an int; raises ValueError naming the value and the allowed forms."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size; allowed: {ALLOWED}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value!r} is negative; allowed: {ALLOWED}")
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS:
            number = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if number != int(number):
                raise ValueError(f"{value!r} is not a whole number of bytes")
            return int(number)
    raise ValueError(f"{value!r} is not a size; allowed: {ALLOWED}")


def format_bytes(count: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size and count % (size // 1024 or 1) == 0:
            value = count / size
            return f"{value:g}{unit}" if value == int(value) else f"{value:.2f}{unit}"
    return f"{count}B"
