"""The format of every L3 object: a fixed header, then the payload.

    magic "HKV1" | version u16 | key length u16 | payload length u64 | xxh3-64 u64 | key | payload

`decode` checks the magic, version, that the stored key is the key asked for (a hash
collision or a misplaced object is not served), the length and the payload's checksum; any
mismatch raises `ObjectCorruptError` and the caller treats the object as a miss (and deletes
it). The checksum is xxh3-64: ~32 GB/s here, where zlib's CRC-32 ran at 2.3 GB/s and capped
L3 throughput (benchmarks/storage.py).
"""

from __future__ import annotations

import struct

import xxhash

from hicache.errors import ObjectCorruptError

MAGIC = b"HKV1"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQ")
HEADER_BYTES = _HEADER.size


def encoded_size(key: bytes, payload_bytes: int) -> int:
    return HEADER_BYTES + len(key) + payload_bytes


def encode_into(out: memoryview, key: bytes, payload: bytes | bytearray | memoryview) -> int:
    """Write one object into `out` (at least `encoded_size` bytes); returns its size."""
    body = memoryview(payload).cast("B")
    _HEADER.pack_into(out, 0, MAGIC, VERSION, len(key), body.nbytes, xxhash.xxh3_64_intdigest(body))
    start = HEADER_BYTES + len(key)
    out[HEADER_BYTES:start] = key
    out[start : start + body.nbytes] = body
    return start + body.nbytes


def header(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """The header and key of `payload`'s object: written before the payload, uncopied, by
    backends with vectored writes — the same bytes `encode_into` lays out."""
    body = memoryview(payload).cast("B")
    fixed = _HEADER.pack(MAGIC, VERSION, len(key), body.nbytes, xxhash.xxh3_64_intdigest(body))
    return fixed + key


def encode(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """One object as new bytes (the store encodes into its arena with `encode_into`)."""
    out = bytearray(encoded_size(key, memoryview(payload).nbytes))
    encode_into(memoryview(out), key, payload)
    return bytes(out)


def decode(key: bytes, data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise ObjectCorruptError(
            f"object {key.hex()}: {view.nbytes} bytes is shorter than the "
            f"{HEADER_BYTES}-byte header"
        )
    magic, version, key_len, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise ObjectCorruptError(
            f"object {key.hex()}: header {bytes(magic)!r} v{version}; expected {MAGIC!r} v{VERSION}"
        )
    stored_key = bytes(view[HEADER_BYTES : HEADER_BYTES + key_len])
    if stored_key != key:
        raise ObjectCorruptError(f"object {key.hex()}: holds key {stored_key.hex()}")
    payload = view[HEADER_BYTES + key_len :]
    if payload.nbytes != length:
        raise ObjectCorruptError(
            f"object {key.hex()}: payload is {payload.nbytes} bytes; its header says {length}"
        )
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise ObjectCorruptError(f"object {key.hex()}: payload checksum mismatch")
    return payload


def verify_parts(key: bytes, head: memoryview, parts: list[memoryview], read: int) -> None:
    """Check an object scattered by a vectored read: `head` holds the header and key, `parts`
    the payload (exactly as long as the header says), `read` the bytes the read returned."""
    if read < HEADER_BYTES + len(key):
        raise ObjectCorruptError(f"object {key.hex()}: {read} bytes is shorter than its header")
    magic, version, key_len, length, checksum = _HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise ObjectCorruptError(
            f"object {key.hex()}: header {bytes(magic)!r} v{version}; expected {MAGIC!r} v{VERSION}"
        )
    if key_len != len(key) or bytes(head[HEADER_BYTES : HEADER_BYTES + key_len]) != key:
        raise ObjectCorruptError(f"object {key.hex()}: holds another key")
    payload = sum(p.nbytes for p in parts)
    if length != payload or read != HEADER_BYTES + key_len + payload:
        raise ObjectCorruptError(
            f"object {key.hex()}: {read - HEADER_BYTES - key_len} payload bytes read; its "
            f"header says {length}, the target holds {payload}"
        )
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    if digest.intdigest() != checksum:
        raise ObjectCorruptError(f"object {key.hex()}: payload checksum mismatch")
