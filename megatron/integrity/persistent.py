"""Read access to a persistent ``torch_dist`` checkpoint (megatron-core 0.19.2,
``--ckpt-format torch_dist``: PyTorch DCP's ``.metadata`` + ``__<rank>_<n>.distcp`` data files), as
the verifier (:mod:`megatron.verify`) uses it: storage ranges, reading tensor regions (any region:
PyTorch DCP's own ``FileSystemReader`` with ``create_read_items_for_chunk_list``; one saved chunk:
a zero-copy view of the mapped file) and objects, and streaming every chunk of one data file. The
format and the reading strategy are described in ``docs/verify.md``. Locating the iteration
directory and chunk coverage: :mod:`megatron.integrity.persistent_dirs`; reading ``.metadata``:
:func:`~megatron.integrity.dcp_metadata.read_dcp_metadata` (all three re-exported here).
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.integrity import unpickle
from megatron.integrity.dcp_metadata import DcpMetadataError, read_dcp_metadata  # re-exported
from megatron.integrity.manifest import INTEGRITY_FNAME  # one definition (megatron-core's name)
from megatron.integrity.persistent_dirs import (  # the first three re-exported
    CheckpointInputError,
    check_chunk_cover,
    resolve_persistent_dir,
    volume,
)
from megatron.integrity.readahead import ReadAhead
from megatron.integrity.torch_save import mapped_tensor

__all__ = [
    "CheckpointInputError",
    "DcpMetadataError",
    "INTEGRITY_FNAME",
    "PersistentCheckpoint",
    "check_chunk_cover",
    "read_dcp_metadata",
    "resolve_persistent_dir",
]

# ---------------------------------------------------------------------------------------------
# DCP reading
# ---------------------------------------------------------------------------------------------


class _CallbackPlanner(LoadPlanner):
    """A ``LoadPlanner`` for ``FileSystemReader.read_data``: tensors go to ``resolve(read_item)``
    (which returns the destination view), ``commit(read_item, tensor)`` is called after the copy,
    byte objects go to ``load_bytes(read_item, BytesIO)``."""

    def __init__(self, resolve=None, commit=None, load_bytes=None):
        self._resolve, self._commit, self._load_bytes = resolve, commit, load_bytes

    def set_up_planner(self, state_dict=None, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(
        self,
    ) -> LoadPlan:  # pragma: no cover - not used (plans are built directly)
        raise NotImplementedError

    def create_global_plan(self, global_plan):  # pragma: no cover
        return global_plan

    def finish_plan(self, central_plan):  # pragma: no cover
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._load_bytes(read_item, value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self._resolve(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self._commit is not None:
            self._commit(read_item, tensor)


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, int(o), int(n))
    return t


class PersistentCheckpoint:
    """An opened ``torch_dist`` iteration directory.

    Args:
        path: the iteration directory (see :func:`resolve_persistent_dir`).
        iteration: its iteration, if known.

    Attributes:
        path: the directory.
        iteration: training iteration (from the directory name, else from the common state).
        metadata: the DCP ``Metadata``.
        tensors: key -> ``TensorStorageMetadata``.
        objects: key -> ``BytesStorageMetadata``.
        data_files: data file name -> size in bytes (files referenced by ``storage_data``;
            ``-1`` when missing).

    Raises:
        DcpMetadataError: ``.metadata`` is absent or cannot be read (a
            :class:`CheckpointInputError`).
    """

    def __init__(self, path: Union[str, os.PathLike], iteration: Optional[int] = None):
        self._maps: Dict[str, Optional[mmap.mmap]] = {}
        self.path = Path(path)
        self.reader = FileSystemReader(str(self.path))
        self.metadata = read_dcp_metadata(self.path, reader=self.reader)
        self.reader.set_up_storage_reader(self.metadata, True)
        self.tensors: Dict[str, TensorStorageMetadata] = {}
        self.objects: Dict[str, BytesStorageMetadata] = {}
        for k, v in self.metadata.state_dict_metadata.items():
            if isinstance(v, TensorStorageMetadata):
                self.tensors[k] = v
            else:
                self.objects[k] = v
        self.storage = self.metadata.storage_data
        self.data_files: Dict[str, int] = {}
        for info in self.storage.values():
            name = info.relative_path
            if name not in self.data_files:
                f = self.path / name
                self.data_files[name] = f.stat().st_size if f.is_file() else -1
        self.iteration = iteration if iteration is not None else self._iteration_from_common()

    # ---- metadata ----------------------------------------------------------------------------

    def _iteration_from_common(self) -> Optional[int]:
        if _COMMON_KEY not in self.objects:
            return None
        got = self.read_objects([_COMMON_KEY])[_COMMON_KEY]
        if isinstance(got, dict) and isinstance(got.get("iteration"), int):
            return got["iteration"]
        return None

    def chunk_items(self) -> List[Tuple[str, int, ChunkStorageMetadata]]:
        """``(key, chunk index, chunk)`` of every tensor chunk, sorted by key."""
        return [
            (k, i, c) for k in sorted(self.tensors) for i, c in enumerate(self.tensors[k].chunks)
        ]

    def storage_ok(self, index: MetadataIndex) -> bool:
        """Whether the storage entry of ``index`` exists and lies inside an existing data file
        (the checks that name what is wrong: :func:`megatron.verify.persistent_checks.
        metadata_problems`)."""
        info = self.storage.get(index)
        return (
            info is not None
            and self.data_files.get(info.relative_path, -1) >= 0
            and int(info.offset) + int(info.length) <= self.data_files[info.relative_path]
        )

    # ---- reading -----------------------------------------------------------------------------

    def _map(self, name: str) -> Optional[mmap.mmap]:
        if name not in self._maps:
            try:
                with open(self.path / name, "rb") as f:
                    # private copy-on-write mapping: writable for torch.frombuffer, never written
                    self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):
                self._maps[name] = None
        return self._maps[name]

    def chunk_view(self, key: str, chunk: ChunkStorageMetadata) -> Optional[torch.Tensor]:
        """Zero-copy view of one saved chunk: a tensor over a memory map of its data file.

        The chunk's blob (``torch.save`` zip inside the ``.distcp`` file) is mapped with
        :func:`megatron.integrity.torch_save.mapped_tensor`. Returns ``None`` whenever that does
        not hold exactly (a storage transform, several storages, a non-contiguous or partial view,
        a dtype or shape other than the metadata's, a record beyond the blob): callers then read
        the chunk through DCP's reader, which copies.

        Returns:
            A read-only-in-practice CPU tensor of ``chunk.sizes`` and the checkpoint dtype, or
            ``None``.
        """
        index = MetadataIndex(key, chunk.offsets)
        info = self.storage.get(index)
        md = self.tensors.get(key)
        if (
            info is None
            or md is None
            or getattr(info, "transform_descriptors", None)
            or not self.storage_ok(index)
        ):
            return None
        mm = self._map(info.relative_path)
        if mm is None:
            return None
        view = mapped_tensor(mm, int(info.offset), int(info.length))
        if (
            view is None
            or view.dtype != md.properties.dtype
            or tuple(view.shape) != tuple(chunk.sizes)
        ):
            return None
        return view

    def storage_range(self, key: str, offsets: Sequence[int]) -> Optional[Tuple[Path, int, int]]:
        """``(data file path, byte offset, length)`` of the saved chunk of ``key`` at ``offsets``
        (for read-ahead hints), or ``None``."""
        info = self.storage.get(MetadataIndex(key, torch.Size(offsets)))
        if info is None:
            return None
        return self.path / info.relative_path, int(info.offset), int(info.length)

    def _read(
        self, items: List[ReadItem], planner: LoadPlanner, done: set
    ) -> List[Tuple[ReadItem, BaseException]]:
        """Run ``items`` through ``FileSystemReader.read_data`` in file/offset order. On an error,
        retries the items not yet done one at a time so that each failure is attributed to its
        item. ``done`` is filled by the planner callbacks with ``id(read_item)``.

        Returns:
            ``(read_item, exception)`` for every item that could not be read.
        """
        if not items:
            return []

        def order(ri: ReadItem):
            info = self.storage.get(ri.storage_index)
            return (info.relative_path, int(info.offset)) if info is not None else ("", -1)

        items = sorted(items, key=order)
        try:
            self.reader.read_data(LoadPlan(items), planner).wait()
            return []
        except Exception:  # noqa: BLE001 - any read failure means: fall back to the per-item path below
            pass
        failed = []
        for ri in items:
            if id(ri) in done:
                continue
            try:
                self.reader.read_data(LoadPlan([ri]), planner).wait()
            except Exception as e:  # noqa: BLE001 - reported per item
                failed.append((ri, e))
        return failed

    def _chunk_sizes(self, key: str) -> Dict[tuple, tuple]:
        cache = self.__dict__.setdefault("_chunk_cache", {})
        if key not in cache:
            cache[key] = {tuple(c.offsets): tuple(c.sizes) for c in self.tensors[key].chunks}
        return cache[key]

    def read_regions(
        self, requests: Sequence[Tuple[str, Sequence[int], Sequence[int]]]
    ) -> List[Union[torch.Tensor, str]]:
        """Read regions of persistent tensors.

        Args:
            requests: ``(key, offsets, sizes)`` per region, in elements of the global tensor (one
                entry per global axis, prepended axes included).

        Returns:
            Per request, a contiguous CPU tensor of shape ``sizes`` and the checkpoint's dtype
            holding the region's values, or a message saying why it could not be read (key absent,
            region not fully covered by saved chunks, storage unreadable). A region that is exactly
            one saved chunk (the usual case: same parallelism) is a zero-copy view of the mapped
            file (:meth:`chunk_view`); other regions are assembled by DCP's reader into new
            tensors.
        """
        results: List[Union[torch.Tensor, str]] = [""] * len(requests)
        items: List[ReadItem] = []
        for i, (key, offsets, sizes) in enumerate(requests):
            md = self.tensors.get(key)
            if md is None:
                results[i] = f"key '{key}' is not in the persistent checkpoint"
                continue
            if len(offsets) != len(md.size):
                results[i] = (
                    f"'{key}' has {len(md.size)} axes {list(md.size)} in the persistent "
                    f"checkpoint, the local shard {len(offsets)}"
                )
                continue
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            if tuple(offsets) in self._chunk_sizes(key) and self._chunk_sizes(key)[
                tuple(offsets)
            ] == tuple(sizes):
                view = self.chunk_view(key, chunk)  # the region is exactly one saved chunk
                if view is not None:
                    results[i] = view
                    continue
            ris = create_read_items_for_chunk_list(key, md, [chunk])
            covered = sum(volume(ri.lengths) for ri in ris)
            if covered < volume(sizes):
                results[i] = (
                    f"the persistent chunks of '{key}' {list(md.size)} cover only {covered} of the "
                    f"{volume(sizes)} elements of region offsets={list(offsets)} "
                    f"sizes={list(sizes)}"
                )
                continue
            results[i] = torch.empty(tuple(sizes), dtype=md.properties.dtype)
            for ri in ris:
                items.append(
                    dataclasses.replace(ri, dest_index=MetadataIndex(key, tuple(offsets), i))
                )
        done: set = set()

        def resolve(ri: ReadItem) -> torch.Tensor:
            return _narrow(results[ri.dest_index.index], ri.dest_offsets, ri.lengths)

        def commit(ri: ReadItem, _t) -> None:
            done.add(id(ri))

        for ri, e in self._read(items, _CallbackPlanner(resolve, commit), done):
            info = self.storage.get(ri.storage_index)
            where = (
                f"{info.relative_path} @ {info.offset}" if info is not None else "no storage entry"
            )
            results[ri.dest_index.index] = (
                f"cannot read persistent chunk of '{ri.storage_index.fqn}' at "
                f"{list(ri.storage_index.offset or ())} ({where}): {type(e).__name__}: {e}"
            )
        return results

    def _object_name(self, key: str) -> str:
        """``<dir>/<data file> (object '<key>')``: where a byte object lies, for errors."""
        info = next(
            (v for k, v in (self.metadata.storage_data or {}).items() if k.fqn == key), None
        )
        file = info.relative_path if info is not None else "?"
        return f"{self.path / file} (object {key!r})"

    def read_objects(self, keys: Sequence[str]) -> Dict[str, Any]:
        """Read and unpickle byte objects (``ShardedObject`` / common state) by DCP key.

        Returns:
            key -> object, or the ``Exception`` that reading / unpickling raised (``KeyError`` for a
            key not in the checkpoint).

        Objects are unpickled restricted to the allowlist of :mod:`megatron.integrity.unpickle`:
        one naming any other global is an ``UnsafeCheckpointError`` here (nothing imported).
        """
        out: Dict[str, Any] = {}
        items = []
        for k in keys:
            if k not in self.objects:
                out[k] = KeyError(f"'{k}' is not in the persistent checkpoint")
                continue
            items.append(_whole_read_item(LoadItemType.BYTE_IO, MetadataIndex(k), (0,)))
        done: set = set()

        def load_bytes(ri: ReadItem, value: io.BytesIO) -> None:
            done.add(id(ri))
            try:
                out[ri.dest_index.fqn] = unpickle.torch_load(
                    value, map_location="cpu", what=self._object_name(ri.dest_index.fqn)
                )
            except Exception as e:  # noqa: BLE001
                out[ri.dest_index.fqn] = e

        for ri, e in self._read(items, _CallbackPlanner(load_bytes=load_bytes), done):
            out[ri.dest_index.fqn] = e
        return out

    def stream_file(
        self,
        name: str,
        on_tensor: Callable[[str, ChunkStorageMetadata, torch.Tensor], None],
        on_object: Callable[[str, Any], None],
        readahead: Optional[ReadAhead] = None,
    ) -> List[Tuple[str, Optional[List[int]], BaseException]]:
        """Read every chunk and object stored in data file ``name``, one at a time, in file order.

        Args:
            name: data file name (a key of :attr:`data_files`).
            on_tensor: called with ``(key, chunk, tensor)`` for each chunk (tensor: the whole chunk,
                CPU, the checkpoint's dtype; a zero-copy view of the mapped file where possible).
            on_object: called with ``(key, object)`` for each byte object, unpickled.
            readahead: if given, every entry's byte range is queued on it first and waited for
                before the entry is used, so that reading and checking overlap.

        Returns:
            ``(key, chunk offsets or None, exception)`` for entries that could not be read. Entries
            whose storage range is invalid (see :meth:`storage_ok`) are not read.
        """
        chunks: Dict[Tuple[str, tuple], ChunkStorageMetadata] = {}
        for key, _i, c in self.chunk_items():
            chunks[(key, tuple(c.offsets))] = c
        entries = self._file_entries(name)
        tickets = [
            readahead.add(self.path / name, off, length) if readahead is not None else -1
            for off, length, _ in entries
        ]
        items = []
        for (_off, _length, index), ticket in zip(entries, tickets):
            if readahead is not None:
                readahead.wait(ticket)
            item = self._stream_entry(index, chunks, on_tensor)
            if item is not None:
                items.append(item)
        failed = self._read_streamed(items, chunks, on_tensor, on_object)
        return [
            (
                ri.storage_index.fqn,
                None if ri.storage_index.offset is None else list(ri.storage_index.offset),
                e,
            )
            for ri, e in failed
        ]

    def _file_entries(self, name: str) -> List[Tuple[int, int, MetadataIndex]]:
        """``(byte offset, length, index)`` of the tensor chunks and objects stored in data file
        ``name`` whose storage range is valid (:meth:`storage_ok`), in file order."""
        return sorted(
            (
                (int(info.offset), int(info.length), index)
                for index, info in self.storage.items()
                if info.relative_path == name
                and self.storage_ok(index)
                and (index.fqn in self.tensors or index.fqn in self.objects)
            ),
            key=lambda e: e[0],
        )

    def _stream_entry(
        self,
        index: MetadataIndex,
        chunks: Dict[Tuple[str, tuple], ChunkStorageMetadata],
        on_tensor: Callable[[str, ChunkStorageMetadata, torch.Tensor], None],
    ) -> Optional[ReadItem]:
        """One storage entry of :meth:`stream_file`: a chunk that maps zero-copy goes to
        ``on_tensor`` now; a chunk that does not and an object return the ``ReadItem`` that
        reads it through DCP's reader; a chunk that ``chunks`` (the metadata) lacks is skipped
        (``None``)."""
        if index.fqn not in self.tensors:
            return _whole_read_item(LoadItemType.BYTE_IO, index, (0,))
        c = chunks.get((index.fqn, tuple(index.offset or ())))
        if c is None:
            return None
        view = self.chunk_view(index.fqn, c)
        if view is not None:
            on_tensor(index.fqn, c, view)
            return None
        return _whole_read_item(LoadItemType.TENSOR, index, c.sizes)

    def _read_streamed(
        self,
        items: List[ReadItem],
        chunks: Dict[Tuple[str, tuple], ChunkStorageMetadata],
        on_tensor: Callable[[str, ChunkStorageMetadata, torch.Tensor], None],
        on_object: Callable[[str, Any], None],
    ) -> List[Tuple[ReadItem, BaseException]]:
        """Read :meth:`stream_file`'s ``items`` through DCP's reader (:meth:`_read`): each chunk
        into a new tensor handed to ``on_tensor``, each object unpickled to ``on_object``.

        Returns:
            ``(read_item, exception)`` for every item that could not be read.
        """
        done: set = set()
        current: Dict[int, torch.Tensor] = {}

        def resolve(ri: ReadItem) -> torch.Tensor:
            md = self.tensors[ri.dest_index.fqn]
            t = torch.empty(tuple(ri.lengths), dtype=md.properties.dtype)
            current[id(ri)] = t
            return t

        def commit(ri: ReadItem, _t) -> None:
            done.add(id(ri))
            t = current.pop(id(ri))
            on_tensor(
                ri.dest_index.fqn, chunks[(ri.dest_index.fqn, tuple(ri.dest_index.offset))], t
            )

        def load_bytes(ri: ReadItem, value: io.BytesIO) -> None:
            done.add(id(ri))
            obj = unpickle.torch_load(
                value, map_location="cpu", what=self._object_name(ri.dest_index.fqn)
            )
            on_object(ri.dest_index.fqn, obj)

        return self._read(items, _CallbackPlanner(resolve, commit, load_bytes), done)


_COMMON_KEY = "common_state/shard_0_1"
"""DCP key of megatron-core's common state (the ``ShardedObject('common_state')``)."""


def _whole_read_item(kind: LoadItemType, index: MetadataIndex, lengths: Sequence[int]) -> ReadItem:
    """A ``ReadItem`` of the whole stored entry ``index`` into a destination of the same index:
    a tensor chunk (``LoadItemType.TENSOR``, ``lengths``: its sizes, offsets zero) or a byte
    object (``LoadItemType.BYTE_IO``, ``lengths`` ``(0,)``)."""
    zeros = torch.Size([0] * len(lengths))
    return ReadItem(
        type=kind,
        dest_index=index,
        dest_offsets=zeros,
        storage_index=index,
        storage_offsets=zeros,
        lengths=torch.Size(lengths),
    )


def read_common_state(checkpoint_dir: Union[str, os.PathLike]) -> Any:
    """The common state of a ``torch_dist`` checkpoint, as upstream's ``load_common_state_dict``
    returns it (a legacy ``common.pt``, else the ``common_state`` byte object), read by the
    restricted unpickler (:mod:`megatron.integrity.unpickle`) without a process group and without
    upstream's reader (usable before the persistent tier's patches are installed).

    Raises:
        UnsafeCheckpointError: a file names a global outside the allowlist (nothing imported).
        DcpMetadataError, KeyError, OSError, ...: no readable common state.
    """
    legacy = Path(checkpoint_dir) / "common.pt"
    if legacy.is_file():
        return unpickle.torch_load(legacy, map_location="cpu")
    got = PersistentCheckpoint(checkpoint_dir).read_objects([_COMMON_KEY])[_COMMON_KEY]
    if isinstance(got, BaseException):
        raise got
    return got[0] if isinstance(got, (list, tuple)) else got
