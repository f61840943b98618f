"""Checks of the persistent checkpoint: its metadata (chunk coverage and storage entries,
:func:`metadata_problems`), every chunk and object of one data file read and scanned for NaN/Inf
(persistent-only mode), and the integrity manifest (``integrity.json``:
this fork's ``xxh3-64-blocks`` or megatron-core's ``sha256``). Problems go to a
:class:`~megatron.verify.findings.Findings`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from megatron.integrity import manifest as _manifest
from megatron.integrity import unpickle
from megatron.integrity.checksum import tensor as ck
from megatron.integrity.persistent import (
    INTEGRITY_FNAME,
    CheckpointInputError,
    PersistentCheckpoint,
    check_chunk_cover,
)
from megatron.integrity.readahead import ReadAhead
from megatron.integrity.tensor_ops import count_nonfinite
from megatron.verify.findings import Findings
from megatron.verify.options import VerifyOptions
from megatron.verify.report import FileResult, Problem

__all__ = [
    "check_manifest_files",
    "check_persistent_file",
    "file_size",
    "manifest_names",
    "metadata_problems",
    "read_failure_kind",
    "read_manifest",
]


def file_size(p: Path) -> int:
    """Size of ``p`` in bytes, 0 when it cannot be read."""
    try:
        return p.stat().st_size
    except OSError:
        return 0


def metadata_problems(pc: PersistentCheckpoint) -> List[Problem]:
    """Coverage of every tensor's global shape by its chunks, storage entries (present, inside an
    existing file), and a legacy ``common.pt`` (restricted unpickling). Reads no tensor data.

    Returns:
        ``coverage`` and ``storage`` problems (empty when the metadata is consistent).
    """
    problems: List[Problem] = []
    for key in sorted(pc.tensors):
        md = pc.tensors[key]
        errs = check_chunk_cover(
            tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        )
        for e in errs:
            problems.append(
                Problem(
                    "coverage",
                    f"persistent tensor '{key}' {list(md.size)}: {e}",
                    role="persistent",
                    key=key,
                    shape=list(md.size),
                    dtype=str(md.properties.dtype).removeprefix("torch."),
                )
            )
    for key, idx, chunk in pc.chunk_items():
        problems += _storage_problems(
            pc, MetadataIndex(key, chunk.offsets, idx), key, list(chunk.offsets)
        )
    for key in sorted(pc.objects):
        problems += _storage_problems(pc, MetadataIndex(key), key, None)
    return problems + _legacy_common_problems(pc)


def read_failure_kind(e: BaseException) -> str:
    """``"unsafe_pickle"`` for a file naming a global outside the unpickling allowlist, else
    ``"unreadable"``."""
    return "unsafe_pickle" if isinstance(e, unpickle.UnsafeCheckpointError) else "unreadable"


def _legacy_common_problems(pc: PersistentCheckpoint) -> List[Problem]:
    """A ``common.pt`` in the directory (megatron-core loads it instead of the ``common_state``
    object when present): unpickled restricted, tensors left out."""
    path = pc.path / "common.pt"
    if not path.is_file():
        return []
    try:
        unpickle.load_without_tensors(path)
    except Exception as e:  # noqa: BLE001 - any failure is this file's finding
        return [
            Problem(
                read_failure_kind(e),
                f"persistent common.pt cannot be read: {type(e).__name__}: {e}",
                file="common.pt",
                role="persistent",
            )
        ]
    return []


def _storage_problems(
    pc: PersistentCheckpoint, index: MetadataIndex, key: str, offsets
) -> List[Problem]:
    info = pc.storage.get(index)
    where = f"'{key}'" + (f" chunk at {offsets}" if offsets is not None else "")
    if info is None:
        return [
            Problem(
                "storage",
                f"persistent {where} has no storage entry in .metadata",
                role="persistent",
                key=key,
                global_offset=offsets,
            )
        ]
    size = pc.data_files.get(info.relative_path, -1)
    if size < 0:
        return [
            Problem(
                "storage",
                f"persistent {where}: data file {info.relative_path} is missing",
                file=info.relative_path,
                role="persistent",
                key=key,
                global_offset=offsets,
            )
        ]
    end = int(info.offset) + int(info.length)
    if end > size:
        return [
            Problem(
                "storage",
                f"persistent {where}: bytes {info.offset}..{end} lie beyond the end of "
                f"{info.relative_path} ({size} bytes): the file is truncated",
                file=info.relative_path,
                role="persistent",
                key=key,
                global_offset=offsets,
                details={
                    "storage_offset": int(info.offset),
                    "storage_length": int(info.length),
                    "file_size": size,
                },
            )
        ]
    return []


def check_persistent_file(
    pc: PersistentCheckpoint,
    name: str,
    opts: VerifyOptions,
    part: Findings,
    progress: Optional[Callable[[int], None]] = None,
    ra: Optional[ReadAhead] = None,
) -> None:
    """Read every chunk and object of data file ``name`` (``unreadable`` problems), scanning
    chunks for NaN/Inf (``nonfinite``) when ``opts.check_nonfinite``."""
    size = max(pc.data_files.get(name, 0), 0)
    res = FileResult(file=name, role="persistent", file_bytes=size)
    part.files.append(res)
    part.bytes_read += size
    reported = 0

    def on_tensor(key: str, chunk, t: torch.Tensor) -> None:
        nonlocal reported
        res.tensors += 1
        n = t.numel() * t.element_size()
        if opts.check_nonfinite:
            res.bytes_scanned += n
            nan, inf = count_nonfinite(t)
            if nan or inf:
                res.nonfinite_tensors += 1
                part.problems.append(
                    Problem(
                        "nonfinite",
                        f"persistent {name}: '{key}' chunk at {list(chunk.offsets)} "
                        f"({ck.dtype_name(t.dtype)}{list(t.shape)}) holds {nan} NaN and {inf} "
                        f"Inf of {t.numel()} elements",
                        file=name,
                        role="persistent",
                        key=key,
                        global_offset=[int(o) for o in chunk.offsets],
                        shape=list(t.shape),
                        dtype=ck.dtype_name(t.dtype),
                        nbytes=n,
                        details={"nan": nan, "inf": inf},
                    )
                )
        if progress is not None:
            progress(n)
            reported += n

    def on_object(key: str, obj: Any) -> None:
        res.objects_read += 1  # read and unpickled

    failed = pc.stream_file(
        name, on_tensor, on_object, ra if (ra is not None and ra.enabled) else None
    )
    for key, offsets, e in failed:
        part.problems.append(
            Problem(
                read_failure_kind(e),
                f"persistent {name}: '{key}'"
                + (f" chunk at {offsets}" if offsets is not None else "")
                + f" cannot be read: {type(e).__name__}: {e}",
                file=name,
                role="persistent",
                key=key,
                global_offset=offsets,
            )
        )
    if progress is not None and size > reported:
        progress(size - reported)


def read_manifest(pc: PersistentCheckpoint) -> Optional[dict]:
    """The checkpoint's ``integrity.json`` (``{"algorithm": ..., "files": {name: ...}}``) or
    ``None`` when it was saved without one.

    Raises:
        CheckpointInputError: the file exists but is not valid JSON.
    """
    p = pc.path / INTEGRITY_FNAME
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise CheckpointInputError(f"{p} is not valid JSON: {e}") from e


def manifest_names(manifest: dict) -> List[str]:
    """The file names a manifest covers, sorted."""
    return sorted(manifest.get("files", {}))


def check_manifest_files(
    pc: PersistentCheckpoint, names: Sequence[str], manifest: dict, part: Findings
) -> None:
    """Verify ``names`` (this rank's share) of the checkpoint's ``integrity.json`` with
    :func:`megatron.integrity.manifest.check_files` (a bad file is named with the byte range that
    differs, for ``xxh3-64-blocks``)."""
    if manifest.get("algorithm", "sha256") not in (
        _manifest.ALGORITHM,
        _manifest.UPSTREAM_ALGORITHM,
    ):
        part.manifest_failed.append(
            ("*", f"unsupported algorithm {manifest.get('algorithm')!r} in integrity.json")
        )
        return
    for n in names:
        part.manifest_checked += 1
        part.bytes_read += file_size(pc.path / n)
    for p in _manifest.check_files(pc.path, manifest, names):
        part.manifest_failed.append((p.file, str(p)[len(p.file) + 2 :]))
