"""`FileBackend`: L3 on a local directory — the embedded default.

One file per object, `<root>/<k[0:2]>/<key hex>.kv`. Writes are atomic (a unique temporary
file in the same directory, then `os.replace`), so a crash or SIGTERM mid-write never leaves a
half object under a real name. A size budget is kept with least-recently-used eviction. At
start the directory is scanned, so persisted objects survive a restart. Blocking file I/O
runs in worker threads, never on the loop.

Several processes may share the directory (two `hicache serve` on one volume, a restart that
overlaps its predecessor). The rules:
- **The catalogue is a cache of the directory, not its truth.** `exists_many` answers keys
  the catalogue lacks with one `os.stat` each (on a thread; none when it knows them all), and
  gets open the object's path whatever the catalogue says; an object found either way is
  adopted (size counted in the budget, most recent in the LRU; `adopted` counts them). A key
  the catalogue lists but another process deleted reads as a miss and is forgotten.
- **Eviction is per process:** each evicts from what it knows when its own puts exceed its
  budget, possibly objects another wrote (POSIX keeps an open file readable after unlink).
- **Temporaries** are named `.tmp-<writer>-<pid>-<random>`, `<writer>` a digest of the host
  name and the pid namespace. Start-up removes one only when it is provably abandoned: its
  writer is this host and namespace and its pid is dead, or it has not been written for
  `stale_tmp_after_s` (default 10 min; a write keeps the mtime fresh). Any other temporary —
  another host's, another container's, an older version's unparseable name — is judged by
  age alone. `removed_temporaries` counts what start-up removed.
- **Only regular files are objects.** A directory, FIFO, socket, device or symbolic link
  (to anything, or dangling) where an object should be is a miss: dropped from the catalogue
  and counted (`objects_damaged`), never an exception for the breaker, never a hang (objects
  are opened `O_NONBLOCK | O_NOFOLLOW` and checked with `fstat` before any read; the scan and
  `exists_many` `lstat` and check `S_ISREG`). A put onto a directory, or into a shard whose
  directory is not one, is refused for that key (counted too); a put onto a FIFO, socket or
  link replaces that entry atomically, as it would a stale object. Nothing else is removed:
  the thing is not ours. A truncated, empty or garbled regular file is an object that fails
  verification: `GuardedStore` deletes it and counts it as corrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import math
import os
import socket
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from hicache.errors import TierUnavailableError
from hicache.storage.backend import MISSING, Buffer, Landed, StorageBackend

_SUFFIX = ".kv"
_TMP = ".tmp-"
STALE_TMP_AFTER_S = 600.0
# open() errors that mean "no object of ours here" (a miss), not a failing disk
# (ENXIO: a socket; ELOOP: a symbolic link, refused by O_NOFOLLOW)
_NOT_AN_OBJECT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENXIO, errno.ELOOP, errno.EISDIR})
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def _writer_id() -> str:
    """This host and pid namespace: where a temporary's pid can be checked for liveness."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    seed = f"{socket.gethostname()}\0{namespace}".encode()
    return hashlib.blake2b(seed, digest_size=6).hexdigest()


WRITER_ID = _writer_id()


def temporary_name() -> str:
    """A fresh temporary's name: `.tmp-<writer>-<pid>-<random>`."""
    return f"{_TMP}{WRITER_ID}-{os.getpid()}-{uuid.uuid4().hex}"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user
        return True
    return True


def _abandoned(name: str, mtime: float, stale_after_s: float, now: float) -> bool:
    """Whether start-up may remove the temporary `name` (see the module docstring)."""
    if now - mtime >= stale_after_s:
        return True
    writer, _, rest = name[len(_TMP) :].partition("-")
    pid, _, _ = rest.partition("-")
    return writer == WRITER_ID and pid.isdigit() and not _pid_alive(int(pid))


class FileBackend(StorageBackend):
    name = "file"

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        stale_tmp_after_s: float = STALE_TMP_AFTER_S,
    ):
        self._stopped = threading.Event()  # stop_writes: puts on threads end after this object
        if not (isinstance(stale_tmp_after_s, int | float) and math.isfinite(stale_tmp_after_s)):
            raise ValueError(
                f"FileBackend stale_tmp_after_s={stale_tmp_after_s!r}: must be a finite number "
                "of seconds >= 0"
            )
        if stale_tmp_after_s < 0:
            raise ValueError(
                f"FileBackend stale_tmp_after_s={stale_tmp_after_s}: must be >= 0 seconds "
                "(how long a temporary goes unwritten before start-up calls it abandoned)"
            )
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.stale_tmp_after_s = float(stale_tmp_after_s)
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # LRU order
        self._used = 0
        self._lock = threading.Lock()
        self._dirs: set[Path] = set()
        self.adopted = 0  # objects found on disk that the catalogue did not list
        self.objects_damaged = 0  # non-regular files met where an object (or shard) should be
        self.removed_temporaries = 0
        # 0700 / 0600: KV pages are as private as the engine's memory (the socket is 0600)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._rebuild()

    # ---- layout ---------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}{_SUFFIX}"

    def _entries(self) -> Iterator[Path]:
        """What lies in the shard directories; a shard that is a link is damage, skipped and
        counted (never followed elsewhere)."""
        for shard in self.root.iterdir():
            try:
                mode = shard.lstat().st_mode
            except OSError:  # gone meanwhile
                continue
            if stat.S_ISLNK(mode):
                self.objects_damaged += 1
            elif stat.S_ISDIR(mode):
                yield from shard.iterdir()

    def _rebuild(self) -> None:
        found = []
        now = time.time()
        for path in self._entries():
            try:
                st = path.lstat()  # a link is not followed: it is no object of ours
            except OSError:  # gone meanwhile (another process)
                continue
            if path.name.startswith(_TMP):
                if _abandoned(path.name, st.st_mtime, self.stale_tmp_after_s, now):
                    try:
                        path.unlink()
                        self.removed_temporaries += 1
                    except FileNotFoundError:
                        pass  # its writer renamed it, or another start-up removed it
                continue
            if path.suffix != _SUFFIX:
                continue
            try:
                key = bytes.fromhex(path.stem)
            except ValueError:
                continue
            if not stat.S_ISREG(st.st_mode):
                self.objects_damaged += 1
                continue
            found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._used += size

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._sizes)

    # ---- catalogue (call with the lock held) ------------------------------------------------

    def _note(self, key: bytes, size: int, *, ours: bool = False) -> None:
        """`key` is on disk with `size` bytes: most recent; adopted if it was not listed
        and we did not just write it."""
        old = self._sizes.pop(key, None)
        if old is None and not ours:
            self.adopted += 1
        self._sizes[key] = size
        self._used += size - (old or 0)

    def _forget(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used -= size

    def _not_regular(self, key: bytes) -> None:
        with self._lock:
            self.objects_damaged += 1
            self._forget(key)

    # ---- blocking operations (run in threads) -----------------------------------------------

    def _put(self, key: bytes, parts: Sequence[Buffer]) -> bool:
        path = self._path(key)
        if path.parent not in self._dirs:
            try:
                path.parent.mkdir(mode=0o700, exist_ok=True)
            except FileExistsError:  # a file (or a dangling link) where the shard goes
                self._not_regular(key)
                return False
            self._dirs.add(path.parent)
        tmp = path.parent / temporary_name()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with open(fd, "wb", buffering=0) as f:
                for part in parts:  # unbuffered: each part goes to the kernel from where it is
                    view = memoryview(part)
                    written = 0
                    while written < view.nbytes:
                        written += f.write(view[written:]) or 0
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except IsADirectoryError:  # a directory where the object goes: not ours to replace
            tmp.unlink(missing_ok=True)
            self._not_regular(key)
            return False
        except NotADirectoryError:  # the shard became a file since we made it
            self._dirs.discard(path.parent)
            self._not_regular(key)
            return False
        except FileNotFoundError:  # our temporary, or its shard, was removed under us
            tmp.unlink(missing_ok=True)
            self._dirs.discard(path.parent)  # made again by the next put
            self._check_root()  # the whole directory gone is a failure, not a refusal
            return False
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._note(key, sum(memoryview(part).nbytes for part in parts), ours=True)
            victims = self._over_budget()
        for victim in victims:
            self._unlink(self._path(victim))
        return True

    def _over_budget(self) -> list[bytes]:
        victims = []
        while self._used > self.capacity_bytes and len(self._sizes) > 1:
            key, size = self._sizes.popitem(last=False)
            self._used -= size
            victims.append(key)
        return victims

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(IsADirectoryError):  # not an object of ours: left alone
            path.unlink(missing_ok=True)

    def _open(self, key: bytes) -> tuple[int, int] | None:
        """The object's fd and size, or None where there is no regular file (a miss; the
        catalogue forgets it). `O_NONBLOCK`: opening a FIFO never waits for a writer;
        `O_NOFOLLOW`: a link is refused (ELOOP), never followed elsewhere; nor is a shard
        directory that is a link."""
        path = self._path(key)
        try:
            if stat.S_ISLNK(os.lstat(path.parent).st_mode):  # a shard that is a link
                self._not_regular(key)
                return None
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno not in _NOT_AN_OBJECT:
                raise
            if exc.errno == errno.ENOENT:
                with self._lock:
                    self._forget(key)
            else:  # ENOTDIR: the shard is a file; the others: not a regular file
                self._not_regular(key)
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            self._not_regular(key)
            return None
        return fd, st.st_size

    def _get(self, key: bytes) -> bytes | None:
        opened = self._open(key)
        if opened is None:
            return None
        fd, size = opened
        with os.fdopen(fd, "rb", buffering=0) as f:
            data = f.read()
        with self._lock:
            self._note(key, size)
        return data

    def _get_parts(self, key: bytes, targets: Sequence[memoryview]) -> int:
        opened = self._open(key)
        if opened is None:
            return MISSING
        fd, size = opened
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
            self._note(key, size)
        return got

    def _stat(self, key: bytes) -> bool:
        """Whether a regular object file exists for `key` (adopted when found)."""
        try:
            st = os.lstat(self._path(key))
        except OSError as exc:
            if exc.errno not in _NOT_AN_OBJECT:
                raise
            if exc.errno == errno.ENOTDIR:  # the shard is a file: counted, like a bad object
                self._not_regular(key)
            return False
        if not stat.S_ISREG(st.st_mode):
            self._not_regular(key)
            return False
        with self._lock:
            self._note(key, st.st_size)
        return True

    def _delete(self, key: bytes) -> None:
        self._unlink(self._path(key))
        with self._lock:
            self._forget(key)

    def _check_root(self) -> None:
        """Raise when the L3 directory itself is gone (unmounted, removed): a failure of the
        whole backend, for the breaker — not a miss per key. Checked after a batch that
        missed, so a miss costs one more `stat` per batch, none per key."""
        try:
            st = os.stat(self.root)
        except OSError as exc:
            raise TierUnavailableError(
                f"file L3 at {str(self.root)!r}: the directory is gone ({exc.strerror}); "
                "it must exist and be a directory for the backend's lifetime"
            ) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise TierUnavailableError(
                f"file L3 at {str(self.root)!r}: is no longer a directory; it must stay one "
                "for the backend's lifetime"
            )

    def _gets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out = [self._get(k) for k in keys]
        if any(v is None for v in out):
            self._check_root()
        return out

    def _gets_parts(
        self,
        keys: Sequence[bytes],
        targets: Sequence[Sequence[memoryview]],
        landed: Landed | None = None,
    ) -> list[int]:
        out = []
        for i, (key, target) in enumerate(zip(keys, targets, strict=True)):
            out.append(self._get_parts(key, target))
            if landed is not None:  # verified now, while the object is in the CPU's cache
                landed(i, out[-1:])
        if MISSING in out:
            self._check_root()
        return out

    def _stats(self, keys: Sequence[bytes]) -> list[bool]:
        out = [self._stat(k) for k in keys]
        if not all(out):
            self._check_root()
        return out

    # ---- async interface ------------------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        return await asyncio.to_thread(self._put_all, ((k, [d]) for k, d in items))

    def _put_all(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        """On a worker thread: object by object, until `stop_writes` (then not stored)."""
        out = []
        for key, parts in items:
            out.append(not self._stopped.is_set() and self._put(key, list(parts)))
        return out

    def stop_writes(self) -> None:
        self._stopped.set()

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return await asyncio.to_thread(self._gets, keys)

    vectored_put = True
    chunked_put = True
    vectored_get = True  # readv: the payload lands in the caller's pages, no second copy
    streamed_get = True

    async def get_parts_many(
        self,
        keys: Sequence[bytes],
        targets: Sequence[Sequence[memoryview]],
        *,
        landed: Landed | None = None,
    ) -> list[int]:
        return await asyncio.to_thread(self._gets_parts, keys, targets, landed)

    async def put_parts_many(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        return await asyncio.to_thread(self._put_all, items)

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """The catalogue's answer, and for keys it lacks the filesystem's (one `os.stat`
        each, on a thread): objects another process persisted are found and adopted."""
        with self._lock:
            known = [k in self._sizes for k in keys]
        unknown = [k for k, listed in zip(keys, known, strict=True) if not listed]
        if not unknown:
            return known
        found = iter(await asyncio.to_thread(self._stats, unknown))
        return [listed or next(found) for listed in known]

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        def delete_all() -> None:
            for key in keys:
                self._delete(key)

        await asyncio.to_thread(delete_all)
