"""Reading ``torch.save`` archives without ``torch.load``: where each tensor storage's bytes lie,
a zero-copy view of a saved tensor, and the pickled object with every tensor left out.

A ``torch.save`` file (PyTorch >= 1.6) is a zip archive: ``<name>/data.pkl`` (the pickled object)
and one record ``<name>/data/<key>`` per storage, stored uncompressed. The byte offset of a
record's data is its local header's offset + 30 + name length + extra length (PKWARE APPNOTE
4.3.7). Every function here reads only the zip directory, local headers and the pickle.
"""

from __future__ import annotations

import io
import os
import re
import struct
import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from megatron.integrity import unpickle

__all__ = [
    "MapView",
    "StorageRecord",
    "load_without_tensors",
    "crc32_options_per_thread",
    "mapped_tensor",
    "save_archive",
    "set_pickle_crc",
    "storage_crc_off",
    "storage_records",
    "tensor_file_ranges",
]

_STORAGE = re.compile(r"/data/\d+$")
_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_LEN = 30


@dataclass(frozen=True)
class StorageRecord:
    """One storage record of a ``torch.save`` archive.

    Attributes:
        name: the archive member (``"<name>/data/<key>"``).
        offset: byte offset of the record's data from the archive's start.
        nbytes: the record's length in bytes.
    """

    name: str
    offset: int
    nbytes: int


def _open(source: Union[str, os.PathLike, IO[bytes]]) -> Tuple[IO[bytes], bool]:
    if isinstance(source, (str, os.PathLike)):
        return open(source, "rb"), True
    return source, False


def storage_records(source: Union[str, os.PathLike, IO[bytes]]) -> List[StorageRecord]:
    """The storage records (``.../data/<n>``) of a ``torch.save`` archive, in directory order.

    Args:
        source: a path, or a seekable binary file object positioned anywhere (offsets are from
            its position 0).

    Raises:
        ValueError: a storage record is compressed or its local header is malformed.
        OSError, zipfile.BadZipFile: unreadable, or not a zip archive.
    """
    f, owned = _open(source)
    try:
        out = []
        for info in zipfile.ZipFile(f).infolist():
            if not _STORAGE.search(info.filename):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"storage record {info.filename} is compressed")
            data = _data_offset(f, info, "storage record ")
            out.append(StorageRecord(info.filename, data, info.file_size))
        return out
    finally:
        if owned:
            f.close()


def _data_offset(f: IO[bytes], info: zipfile.ZipInfo, what: str = "") -> int:
    """Byte offset in ``f`` of the data of record ``info``: its local header's offset + 30 + name
    length + extra length.

    Raises:
        ValueError: no local header where the directory says (``what`` prefixes the name).
    """
    f.seek(info.header_offset)
    head = f.read(_LOCAL_HEADER_LEN)
    if len(head) != _LOCAL_HEADER_LEN or head[:4] != _LOCAL_HEADER:
        raise ValueError(f"{what}{info.filename}: no local header at {info.header_offset}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + _LOCAL_HEADER_LEN + name_len + extra_len


def tensor_file_ranges(
    path: str, tensors: Sequence[torch.Tensor]
) -> Optional[List[Tuple[int, int]]]:
    """``(offset, nbytes)`` in the file of each tensor of a memory-mapped
    ``torch.load(path, mmap=True)``, or ``None`` when that cannot be established exactly.

    The storages of a mapped file are slices of one mapping in file order; the mapping's base is
    the one address shift under which every storage starts exactly at a record of its size (the
    file may hold more records: tensors in objects).
    """
    try:
        recs = [(r.offset, r.nbytes) for r in storage_records(path) if r.nbytes]
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    storages: Dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            storages[st.data_ptr()] = st.nbytes()
    ptrs = sorted(storages)
    if not ptrs or len(ptrs) > len(recs):
        return None
    rec_size = dict(recs)
    where: Optional[Dict[int, int]] = None
    for off0 in sorted(rec_size):  # the record of the lowest storage fixes the mapping's base
        base = ptrs[0] - off0
        if all(rec_size.get(p - base) == storages[p] for p in ptrs):
            where = {p: p - base for p in ptrs}
            break
    if where is None:
        return None
    out = []
    for t in tensors:
        st = t.untyped_storage()
        if not st.nbytes():
            out.append((0, 0))
            continue
        out.append(
            (
                where[st.data_ptr()] + t.storage_offset() * t.element_size(),
                t.numel() * t.element_size(),
            )
        )
    return out


class MapView(io.RawIOBase):
    """A seekable, read-only file over ``buf[start:start + length]`` (an ``mmap``; no copy)."""

    def __init__(self, buf: Any, start: int, length: int):
        super().__init__()
        self._buf, self._start, self._len, self._pos = buf, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        a = self._start + self._pos
        b[:n] = self._buf[a : a + n]
        self._pos += n
        return n


def mapped_tensor(buf: Any, start: int, length: int) -> Optional[torch.Tensor]:
    """Zero-copy CPU view of the one tensor that ``torch.save`` wrote to ``buf[start:start +
    length]`` (``buf``: a writable ``mmap``, e.g. ``ACCESS_COPY``), or ``None`` unless that holds
    exactly: one storage record, uncompressed, a contiguous tensor lying inside it and the blob.

    The tensor is opened on the meta device first (``torch.load(map_location="meta")``: dtype,
    shape, storage offset; no data read).
    """
    try:
        meta = unpickle.torch_load(MapView(buf, start, length), map_location="meta")
        records = storage_records(MapView(buf, start, length))
    except Exception:  # noqa: BLE001 - anything unexpected: not a plain saved tensor
        return None
    if not isinstance(meta, torch.Tensor) or not meta.is_contiguous() or len(records) != 1:
        return None
    rec = records[0]
    itemsize = meta.element_size()
    nbytes = meta.numel() * itemsize
    first = rec.offset + meta.storage_offset() * itemsize
    if first + nbytes > rec.offset + rec.nbytes or rec.offset + rec.nbytes > length:
        return None
    if nbytes == 0:
        return torch.empty(tuple(meta.shape), dtype=meta.dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start + first)
    return raw.view(meta.dtype).reshape(tuple(meta.shape))


def load_without_tensors(path: Union[str, os.PathLike]) -> Any:
    """The object a ``torch.save`` file holds, with every tensor replaced by ``None`` (reads the
    archive's directory and its ``data.pkl`` only), restricted to the allowlist of
    :mod:`megatron.integrity.unpickle` (see :func:`~megatron.integrity.unpickle.
    load_without_tensors`, which this is).

    Raises:
        UnsafeCheckpointError: the pickle names a global outside the allowlist (nothing imported).
        ValueError: the archive has no ``data.pkl``.
        OSError, zipfile.BadZipFile, pickle.UnpicklingError, ...: missing, truncated or not a zip.
    """
    return unpickle.load_without_tensors(path)


# --------------------------------------------------------------------------- writing an archive

_NO_STORAGE_CRC = threading.local()
_CENTRAL_HEADER = b"PK\x01\x02"
_CENTRAL_HEADER_LEN = 46


def crc32_options_per_thread(upstream: Any) -> Any:
    """Patch factory for ``torch.serialization.get_crc32_options`` (which ``torch.save`` reads when
    it opens its zip writer): upstream's global setting, except in a thread inside
    :func:`storage_crc_off`. A per-thread switch, because ``torch.serialization.
    set_crc32_options`` is process-wide and a save in another thread (the persistent tier's
    ``common.pt``, a DCP byte item) must keep its CRC-32 (readers using ``zipfile`` check it)."""
    from megatron.overlay import wraps_upstream

    @wraps_upstream(upstream)
    def get_crc32_options() -> bool:
        """Upstream's, or ``False`` inside :func:`storage_crc_off` in this thread."""
        if getattr(_NO_STORAGE_CRC, "on", False):
            return False
        return upstream()

    return get_crc32_options


class storage_crc_off:
    """Context manager: a ``torch.save`` in this thread computes no CRC-32 (needs
    :func:`crc32_options_per_thread` installed; without it the save computes CRC-32 as usual).
    Only for archives whose tensors carry their own checksums and whose pickle
    :func:`save_archive` protects."""

    def __enter__(self) -> "storage_crc_off":
        self._prev = getattr(_NO_STORAGE_CRC, "on", False)
        _NO_STORAGE_CRC.on = True
        return self

    def __exit__(self, *exc: Any) -> None:
        _NO_STORAGE_CRC.on = self._prev


def save_archive(obj: Any, f: IO[bytes]) -> None:
    """``torch.save(obj, f)`` without CRC-32 of the storage records, then the CRC-32 of
    ``data.pkl`` written into its local and central headers, so ``zipfile`` (which this
    package's readers use for the pickle) still checks the pickle.

    Why: ``torch.save`` computes CRC-32 (miniz, about 1.8 GB/s) over every storage record and
    ``torch.load`` never checks it; for a 78 MB local checkpoint that is 42 of its 65 ms. Use it
    only where every tensor carries its own checksum (the local tier's XXH3 record).

    Args:
        f: a seekable binary file object open for writing and reading (``"bx+"``/``"wb+"``),
            positioned at 0; left positioned at its end.

    Raises:
        ValueError: the archive has no ``data.pkl``, or a header is not where the directory
            says (not a ``torch.save`` zip archive).
        OSError: the write failed.
    """
    with storage_crc_off():
        torch.save(obj, f)
    set_pickle_crc(f)
    f.seek(0, os.SEEK_END)


def set_pickle_crc(f: IO[bytes]) -> None:
    """Write the CRC-32 of a ``torch.save`` archive's ``data.pkl`` into its local header and its
    central directory entry (PKWARE APPNOTE 4.3.7 and 4.3.12: the CRC-32 at byte 14 of the
    local header and at byte 16 of the central header); other records are left as written.

    Raises:
        ValueError: no ``data.pkl``, or a header is not where the directory says.
        OSError, zipfile.BadZipFile: unreadable, or not a zip archive.
    """
    f.seek(0)
    zf = zipfile.ZipFile(f)
    infos = [i for i in zf.infolist() if i.filename.endswith("/data.pkl")]
    if not infos:
        raise ValueError("not a torch.save archive: no data.pkl")
    info = infos[0]
    f.seek(_data_offset(f, info))
    crc = struct.pack("<I", zlib.crc32(f.read(info.compress_size)))
    pos = zf.start_dir
    while True:
        f.seek(pos)
        entry = f.read(_CENTRAL_HEADER_LEN)
        if len(entry) != _CENTRAL_HEADER_LEN or entry[:4] != _CENTRAL_HEADER:
            raise ValueError(f"{info.filename}: no central directory entry")
        n, e, c = struct.unpack("<HHH", entry[28:34])
        name = f.read(n).decode("utf-8")
        if name == info.filename:
            break
        pos += _CENTRAL_HEADER_LEN + n + e + c
    f.seek(info.header_offset + 14)
    f.write(crc)
    f.seek(pos + 16)
    f.write(crc)
    f.flush()
