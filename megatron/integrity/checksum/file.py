"""Block checksums of one file, the unit of the persistent tier's ``integrity.json``: xxh3-64 of
every :data:`BLOCK_BYTES` block (read zero-copy from the page cache through ``mmap``), the file
size, and one xxh3-128 over both, the file checksum (algorithm ``xxh3-64-blocks`` v1); ``sha256``
for upstream's manifests. Used by :mod:`megatron.integrity.manifest`.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, Tuple, Union

import xxhash

__all__ = [
    "ALGORITHM",
    "BLOCK_BYTES",
    "VERSION",
    "FileChecksum",
    "file_checksum",
    "hash_file",
    "sha256_file",
]

ALGORITHM = "xxh3-64-blocks"
VERSION = 1
BLOCK_BYTES = 4 << 20
"""Bytes per block checksum (4 MiB): the precision of the byte range a problem names; a 1 TB
checkpoint gets ~250k block checksums (~5 MB of JSON)."""


@dataclass(frozen=True)
class FileChecksum:
    """Checksums of one file: ``size`` in bytes, one xxh3-64 hex checksum per :data:`BLOCK_BYTES`
    block (``blocks``) and the file checksum (``checksum``: xxh3-128 hex of size and blocks; the
    value ``integrity.json`` records under ``"files"``)."""

    size: int
    blocks: Tuple[str, ...]
    checksum: str


def file_checksum(size: int, blocks: Sequence[str]) -> str:
    """The file checksum of ``xxh3-64-blocks`` v1: xxh3-128 hex of the algorithm, ``size``
    (bytes) and the block checksums (hex, in order)."""
    h = xxhash.xxh3_128()
    h.update(f"{ALGORITHM}:{VERSION}:{size}:".encode())
    h.update("".join(blocks).encode())
    return h.hexdigest()


def _blocks(path: Path, block_bytes: int) -> Iterable[memoryview]:
    """The file's bytes in blocks, zero-copy from the page cache (mmap) where possible."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        try:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # a file system without mmap: read with a reused buffer
            buf = memoryview(bytearray(block_bytes))
            while n := f.readinto(buf):
                yield buf[:n]
            return
        try:
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(m)
            try:
                for off in range(0, size, block_bytes):
                    part = view[off : off + block_bytes]
                    try:
                        yield part
                    finally:
                        part.release()
            finally:
                view.release()
        finally:
            m.close()


def hash_file(path: Union[str, os.PathLike], block_bytes: int = BLOCK_BYTES) -> FileChecksum:
    """xxh3-64 of every ``block_bytes`` block of ``path`` and the file checksum.

    Raises:
        OSError: the file cannot be opened or read.
    """
    path = Path(path)
    blocks = [xxhash.xxh3_64_hexdigest(b) for b in _blocks(path, block_bytes)]
    size = path.stat().st_size
    return FileChecksum(size=size, blocks=tuple(blocks), checksum=file_checksum(size, blocks))


def sha256_file(path: Path) -> str:
    """SHA-256 hex checksum of ``path`` (upstream's ``integrity.json`` algorithm), read in
    :data:`BLOCK_BYTES` blocks. Raises ``OSError`` when the file cannot be read."""
    import hashlib

    h = hashlib.sha256()
    for b in _blocks(path, BLOCK_BYTES):
        h.update(b)
    return h.hexdigest()
