"""Block checksums of what a save *wrote*, taken from the bytes on their way to the file.

A manifest hashed from disk after the save records whatever is on disk then: had a second job
written the same ``iter_<N>`` in phase, the manifest would faithfully record a mix of two saves
and verify it. Here the writer's stream for each data file (``__<rank>_<n>.distcp``) and the
coordinator's ``.metadata`` feed :class:`BlockHasher` as they are written (the same
``xxh3-64-blocks`` checksums as :func:`megatron.integrity.checksum.file.hash_file`), so the
manifest records this save's bytes and a file another save replaced fails verification.

A data file may be written in another process (megatron-core's async writer): its checksums travel
back as a small side file named with the save's token (``__0_0.distcp.<token>.written``, removed
when the manifest is written); a side file of another save has another token and is never read.
The patches that route megatron-core's writer through here are declared in
:mod:`megatron.training_ext.persistent_tier`.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import threading
import uuid
from typing import Callable, Dict, Optional

import xxhash

from megatron.integrity.checksum.file import BLOCK_BYTES, FileChecksum, file_checksum

__all__ = [
    "SIDE_SUFFIX",
    "BlockHasher",
    "HashingFile",
    "hashing_open",
    "is_side_file",
    "new_save",
    "record",
    "run_with_token",
    "take_written",
]

#: Suffix of the side files that carry a data file's checksums from the writer process.
SIDE_SUFFIX = ".written"
_SIDE = re.compile(r"\.[0-9a-f]{32}" + re.escape(SIDE_SUFFIX) + "$")
_DATA_FILE = re.compile(r"__\d+_\d+\.distcp$")

_local = threading.local()
_TOKEN: Dict[str, Optional[str]] = {"token": None}  # this process's save in progress (writer side)
_SAVES: Dict[str, str] = {}  # realpath of a checkpoint dir -> the token of this rank's save
_RECORDED: Dict[str, Dict[str, FileChecksum]] = {}  # realpath -> name -> checksums (this process)


class BlockHasher:
    """Incremental ``xxh3-64-blocks``: feed bytes in order with :meth:`update`; :meth:`checksum`
    equals :func:`~megatron.integrity.checksum.file.hash_file` of a file holding them."""

    def __init__(self, block_bytes: int = BLOCK_BYTES):
        self.block_bytes = block_bytes
        self.size = 0
        self._blocks: list = []
        self._h = xxhash.xxh3_64()
        self._fill = 0

    def update(self, data) -> None:
        """Feed ``data`` (bytes-like, any length)."""
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._fill)
            self._h.update(view[:take])
            self._fill += take
            self.size += take
            view = view[take:]
            if self._fill == self.block_bytes:
                self._blocks.append(self._h.hexdigest())
                self._h.reset()
                self._fill = 0

    def checksum(self) -> FileChecksum:
        """The :class:`~megatron.integrity.checksum.file.FileChecksum` of the bytes fed so far."""
        blocks = self._blocks + ([self._h.hexdigest()] if self._fill else [])
        return FileChecksum(
            size=self.size, blocks=tuple(blocks), checksum=file_checksum(self.size, blocks)
        )


class HashingFile:
    """A binary file opened for writing whose bytes also feed a :class:`BlockHasher`; on close,
    ``on_close(checksum)`` is called, or ``on_close(None)`` when the writes were not sequential
    (a ``seek`` or ``truncate``): then the file is hashed from disk as before."""

    def __init__(
        self,
        raw,
        on_close: Callable[[Optional[FileChecksum]], None],
        block_bytes: int = BLOCK_BYTES,
    ):
        self._raw = raw
        self._on_close = on_close
        self._hasher: Optional[BlockHasher] = BlockHasher(block_bytes)

    def write(self, data) -> int:
        n = self._raw.write(data)
        if self._hasher is not None:
            view = memoryview(data).cast("B")
            self._hasher.update(view if n is None or n == len(view) else view[:n])
        return n

    def seek(self, *a, **kw):
        self._hasher = None
        return self._raw.seek(*a, **kw)

    def truncate(self, *a, **kw):
        self._hasher = None
        return self._raw.truncate(*a, **kw)

    def checksum_so_far(self) -> Optional[FileChecksum]:
        """The checksums of the bytes written so far, or ``None`` after a ``seek``/``truncate``."""
        return None if self._hasher is None else self._hasher.checksum()

    def close(self) -> None:
        if self._raw.closed:
            return
        self._raw.close()
        self._on_close(None if self._hasher is None else self._hasher.checksum())

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:  # a failed write records nothing
            self._raw.close()
        return False


def _side_path(data_path: str, token: str) -> str:
    return f"{data_path}.{token}{SIDE_SUFFIX}"


def is_side_file(name: str) -> bool:
    """Whether ``name`` is a checksum side file (never part of a checkpoint's manifest)."""
    return bool(_SIDE.search(name))


def _write_side(data_path: str, token: str, d: Optional[FileChecksum]) -> None:
    if d is None:
        return
    tmp = _side_path(data_path, token) + ".tmp"
    with builtins.open(tmp, "w") as f:
        # the file checksum's key is "digest" (the side file's format, unchanged)
        json.dump({"size": d.size, "blocks": list(d.blocks), "digest": d.checksum}, f)
    os.replace(tmp, _side_path(data_path, token))


def hashing_open(file, mode="r", *args, **kwargs):
    """``open`` for megatron-core's checkpoint writer: a data file opened ``"wb"`` during a save
    of this process (:func:`run_with_token`) is a :class:`HashingFile` that leaves its checksums in
    a side file; anything else is the builtin ``open``."""
    raw = builtins.open(file, mode, *args, **kwargs)
    token = _TOKEN["token"]
    if token is None or mode != "wb" or not _DATA_FILE.search(os.fspath(file)):
        return raw
    path = os.fspath(file)
    return HashingFile(raw, lambda d: _write_side(path, token, d))


def new_save(checkpoint_dir) -> str:
    """A fresh token for this rank's save into ``checkpoint_dir`` (remembered for
    :func:`take_written`)."""
    token = uuid.uuid4().hex
    _SAVES[os.path.realpath(os.fspath(checkpoint_dir))] = token
    _RECORDED.pop(os.path.realpath(os.fspath(checkpoint_dir)), None)
    return token


def run_with_token(token: str, fn: Callable, *args, **kwargs):
    """Call ``fn`` (megatron-core's write function, in whatever process runs it) with data files
    hashed as they are written under ``token``."""
    prev = _TOKEN["token"]
    _TOKEN["token"] = token
    try:
        return fn(*args, **kwargs)
    finally:
        _TOKEN["token"] = prev


def record(checkpoint_dir, name: str, checksum: FileChecksum) -> None:
    """Record the checksums of ``name`` written by this process into ``checkpoint_dir`` (the
    coordinator's ``.metadata``)."""
    _RECORDED.setdefault(os.path.realpath(os.fspath(checkpoint_dir)), {})[name] = checksum


def take_written(checkpoint_dir, names) -> Dict[str, FileChecksum]:
    """The checksums of ``names`` as this rank's save wrote them (side files of this save's token,
    then this process's records), removing this save's side files. Files without one are absent
    (the caller hashes them from disk)."""
    root = os.path.realpath(os.fspath(checkpoint_dir))
    token = _SAVES.pop(root, None)
    out: Dict[str, FileChecksum] = dict(_RECORDED.pop(root, {}))
    if token is None:
        return {n: d for n, d in out.items() if n in names}
    for n in names:
        side = _side_path(os.path.join(root, n), token)
        try:
            with builtins.open(side) as f:
                r = json.load(f)
            out[n] = FileChecksum(
                size=int(r["size"]), blocks=tuple(r["blocks"]), checksum=r["digest"]
            )
        except (OSError, ValueError, KeyError):
            continue
        try:
            os.unlink(side)
        except OSError:
            pass
    return {n: d for n, d in out.items() if n in names}
