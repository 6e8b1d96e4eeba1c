"""`FileBackend`: L3 on a local directory — the embedded default.

One file per object, `<root>/<k[0:2]>/<key hex>.kv`. Writes are atomic (a unique temporary
file in the same directory, then `os.replace`), so a crash or SIGTERM mid-write never leaves a
half object under a real name; leftover temporaries are removed at start. A size budget is
kept with least-recently-used eviction. At start the directory is scanned, so persisted
objects survive a restart. Blocking file I/O runs in worker threads, never on the loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

from hicache.storage.backend import Buffer, StorageBackend

_SUFFIX = ".kv"
_TMP = ".tmp-"


class FileBackend(StorageBackend):
    name = "file"

    def __init__(self, root: Path, capacity_bytes: int, *, fsync: bool = False):
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # LRU order
        self._used = 0
        self._lock = threading.Lock()
        self._dirs: set[Path] = set()
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    # ---- layout ---------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}{_SUFFIX}"

    def _rebuild(self) -> None:
        found = []
        for path in self.root.glob("*/*"):
            if path.name.startswith(_TMP):
                path.unlink(missing_ok=True)  # a write that never finished
            elif path.suffix == _SUFFIX:
                try:
                    stat = path.stat()
                    found.append((stat.st_mtime, bytes.fromhex(path.stem), stat.st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._used += size

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._sizes)

    # ---- blocking operations (run in threads) -----------------------------------------------

    def _put(self, key: bytes, parts: Sequence[Buffer]) -> bool:
        path = self._path(key)
        if path.parent not in self._dirs:
            path.parent.mkdir(exist_ok=True)
            self._dirs.add(path.parent)
        tmp = path.parent / f"{_TMP}{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb", buffering=0) as f:
                for part in parts:  # unbuffered: each part goes to the kernel from where it is
                    view = memoryview(part)
                    written = 0
                    while written < view.nbytes:
                        written += f.write(view[written:]) or 0
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            size = sum(memoryview(part).nbytes for part in parts)
            old = self._sizes.pop(key, 0)
            self._sizes[key] = size
            self._used += size - old
            victims = self._over_budget()
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)
        return True

    def _over_budget(self) -> list[bytes]:
        victims = []
        while self._used > self.capacity_bytes and len(self._sizes) > 1:
            key, size = self._sizes.popitem(last=False)
            self._used -= size
            victims.append(key)
        return victims

    def _get(self, key: bytes) -> bytes | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        return data

    def _get_parts(self, key: bytes, targets: Sequence[memoryview]) -> int:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return -1
        try:
            got, todo = 0, [t for t in targets if t.nbytes]
            while todo:
                n = os.readv(fd, todo)
                if n == 0:
                    break
                got += n
                while todo and n >= todo[0].nbytes:  # drop what was filled, keep the rest
                    n -= todo[0].nbytes
                    todo.pop(0)
                if todo and n:
                    todo[0] = todo[0][n:]
        finally:
            os.close(fd)
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        return got

    def _delete(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)
        with self._lock:
            self._forget(key)

    def _forget(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used -= size

    # ---- async interface ------------------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        return await asyncio.to_thread(lambda: [self._put(k, [d]) for k, d in items])

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return await asyncio.to_thread(lambda: [self._get(k) for k in keys])

    vectored_put = True
    chunked_put = True
    vectored_get = True  # readv: the payload lands in the caller's pages, no second copy

    async def get_parts_many(
        self, keys: Sequence[bytes], targets: Sequence[Sequence[memoryview]]
    ) -> list[int]:
        return await asyncio.to_thread(
            lambda: [self._get_parts(k, t) for k, t in zip(keys, targets, strict=True)]
        )

    async def put_parts_many(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        return await asyncio.to_thread(lambda: [self._put(k, list(p)) for k, p in items])

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._sizes for k in keys]

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        def delete_all() -> None:
            for key in keys:
                self._delete(key)

        await asyncio.to_thread(delete_all)
