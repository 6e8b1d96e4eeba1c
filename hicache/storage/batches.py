"""How `GuardedStore` cuts a batch into chunks of about `chunk_bytes`, frames each object
(header and checksum, `object_format.py`) into an arena or as parts, and verifies what a
scattered read landed. Pure helpers: no I/O, no state beyond a put's `Gate`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence

from hicache.errors import ObjectCorruptError
from hicache.storage import object_format
from hicache.storage.backend import Buffer
from hicache.storage.object_format import Parts


def runs(sizes: Sequence[int], chunk_bytes: int) -> list[list[int]]:
    """Consecutive runs of indices of about `chunk_bytes` bytes (at least one each)."""
    runs: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if runs[-1] and total + size > chunk_bytes:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += size
    return runs if runs[0] else []


def chunks(
    items: Sequence[tuple[bytes, Parts]], sizes: Sequence[int], chunk_bytes: int
) -> list[list[tuple[tuple[bytes, Parts], int]]]:
    """`runs` of items, each with its size."""
    return [[(items[i], sizes[i]) for i in run] for run in runs(sizes, chunk_bytes)]


def encode_chunk(
    chunk: list[tuple[tuple[bytes, Parts], int]], arena: memoryview, offset: int
) -> list[tuple[bytes, memoryview]]:
    encoded = []
    for (key, payload), size in chunk:
        object_format.encode_into(arena[offset : offset + size], key, payload)
        encoded.append((key, arena[offset : offset + size]))
        offset += size
    return encoded


def headers(
    chunk: list[tuple[tuple[bytes, Parts], int]],
) -> list[tuple[bytes, Sequence[Buffer]]]:
    return [(key, with_header(key, payload)) for (key, payload), _ in chunk]


class Gate:
    """Closed once the store stops waiting for a put: a header is computed (its checksum over
    the caller's payload) only while it is open, under the same lock, so a thread still
    sending after a timeout can never frame bytes the caller has since reused as a valid
    object — at worst its payload no longer matches a checksum taken before, and the read
    that meets it deletes it as corrupt."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = True

    def close(self) -> None:
        with self.lock:
            self.open = False


def lazy_headers(
    items: Sequence[tuple[bytes, Parts]], gate: Gate
) -> Iterator[tuple[bytes, Sequence[Buffer]]]:
    for key, payload in items:
        with gate.lock:
            if not gate.open:
                return
            parts = with_header(key, payload)
        yield key, parts


def with_header(key: bytes, payload: Parts) -> list[Buffer]:
    parts = object_format.parts_of(payload)
    return [object_format.header(key, parts), *parts]


def verify_all(
    jobs: list[tuple[bytes, memoryview, list[memoryview], int]],
) -> list[bool | None]:
    """Per object: True verified, False present but corrupt, None absent."""
    out: list[bool | None] = []
    for key, head, target, n in jobs:
        if n < 0:
            out.append(None)
            continue
        try:
            object_format.verify_parts(key, head, target, n)
            out.append(True)
        except ObjectCorruptError:
            out.append(False)
    return out


async def collect(
    in_flight: tuple[asyncio.Future[list[bool] | None], int], result: list[bool]
) -> bool:
    """Append a sent chunk's outcomes to `result`; True when the call failed."""
    future, count = in_flight
    outcome = await future
    result += outcome if outcome is not None else [False] * count
    return outcome is None
