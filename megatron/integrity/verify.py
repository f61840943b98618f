"""Checkpoint verifier: local (non-persistent) checkpoints against a persistent ``torch_dist``
checkpoint of the same iteration, or either one alone.

What is checked
---------------
*Local + persistent* (:func:`verify_checkpoint` with both directories): for every local file
(every rank's directory, primaries and replicas) and every ``ShardedTensor`` it holds data for:

* **bitwise equality** with the same region of the persistent checkpoint. The region is the local
  shard's place in the global tensor: ``ShardedTensor.key``, ``global_offset`` (elements, one per
  global axis) and sizes ``(1,) * prepend_axis_num + local_shape``. A region that is exactly one
  saved chunk (same parallelism: the usual case) is a zero-copy view of the memory-mapped ``.distcp``
  file; any other region is assembled from the overlapping chunks by PyTorch DCP's reader (see
  :mod:`megatron.integrity.persistent`). Equality is ``memcmp`` of the raw bytes (so ``NaN == NaN``
  with the same payload, ``-0.0 != 0.0``); dtypes must be identical;
* **stored checksums**: the xxh3 record the replication fix (:mod:`megatron.fixes.replication`)
  stores in each file (:mod:`megatron.integrity.checksums`); files without one get a warning;
* **NaN / Inf** in floating-point tensors (incl. bf16/fp16/fp8, complex);
* ``ShardedObject`` s held as main replica (``replica_id`` all zeros) against the persistent object of
  the same ``unique_key`` (deep equality; tensors bitwise); others are counted as not comparable;
* the local files together hold every region of every persistent tensor (``local_incomplete``), every
  rank has a file (``missing_owner``) and as many copies as the run's ``--replication-factor``
  (``missing_copy``, from the ``args`` stored in the files);
* the persistent checkpoint's metadata (chunk coverage, storage ranges); megatron-core's
  ``integrity.json`` only on request (``verify_manifest=True``): the bitwise comparison with local
  copies that pass their own checksums already checks the persistent tensor data.

*Persistent alone* (``local_dir=None``): metadata coverage (every tensor's global shape tiled
exactly by its chunks, storage entries inside existing files: catches truncated shards), every
chunk and object read and deserialised, NaN/Inf scan, and the integrity manifest
(``integrity.json``: this fork's per-block xxh3, written by every ``pretrain_gpt.py`` save unless
``--no-verify-integrity``, or megatron-core's SHA-256 per file): checked with
:func:`megatron.integrity.manifest.check_files`.

*Local alone* (``persistent_dir=None``): every local iteration found (only ``iteration`` when given),
each file checked once for stored checksums and NaN/Inf, and then:

* **copies agree**: every primary with each of its replicas, tensor by tensor (key, global offset,
  dtype, shape and checksum: the stored one, or for files without a record the one computed from
  the bytes), and their identity records (:mod:`megatron.integrity.local_identity`: run id, save
  token, iteration, owner, run settings, topology, host). A disagreement is a ``copies_differ``
  problem naming the shard, both files and how many tensors / which identity fields differ, with
  the likely wrong copy where the other files of the iteration tell (``suspect``). Shards whose
  copies agree but that come from different saves (run id, save token) are ``mixed_saves``. A copy
  damaged after its save fails its own checksums (``checksum_mismatch``) and does not count as
  verifying, but still agrees with intact copies by its stored record;
* **newest complete and consistent iteration** (``VerifyReport.newest_complete_iteration``):
  every owner rank ``0..N-1`` (``N``: the run's world size from the files' ``args``, else the
  highest owner seen + 1) has a copy that verifies, the copies of each shard agree and the shards
  come from one save; ``VerifyReport.local_iterations`` says for each iteration why it is not. A
  shard missing from an iteration while another one is complete and consistent is the trace of an
  interrupted save: a warning (``incomplete_iteration``); with no usable iteration, a problem
  (``missing_owner``). Too few copies of a shard (``--replication-factor``) is a problem;
* **leftovers** as warnings, by relative path: unfinished saves (``*.dirty.pt``), files the
  training run's local tier quarantined (``<rank>/rejected/``) and its bad-tier markers
  (``<rank>/LOCAL_TIER_BAD.json``, with their iteration and reason).

The copy comparison and the completeness of the iteration verified also run with a persistent
checkpoint.

Layout of a local checkpoint (NVRx 0.7.0 ``LocalCheckpointManager``)::

    <--non-persistent-local-ckpt-dir>/[<session_id>/]<holder rank>/iter_<7 digits>_<owner rank>_local.pt

The holder is the rank whose directory (node-local storage) holds the file; the owner is the rank
whose shard it is. ``holder == owner``: the *primary*; otherwise a *replica* made by replication.
Each file is ``torch.save`` of an ``MCoreTensorAwareStateDict``; loading it unpickles arbitrary
objects (``weights_only=False``), as training does.

Getting both tiers at the same iteration from ``pretrain_gpt.py``: the training loop saves the
persistent checkpoint instead of the local one when both intervals hit, but after the last
iteration it saves a persistent checkpoint unless ``train_iters % save_interval == 0``. So
``--train-iters 10 --save-interval 1000 --non-persistent-save-interval 10`` writes the local
checkpoint of iteration 10 in the loop and the persistent one of iteration 10 at the end (with
``integrity.json`` unless ``--no-verify-integrity``).

Parallelism and memory
----------------------
Single process (``group=None``) or one process per rank of a ``torch.distributed`` group (gloo, CPU;
e.g. ``torchrun --nproc-per-node N tools/verify_checkpoint.py ...``). Work is divided by file: every
rank lists the local files it can see (node-local directories work: a file is checked by a rank that
sees it), files of the same owner go to the same rank where possible (so the persistent regions they
share are read once and then served by the page cache), biggest first, to the least loaded rank.
Results are gathered on every rank (per-file findings, and per copy its tensors' checksums and
identity record, compared once gathered; leftovers each rank sees); the report is the same as a
single process would produce.

Each process makes one pass over each tensor's bytes, in 1 MiB blocks that stay in cache for all
checks (:func:`fused_scan`: xxh3, ``memcmp``, ``aminmax``), on memory-mapped files (local files via
``torch.load(mmap=True)``, persistent chunks via :meth:`PersistentCheckpoint.chunk_view`): no copies.
A background thread (:class:`megatron.integrity._readahead.ReadAhead`) reads the ranges needed next
(the next batch of the current file, its persistent chunks, the next file) with large sequential
reads, so that disk and CPU work overlap; cached ranges are skipped. Memory: the page cache holding
at most two local files and their persistent chunks, plus ``batch_bytes`` for persistent regions
that must be assembled from several chunks.

Exit status convention (``tools/verify_checkpoint.py``): 0 no problem, 1 problems found, 2 bad input.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import os
import re
import struct
import time
import traceback
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
import xxhash

# megatron-core: the classes local checkpoint files unpickle to (imported here so that their
# import time is not part of a verification's wall time)
from megatron.core.dist_checkpointing.dict_utils import nested_values as _nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject as _ShardedObject
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict  # noqa: F401
from megatron.integrity import checksums as ck
from megatron.integrity._readahead import ReadAhead
from megatron.integrity import local_identity
from megatron.integrity import manifest as _manifest
from megatron.integrity.local_identity import get_identity, parse_local_name
from megatron.integrity.persistent import (
    INTEGRITY_FNAME,
    CheckpointInputError,
    PersistentCheckpoint,
    check_chunk_cover,
    resolve_persistent_dir,
)
from megatron.integrity.report import FileResult, Problem, VerifyReport

__all__ = [
    "CheckpointInputError",
    "DEFAULT_BATCH_BYTES",
    "IterationMismatchError",
    "LocalFile",
    "LocalLayout",
    "VerifyReport",
    "bytes_equal",
    "count_nonfinite",
    "deep_difference",
    "discover_local",
    "fused_scan",
    "verify_checkpoint",
]

DEFAULT_BATCH_BYTES = 64 * 1024 * 1024
"""Most persistent tensor bytes held in memory at once while comparing one local file."""



class IterationMismatchError(CheckpointInputError):
    """The local and persistent checkpoints given are not of the same iteration."""


# ---------------------------------------------------------------------------------------------
# Local checkpoint discovery
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalFile:
    """One local checkpoint file.

    Attributes:
        path: absolute path.
        rel: path relative to the local root given by the user (``"1/iter_0000010_0_local.pt"``).
        holder_rank: the rank directory it is in.
        owner_rank: the rank whose shard it holds (from the file name).
        iteration: from the file name.
        size: bytes.
    """

    path: str
    rel: str
    holder_rank: int
    owner_rank: int
    iteration: int
    size: int

    @property
    def role(self) -> str:
        """``"primary"`` when the holder is the owner, else ``"replica"``."""
        return "primary" if self.holder_rank == self.owner_rank else "replica"


MARKER_NAME = local_identity.MARKER_NAME
QUARANTINE_DIR = local_identity.QUARANTINE_DIR


@dataclass
class LocalLayout:
    """Local checkpoint files found under a root.

    Attributes:
        root: the directory given.
        rank_root: the directory holding the ``<rank>/`` directories (``root`` or ``root/<session>``).
        files: iteration -> files, sorted by ``rel``.
        dirty: unfinished saves (``iter_*_local.dirty.pt``), relative paths.
        rejected: files in ``<rank>/rejected/`` (local files the training run quarantined), relative paths.
        markers: bad-tier markers (``<rank>/LOCAL_TIER_BAD.json``): relative path -> the marker's
            content (``{"unreadable": reason}`` when it cannot be parsed).
    """

    root: Path
    rank_root: Path
    files: Dict[int, List[LocalFile]]
    dirty: List[str] = field(default_factory=list)
    rejected: List[str] = field(default_factory=list)
    markers: Dict[str, dict] = field(default_factory=dict)

    @property
    def iterations(self) -> List[int]:
        """The iterations that have files, ascending."""
        return sorted(self.files)


def _read_marker(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"unreadable": f"{type(e).__name__}: {e}"}
    return data if isinstance(data, dict) else {"unreadable": f"a JSON {type(data).__name__}, not an object"}


def _scan_rank_dirs(d: Path, root: Path) -> Tuple[Dict[int, List[LocalFile]], List[str], List[str], Dict[str, dict]]:
    files: Dict[int, List[LocalFile]] = {}
    dirty: List[str] = []
    rejected: List[str] = []
    markers: Dict[str, dict] = {}
    for rank_dir in sorted(d.iterdir()):
        if not (rank_dir.is_dir() and rank_dir.name.isdigit()):
            continue
        holder = int(rank_dir.name)
        for f in sorted(rank_dir.iterdir()):
            parsed = parse_local_name(f.name)
            rel = str(f.relative_to(root))
            if parsed is not None and not parsed[2] and f.is_file():
                it, owner = parsed[0], parsed[1]
                files.setdefault(it, []).append(LocalFile(str(f.resolve()), rel, holder, owner, it, f.stat().st_size))
            elif f.name.startswith("iter_") and "dirty" in f.name:
                dirty.append(rel)
            elif f.name == MARKER_NAME and f.is_file():
                markers[rel] = _read_marker(f)
            elif f.name == QUARANTINE_DIR and f.is_dir():
                rejected += sorted(str(q.relative_to(root)) for q in f.rglob("*") if q.is_file())
    return files, dirty, rejected, markers


def discover_local(local_dir: Union[str, os.PathLike]) -> LocalLayout:
    """Find the local checkpoint files under ``local_dir``, and the leftovers of interrupted saves.

    Args:
        local_dir: the run's ``--non-persistent-local-ckpt-dir`` (holding ``<rank>/`` directories),
            or that directory's ``<session_id>/`` subdirectory.

    Returns:
        A :class:`LocalLayout` (possibly with no files: for distributed runs a rank may see none),
        with its ``dirty``, ``rejected`` and ``markers`` leftovers.

    Raises:
        CheckpointInputError: ``local_dir`` does not exist or is not a directory, or several session
            directories hold checkpoints (pass one of them).
    """
    root = Path(local_dir)
    if not root.exists():
        raise CheckpointInputError(f"local checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise CheckpointInputError(f"local checkpoint path {root} is not a directory")
    files, dirty, rejected, markers = _scan_rank_dirs(root, root)
    if files:
        return LocalLayout(root, root, files, dirty, rejected, markers)
    found = []
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and not sub.name.isdigit():
            scan = _scan_rank_dirs(sub, root)
            if scan[0]:
                found.append((sub, scan))
    if len(found) > 1:
        raise CheckpointInputError(
            f"{root} holds local checkpoints of several sessions ({[s.name for s, _ in found]}); "
            f"pass one of them, e.g. {found[0][0]}"
        )
    if found:
        sub, (f, dd, rj, mk) = found[0]
        return LocalLayout(root, sub, f, dirty + dd, rejected + rj, {**markers, **mk})
    return LocalLayout(root, root, {}, dirty, rejected, markers)


# ---------------------------------------------------------------------------------------------
# Tensor primitives
# ---------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_CHUNK_ELEMS = 1 << 24
SCAN_BLOCK_BYTES = 1 << 20
"""Block size of :func:`fused_scan` (bytes): small enough to stay in a core's L2 cache."""


def _dense(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors: same dtype, same shape and identical bytes.

    Args:
        a, b: plain strided tensors (any device; copied to CPU / made contiguous if needed).

    Returns:
        True when ``memcmp`` of their row-major bytes is 0 (``NaN`` payloads compare by bits;
        ``-0.0`` differs from ``0.0``).
    """
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    a, b = _dense(a), _dense(b)
    n = a.numel() * a.element_size()
    if n == 0:
        return True
    return _memcmp(a.data_ptr(), b.data_ptr(), n) == 0


def _float_view(c: torch.Tensor) -> torch.Tensor:
    if c.is_complex():
        return torch.view_as_real(c)
    return c


def count_nonfinite(t: torch.Tensor) -> Tuple[int, int]:
    """Number of NaN and of +-Inf elements of a tensor.

    Args:
        t: any plain tensor. Integer and bool tensors have none. Complex tensors count their real and
            imaginary parts separately. Dtypes without CPU kernels (``float8_*``) are converted to
            float32 chunk by chunk (``_CHUNK_ELEMS`` elements).

    Returns:
        ``(nan, inf)``. Fast path: ``aminmax`` per chunk (no temporaries); exact counts only for
        chunks whose min or max is not finite.
    """
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return 0, 0
    flat = _float_view(_dense(t)).reshape(-1)
    nan = inf = 0
    for s in range(0, flat.numel(), _CHUNK_ELEMS):
        c = flat[s:s + _CHUNK_ELEMS]
        try:
            mn, mx = torch.aminmax(c)
        except (RuntimeError, NotImplementedError):
            c = c.float()
            mn, mx = torch.aminmax(c)
        if math.isfinite(float(mn)) and math.isfinite(float(mx)):
            continue
        nan += int(torch.isnan(c).sum())
        inf += int(torch.isinf(c).sum())
    return nan, inf


def _diff_stats(a: torch.Tensor, b: torch.Tensor, global_offset: Sequence[int], prepend: int) -> Dict[str, Any]:
    """Where two same-dtype, same-shape tensors differ: number of differing elements, the first
    differing element's global index, and (floating point) the largest absolute difference among
    differing elements that are finite on both sides."""
    a, b = _dense(a), _dense(b)
    size = a.element_size()
    fa = a.reshape(-1).view(torch.uint8).view(-1, size) if a.numel() else a.reshape(-1)
    fb = b.reshape(-1).view(torch.uint8).view(-1, size) if b.numel() else b.reshape(-1)
    n_diff, first, max_abs = 0, None, None
    for s in range(0, a.numel(), _CHUNK_ELEMS):
        m = (fa[s:s + _CHUNK_ELEMS] != fb[s:s + _CHUNK_ELEMS]).any(dim=1)
        k = int(m.sum())
        if not k:
            continue
        n_diff += k
        if first is None:
            first = s + int(m.nonzero()[0, 0])
        if a.is_floating_point() or a.is_complex():
            va = a.reshape(-1)[s:s + _CHUNK_ELEMS][m]
            vb = b.reshape(-1)[s:s + _CHUNK_ELEMS][m]
            wide = torch.complex128 if a.is_complex() else torch.float64
            try:
                va, vb = va.to(wide), vb.to(wide)
            except (RuntimeError, TypeError):  # dtypes without a direct cast
                va, vb = va.float().to(wide), vb.float().to(wide)
            fin = torch.isfinite(va) & torch.isfinite(vb)
            if bool(fin.any()):
                d = float((va[fin] - vb[fin]).abs().max())
                max_abs = d if max_abs is None else max(max_abs, d)
    out: Dict[str, Any] = {"differing_elements": n_diff, "elements": a.numel()}
    if first is not None:
        local = []
        rem = first
        for dim in reversed(a.shape):
            local.append(rem % dim)
            rem //= dim
        local.reverse()
        gidx = list(global_offset[:prepend]) + [int(o) + int(i) for o, i in zip(global_offset[prepend:], local)]
        out["first_difference_global_index"] = gidx
        out["first_difference_values"] = [_scalar(a.reshape(-1)[first]), _scalar(b.reshape(-1)[first])]
    if max_abs is not None:
        out["max_abs_difference"] = max_abs
    return out


def _scalar(x: torch.Tensor) -> Any:
    try:
        v = x.item()
    except (RuntimeError, TypeError):
        v = x.float().item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, complex):
        return str(v)
    return v


def deep_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """First difference between two (nested) checkpoint objects, or ``None`` when they are equal.

    Tensors are compared bitwise (:func:`bytes_equal`), numpy arrays by dtype/shape/bytes,
    ``io.BytesIO`` by content, floats with ``NaN == NaN``, dicts by keys and values, lists/tuples
    element-wise, ``argparse.Namespace`` (and other objects with ``__dict__`` but no ``__eq__``) by
    their attributes, everything else with ``==``.

    Returns:
        A short description naming the path of the first difference (``"['rng_state'][0]: ..."``).
    """
    where = path or "<object>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        return None if bytes_equal(a, b) else f"{where}: tensor bytes differ"
    try:
        import numpy as np

        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
                return f"{where}: ndarray vs other"
            same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
            return None if same else f"{where}: array differs"
    except ImportError:  # pragma: no cover
        pass
    if isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):
        return None if a.getvalue() == b.getvalue() else f"{where}: bytes differ"
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{where}: keys differ ({sorted(map(str, set(a) ^ set(b)))[:5]})"
        for k in a:
            d = deep_difference(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = deep_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float):
        return None if (a == b or (math.isnan(a) and math.isnan(b))) else f"{where}: {a!r} vs {b!r}"
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return deep_difference(vars(a), vars(b), path + ".__dict__")
    try:
        eq = a == b
        if isinstance(eq, bool):
            return None if eq else f"{where}: {a!r:.60} vs {b!r:.60}"
    except Exception:  # noqa: BLE001
        pass
    import pickle

    try:
        return None if pickle.dumps(a) == pickle.dumps(b) else f"{where}: objects differ"
    except Exception:  # noqa: BLE001
        return f"{where}: cannot compare {type(a).__name__}"


# ---------------------------------------------------------------------------------------------
# One local file
# ---------------------------------------------------------------------------------------------


@dataclass
class _Options:
    check_nonfinite: bool = True
    batch_bytes: int = DEFAULT_BATCH_BYTES
    mmap: bool = True
    compare_objects: bool = True


@dataclass
class _Partial:
    """What one worker found (picklable; gathered to every rank)."""

    files: List[FileResult] = field(default_factory=list)
    problems: List[Problem] = field(default_factory=list)
    warnings: List[Problem] = field(default_factory=list)
    # key -> {(offsets, sizes): number of files holding it}: local regions seen (coverage of the
    # persistent tensors, copies per region)
    regions: Dict[str, Dict[Tuple[tuple, tuple], int]] = field(default_factory=dict)
    manifest_failed: List[Tuple[str, str]] = field(default_factory=list)
    manifest_checked: int = 0
    bytes_read: int = 0
    # local file rel -> what its copies are compared by (see _CopyPrint)
    prints: Dict[str, "_CopyPrint"] = field(default_factory=dict)


@dataclass
class _CopyPrint:
    """What one local file holds, for comparing the copies of a shard (picklable, builtin types):
    ``tensors``: ``(key, global offset, dtype, shape, stored checksum or None, checksum of the bytes
    or None)`` per tensor, in file order; ``identity``: the identity record (``None``: none);
    ``loaded``: the file could be loaded as a state dict."""

    loaded: bool = False
    identity: Optional[dict] = None
    tensors: List[Tuple[str, Optional[tuple], str, tuple, Optional[int], Optional[int]]] = field(default_factory=list)


def _where(lf: LocalFile) -> str:
    kind = "primary" if lf.role == "primary" else f"replica of rank {lf.owner_rank}'s shard held by rank {lf.holder_rank}"
    return f"{lf.rel} ({kind})"


def _sharded_parts(sd: Any) -> Tuple[Optional[list], list]:
    """ShardedTensors with data and ShardedObjects of an ``MCoreTensorAwareStateDict`` (``None``
    for state dicts of another type)."""
    if not hasattr(type(sd), "_sharded_tensors") or not hasattr(sd, "sharded_state_dict"):
        return None, []
    tensors = list(sd._sharded_tensors)
    objects = [x for x in _nested_values(sd.sharded_state_dict) if isinstance(x, _ShardedObject)]
    return tensors, objects


def _is_main_replica(replica_id: Any) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


@dataclass
class _OpenedLocal:
    """A local file loaded (memory-mapped) and, once planned, its read-ahead tickets."""

    lf: LocalFile
    res: FileResult
    base: dict
    sd: Any = None
    items: List[Tuple[str, Any, Any]] = field(default_factory=list)  # (key, tensor, ShardedTensor or None)
    objs: list = field(default_factory=list)
    entries: Optional[list] = None
    print: Optional[_CopyPrint] = None
    batches: List[List[int]] = field(default_factory=list)
    batch_tickets: List[int] = field(default_factory=list)
    failed: bool = False


def _tensor_file_ranges(path: str, tensors: Sequence[torch.Tensor]) -> Optional[List[Tuple[int, int]]]:
    """``(offset, nbytes)`` in the file of each tensor of a memory-mapped ``torch.load`` (``mmap=True``),
    or ``None`` when it cannot be established exactly.

    The storages of a mapped file are slices of one mapping in file order, and the file's
    ``.../data/<n>`` zip records give the storages' file offsets (stdlib ``zipfile``; records are
    stored uncompressed): the mapping's base is the one address shift under which every storage
    starts exactly at a record of its size (the file may hold more records: tensors in objects)."""
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
            recs = []
            for info in zf.infolist():
                if not re.search(r"/data/\d+$", info.filename) or info.file_size == 0:
                    continue
                f.seek(info.header_offset)
                head = f.read(30)
                if head[:4] != b"PK\x03\x04" or info.compress_type != zipfile.ZIP_STORED:
                    return None
                n, m = struct.unpack("<HH", head[26:30])
                recs.append((info.header_offset + 30 + n + m, info.file_size))
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    storages = {}
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
        out.append((where[st.data_ptr()] + t.storage_offset() * t.element_size(), t.numel() * t.element_size()))
    return out


def _open_local(lf: LocalFile, opts: _Options, part: _Partial) -> _OpenedLocal:
    """Load (map) a local file and read its metadata; problems go to ``part``."""
    res = FileResult(file=lf.rel, role=lf.role, holder_rank=lf.holder_rank, owner_rank=lf.owner_rank,
                     iteration=lf.iteration, file_bytes=lf.size)
    base = dict(file=lf.rel, holder_rank=lf.holder_rank, owner_rank=lf.owner_rank, role=lf.role,
                iteration=lf.iteration)
    op = _OpenedLocal(lf, res, base)
    op.print = part.prints[lf.rel] = _CopyPrint()
    try:
        try:
            sd = torch.load(lf.path, map_location="cpu", weights_only=False, mmap=opts.mmap)
        except RuntimeError:
            if not opts.mmap:
                raise
            # e.g. a file in the legacy (non-zip) format, which cannot be memory-mapped
            sd = torch.load(lf.path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        part.problems.append(Problem("unreadable", f"{_where(lf)}: cannot be loaded: {type(e).__name__}: {e}", **base))
        op.failed = True
        return op
    op.sd = sd
    op.print.loaded = True
    try:
        ident = get_identity(sd)
    except ValueError as e:
        part.problems.append(Problem("identity", f"{_where(lf)}: unusable identity record: {e}", **base))
        ident = {"unusable": str(e)}
    else:
        if ident is not None and (ident.get("iteration"), ident.get("owner_rank")) != (lf.iteration, lf.owner_rank):
            part.problems.append(Problem("identity", f"{_where(lf)}: its identity record is of rank "
                                         f"{ident.get('owner_rank')}'s shard of iteration {ident.get('iteration')}, "
                                         f"its name says rank {lf.owner_rank}, iteration {lf.iteration}", **base))
    res.has_identity = ident is not None
    op.print.identity = ident
    common = getattr(sd, "common", None)
    if isinstance(common, dict):
        args = common.get("args")
        if args is not None:
            res.world_size = getattr(args, "world_size", None)
            if getattr(args, "replication", False):
                res.replication_factor = getattr(args, "replication_factor", None)
        it = common.get("iteration")
        if isinstance(it, int) and it != lf.iteration:
            part.problems.append(Problem("iteration", f"{_where(lf)}: its common state says iteration {it}, "
                                                      f"its name says {lf.iteration}", **base))
    try:
        record = ck.get_record(sd)
    except ValueError as e:
        part.problems.append(Problem("checksum_mismatch", f"{_where(lf)}: unusable checksum record: {e}", **base))
        record = None
    res.has_checksum_record = record is not None
    if record is None:
        part.warnings.append(Problem("no_checksum_record", f"{_where(lf)}: no per-tensor checksum record "
                                     "(saved without the replication fix): stored checksums not checked", **base))
    elif record.get("owner_rank") != lf.owner_rank:
        part.problems.append(Problem("checksum_mismatch",
                                     f"{_where(lf)}: checksum record is of rank {record.get('owner_rank')}'s shard, "
                                     f"the file name says rank {lf.owner_rank}", **base))
    shs, objs = _sharded_parts(sd)
    if shs is None:
        # not an MCore tensor-aware state dict: checksums and NaN/Inf only
        tensors = list(getattr(sd, "tensors", []) or [])
        if not tensors and not hasattr(sd, "tensors"):
            part.problems.append(Problem("not_a_local_checkpoint",
                                         f"{_where(lf)}: holds a {type(sd).__name__}, not a tensor-aware state dict",
                                         **base))
            op.failed = True
            return op
        part.warnings.append(Problem("not_compared", f"{_where(lf)}: a {type(sd).__name__}: tensors have no "
                                     "global position, only checksums and NaN/Inf are checked", **base))
        op.items = [(f"tensor[{i}]", t, None) for i, t in enumerate(tensors)]
    else:
        op.items = [(sh.key, sh.data, sh) for sh in shs]
        op.objs = objs
    op.entries = record["entries"] if record is not None else None
    if op.entries is not None and len(op.entries) != len(op.items):
        part.problems.append(Problem("checksum_mismatch", f"{_where(lf)}: holds {len(op.items)} tensors, its "
                                     f"checksum record lists {len(op.entries)}", **base))
    res.tensors = len(op.items)
    # batches bounded by batch_bytes
    batch: List[int] = []
    size = 0
    for i, (_k, t, _sh) in enumerate(op.items):
        n = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        if batch and size + n > opts.batch_bytes:
            op.batches.append(batch)
            batch, size = [], 0
        batch.append(i)
        size += n
    if batch:
        op.batches.append(batch)
    return op


def _region(sh: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    return (tuple(int(o) for o in sh.global_offset),
            (1,) * sh.prepend_axis_num + tuple(int(s) for s in sh.local_shape))


def _plan_readahead(op: _OpenedLocal, pc: Optional[PersistentCheckpoint], ra: ReadAhead, mapped: bool) -> None:
    """Queue, batch by batch, each tensor's local bytes (when mapped) and its persistent chunk."""
    if op.failed or not ra.enabled:
        op.batch_tickets = [-1] * len(op.batches)
        return
    tensors = [t for _k, t, _sh in op.items]
    ranges = _tensor_file_ranges(op.lf.path, tensors) if mapped else None
    if mapped and ranges is None:
        ra.add(op.lf.path)  # the whole file first
    for b in op.batches:
        ticket = -1
        for i in b:
            _k, t, sh = op.items[i]
            if ranges is not None and ranges[i][1]:
                ticket = ra.add(op.lf.path, *ranges[i])
            if pc is not None and sh is not None:
                r = pc.storage_range(sh.key, _region(sh)[0])
                if r is not None:
                    ticket = ra.add(*r)
        op.batch_tickets.append(ticket)


def _check_opened(op: _OpenedLocal, pc: Optional[PersistentCheckpoint], opts: _Options, part: _Partial,
                  ra: ReadAhead, progress: Optional[Callable[[int], None]] = None) -> None:
    """All checks of one opened local file, batch by batch (each batch waits for its read-ahead)."""
    lf, res, base = op.lf, op.res, op.base
    part.files.append(res)
    part.bytes_read += lf.size
    reported = 0

    def advance(n: int) -> None:
        nonlocal reported
        if progress is not None and n > 0:
            progress(n)
            reported += n

    if not op.failed:
        for b, ticket in zip(op.batches, op.batch_tickets):
            ra.wait(ticket)
            regions: List[Union[torch.Tensor, str, None]] = [None] * len(b)
            if pc is not None and op.items and op.items[0][2] is not None:
                regions = pc.read_regions([(op.items[i][2].key, *_region(op.items[i][2])) for i in b])
                part.bytes_read += sum(r.numel() * r.element_size() for r in regions if isinstance(r, torch.Tensor))
            for j, i in enumerate(b):
                key, t, sh = op.items[i]
                _check_tensor(lf, res, part, base, i, key, t, sh, op.entries, regions[j], opts, op.print)
                if isinstance(t, torch.Tensor):
                    advance(t.numel() * t.element_size())
                if sh is not None:
                    reg = _region(sh)
                    per_key = part.regions.setdefault(sh.key, {})
                    per_key[reg] = per_key.get(reg, 0) + 1
            del regions
        if pc is not None and opts.compare_objects and op.objs:
            _check_objects(lf, res, part, base, op.objs, pc)
    advance(lf.size - reported)
    op.sd = None
    op.items = []
    op.objs = []


def fused_scan(t: torch.Tensor, ref: Optional[torch.Tensor] = None, want_checksum: bool = True,
               check_nonfinite: bool = True, block_bytes: int = SCAN_BLOCK_BYTES) -> Tuple[Optional[int], Optional[bool], bool]:
    """One pass over a tensor's bytes, block by block (each block stays in cache for all checks):
    xxh3 checksum (streamed; equal to :func:`megatron.integrity.checksums.tensor_checksum`), ``memcmp``
    against ``ref`` and a NaN/Inf test (``aminmax`` per block).

    Args:
        t: plain contiguous CPU tensor.
        ref: tensor of the same dtype and shape to compare with, or ``None``.
        want_checksum / check_nonfinite: which checks to run.
        block_bytes: block size in bytes (rounded down to a multiple of the element size).

    Returns:
        ``(checksum or None, equal or None, maybe_nonfinite)``; ``maybe_nonfinite`` is exact
        (True iff some element is NaN or +-Inf); count them with :func:`count_nonfinite`.
    """
    n = t.numel() * t.element_size()
    hasher = xxhash.xxh3_64() if want_checksum else None
    equal: Optional[bool] = None if ref is None else True
    nonfinite = False
    if n == 0:
        return (hasher.intdigest() if hasher else None), equal, False
    es = t.element_size()
    block = max(es, block_bytes - block_bytes % es)
    mv = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if hasher is not None else None
    ptr = t.data_ptr()
    rptr = ref.data_ptr() if ref is not None else 0
    fl = None
    if check_nonfinite and (t.is_floating_point() or t.is_complex()):
        fl = _float_view(t).reshape(-1)
        fes = fl.element_size()
    for s in range(0, n, block):
        m = min(block, n - s)
        if hasher is not None:
            hasher.update(mv[s:s + m])
        if equal and _memcmp(ptr + s, rptr + s, m) != 0:
            equal = False
        if fl is not None and not nonfinite:
            c = fl[s // fes:(s + m) // fes]
            try:
                mn, mx = torch.aminmax(c)
            except (RuntimeError, NotImplementedError):
                mn, mx = torch.aminmax(c.float())
            if not (math.isfinite(float(mn)) and math.isfinite(float(mx))):
                nonfinite = True
    return (hasher.intdigest() if hasher is not None else None), equal, nonfinite


def _check_tensor(lf, res: FileResult, part: _Partial, base: dict, i: int, key: str, t: Any, sh: Any,
                  entries: Optional[list], region: Union[torch.Tensor, str, None], opts: _Options,
                  cp: Optional[_CopyPrint] = None) -> None:
    offset = [int(o) for o in sh.global_offset] if sh is not None else None
    if not isinstance(t, torch.Tensor) or type(t).dequantize is not torch.Tensor.dequantize:
        part.problems.append(Problem("unreadable", f"{_where(lf)}: '{key}' is a {type(t).__name__}, "
                                     "not a plain tensor", **base, key=key))
        if cp is not None:
            cp.tensors.append((key, None if offset is None else tuple(offset), type(t).__name__, (), None, None))
        return
    prepend = int(sh.prepend_axis_num) if sh is not None else 0
    info = dict(base, key=key, global_offset=offset, prepend_axis_num=prepend, shape=list(t.shape),
                dtype=ck.dtype_name(t.dtype), nbytes=t.numel() * t.element_size())
    at = f"'{key}'" + (f" at {offset}" if offset is not None else "")
    t = _dense(t)

    # what to check
    entry = None
    if entries is not None and i < len(entries):
        entry = entries[i]
        if entry.get("key") != key or (offset is not None and entry.get("global_offset") not in (None, offset)):
            res.checksums_failed += 1
            part.problems.append(Problem("checksum_mismatch",
                                         f"{_where(lf)}: {at}: checksum record entry #{i} is for "
                                         f"'{entry.get('key')}' at {entry.get('global_offset')}", **info))
            entry = None
        elif entry.get("dtype") != info["dtype"] or list(entry.get("shape", [])) != info["shape"]:
            res.checksums_failed += 1
            part.problems.append(Problem("checksum_mismatch",
                                         f"{_where(lf)}: {at}: stored as {info['dtype']}{info['shape']}, the owner "
                                         f"checksummed {entry.get('dtype')}{entry.get('shape')}", **info))
            entry = None
    ref = None
    if isinstance(region, torch.Tensor):
        if region.dtype != t.dtype:
            part.problems.append(Problem("dtype_mismatch", f"{_where(lf)}: {at}: local dtype {info['dtype']}, "
                                         f"persistent {ck.dtype_name(region.dtype)}", **info))
        else:
            ref = _dense(region.reshape(t.shape))
    elif isinstance(region, str):
        part.problems.append(Problem("missing_in_persistent", f"{_where(lf)}: {at}: {region}", **info))

    # the checksum of the bytes is always computed: it verifies the stored one and, for files
    # without a record, is what their copies are compared by
    checksum, equal, maybe_nonfinite = fused_scan(t, ref, want_checksum=True, check_nonfinite=opts.check_nonfinite)
    if cp is not None:
        cp.tensors.append((key, None if offset is None else tuple(offset), info["dtype"], tuple(info["shape"]),
                           entry["checksum"] if entry is not None else None, checksum))
    # 1. stored checksum
    if entry is not None:
        if entry.get("algorithm", ck.ALGORITHM) != ck.ALGORITHM:  # e.g. pmix64 (hashed on a GPU)
            checksum = ck.tensor_checksum(t, entry["algorithm"])
        if checksum == entry["checksum"]:
            res.checksums_verified += 1
        else:
            res.checksums_failed += 1
            part.problems.append(Problem(
                "checksum_mismatch", f"{_where(lf)}: {at}: bytes hash to {checksum:#018x}, the file's record says "
                f"{entry['checksum']:#018x}", **info,
                details={"expected_checksum": entry["checksum"], "actual_checksum": checksum}))
    # 2. NaN / Inf
    if opts.check_nonfinite:
        res.bytes_scanned += info["nbytes"]
        if maybe_nonfinite:
            nan, inf = count_nonfinite(t)
            res.nonfinite_tensors += 1
            part.problems.append(Problem("nonfinite", f"{_where(lf)}: {at} ({info['dtype']}{info['shape']}) holds "
                                         f"{nan} NaN and {inf} Inf of {t.numel()} elements", **info,
                                         details={"nan": nan, "inf": inf}))
    # 3. against the persistent checkpoint
    if ref is None:
        return
    res.tensors_compared += 1
    res.bytes_compared += info["nbytes"]
    if equal:
        res.tensors_equal += 1
        return
    res.tensors_mismatched += 1
    stats = _diff_stats(t, ref, offset, prepend)
    pnan, pinf = count_nonfinite(ref)
    stats["persistent_nan"], stats["persistent_inf"] = pnan, pinf
    msg = (f"{_where(lf)}: {at} ({info['dtype']}{info['shape']}) differs from the persistent checkpoint in "
           f"{stats['differing_elements']} of {t.numel()} elements; first at global index "
           f"{stats.get('first_difference_global_index')} (local {stats['first_difference_values'][0]}, "
           f"persistent {stats['first_difference_values'][1]})")
    if "max_abs_difference" in stats:
        msg += f", max |difference| {stats['max_abs_difference']:.6g}"
    part.problems.append(Problem("value_mismatch", msg, **info, details=stats))


def _check_objects(lf: LocalFile, res: FileResult, part: _Partial, base: dict, objs: list,
                   pc: PersistentCheckpoint) -> None:
    wanted = []
    for o in objs:
        if not _is_main_replica(o.replica_id):
            res.objects_skipped += 1
            continue
        wanted.append(o)
    got = pc.read_objects([o.unique_key for o in wanted])
    for o in wanted:
        info = dict(base, key=o.key, global_offset=[int(x) for x in o.global_offset])
        p = got.get(o.unique_key)
        if isinstance(p, KeyError):
            res.objects_skipped += 1
            part.warnings.append(Problem("object_not_compared", f"{_where(lf)}: object '{o.unique_key}' is not in "
                                         "the persistent checkpoint", **info))
            continue
        if isinstance(p, BaseException):
            part.problems.append(Problem("unreadable", f"persistent object '{o.unique_key}' cannot be read: "
                                         f"{type(p).__name__}: {p}", **info))
            continue
        # megatron-core's torch_dist strategy stores a ShardedObject as ``torch.save([data, ...])`` of
        # the objects with this unique key on the saving rank (one, or identical duplicates)
        if not isinstance(p, list) or not p:
            part.problems.append(Problem("object_mismatch", f"persistent object '{o.unique_key}' is a "
                                         f"{type(p).__name__}, expected a non-empty list", **info))
            continue
        p = p[0]
        res.objects_compared += 1
        d = deep_difference(o.data, p)
        if d is None:
            res.objects_equal += 1
        else:
            part.problems.append(Problem("object_mismatch", f"{_where(lf)}: object '{o.unique_key}' differs from "
                                         f"the persistent one: {d}", **info))


# ---------------------------------------------------------------------------------------------
# One persistent data file (persistent-only mode)
# ---------------------------------------------------------------------------------------------


def _check_persistent_file(pc: PersistentCheckpoint, name: str, opts: _Options, part: _Partial,
                           progress: Optional[Callable[[int], None]] = None, ra: Optional[ReadAhead] = None) -> None:
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
                part.problems.append(Problem(
                    "nonfinite", f"persistent {name}: '{key}' chunk at {list(chunk.offsets)} "
                    f"({ck.dtype_name(t.dtype)}{list(t.shape)}) holds {nan} NaN and {inf} Inf of {t.numel()} elements",
                    file=name, role="persistent", key=key, global_offset=[int(o) for o in chunk.offsets],
                    shape=list(t.shape), dtype=ck.dtype_name(t.dtype), nbytes=n, details={"nan": nan, "inf": inf}))
        if progress is not None:
            progress(n)
            reported += n

    def on_object(key: str, obj: Any) -> None:
        res.objects_read += 1  # read and unpickled

    failed = pc.stream_file(name, on_tensor, on_object, ra if (ra is not None and ra.enabled) else None)
    for key, offsets, e in failed:
        part.problems.append(Problem("unreadable", f"persistent {name}: '{key}'"
                                     + (f" chunk at {offsets}" if offsets is not None else "")
                                     + f" cannot be read: {type(e).__name__}: {e}",
                                     file=name, role="persistent", key=key, global_offset=offsets))
    if progress is not None and size > reported:
        progress(size - reported)


# ---------------------------------------------------------------------------------------------
# Integrity manifest (megatron-core)
# ---------------------------------------------------------------------------------------------


def _manifest_names(manifest: dict) -> List[str]:
    return sorted(manifest.get("files", {}))


def _check_manifest_files(pc: PersistentCheckpoint, names: Sequence[str], manifest: dict, part: _Partial) -> None:
    """Verify ``names`` (this rank's share) of the checkpoint's ``integrity.json``: this fork's
    ``xxh3-64-blocks`` (a bad file is named with the byte range that differs) or megatron-core's
    ``sha256`` (:func:`megatron.integrity.manifest.check_files`)."""
    if manifest.get("algorithm", "sha256") not in (_manifest.ALGORITHM, _manifest.UPSTREAM_ALGORITHM):
        part.manifest_failed.append(("*", f"unsupported algorithm {manifest.get('algorithm')!r} in integrity.json"))
        return
    for n in names:
        part.manifest_checked += 1
        part.bytes_read += _size(pc.path / n)
    for p in _manifest.check_files(pc.path, manifest, names):
        part.manifest_failed.append((p.file, str(p)[len(p.file) + 2:]))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# Work distribution
# ---------------------------------------------------------------------------------------------


def _assign(units: List[Tuple[str, int, Set[int]]], world: int) -> Dict[int, List[str]]:
    """Greedy: biggest unit first to the least loaded rank that can see it (ties: lowest rank).

    Args:
        units: ``(unit id, bytes, ranks that can process it)``.

    Returns:
        rank -> unit ids (in assignment order).
    """
    load = [0] * world
    out: Dict[int, List[str]] = {r: [] for r in range(world)}
    for uid, size, ranks in sorted(units, key=lambda u: (-u[1], u[0])):
        cands = sorted(ranks) or [0]
        r = min(cands, key=lambda x: (load[x], x))
        load[r] += size
        out[r].append(uid)
    return out


def _local_units(visible: List[List[Tuple[str, int, int]]], world: int) -> Dict[int, List[str]]:
    """Assign local files (``rel``) to ranks. ``visible[r]`` lists ``(rel, owner, size)`` rank ``r``
    sees. Files of one owner form one unit when there are at least ``world`` owners and a rank sees
    all of them; otherwise single files are the units."""
    seen: Dict[str, Tuple[int, int, Set[int]]] = {}
    for r, files in enumerate(visible):
        for rel, owner, size in files:
            seen.setdefault(rel, (owner, size, set()))[2].add(r)
    groups: Dict[int, List[str]] = {}
    for rel, (owner, _s, _r) in seen.items():
        groups.setdefault(owner, []).append(rel)
    units = []
    if len(groups) >= world:
        for owner, rels in groups.items():
            common = set.intersection(*(seen[x][2] for x in rels))
            if common:
                units.append(("\n".join(sorted(rels)), sum(seen[x][1] for x in rels), common))
            else:
                units += [(x, seen[x][1], seen[x][2]) for x in rels]
    else:
        units = [(x, s, rs) for x, (_o, s, rs) in seen.items()]
    assigned = _assign(units, world)
    return {r: [rel for uid in uids for rel in uid.split("\n")] for r, uids in assigned.items()}


def _group_info(group) -> Tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(obj: Any, group, world: int) -> List[Any]:
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def _choose_iteration(layout: Optional[LocalLayout], persistent_dir, iteration: Optional[int]):
    """Resolve the iteration and the persistent iteration directory (see :func:`verify_checkpoint`)."""
    p_dir = None
    if layout is not None and iteration is not None and iteration not in layout.files:
        raise CheckpointInputError(
            f"the local checkpoint in {layout.rank_root} has no iteration {iteration}; it has "
            f"{layout.iterations or 'no checkpoint files'}"
        )
    if persistent_dir is not None:
        want = iteration
        if want is None and layout is not None and layout.iterations:
            pth = Path(persistent_dir)
            if not (pth / ".metadata").is_file():  # a root: pick the local iteration in it
                want = layout.iterations[-1]
        p_dir, p_it = resolve_persistent_dir(persistent_dir, want)
        if layout is not None and layout.iterations and p_it is not None and p_it not in layout.files:
            raise IterationMismatchError(
                f"iteration mismatch: the persistent checkpoint {p_dir} is iteration {p_it}, the local checkpoint "
                f"in {layout.rank_root} holds iteration(s) {layout.iterations}. Verify against a persistent "
                f"checkpoint of the same iteration (e.g. {p_dir.parent / f'iter_{layout.iterations[-1]:07d}'}), "
                "or save both tiers at one iteration (see megatron.integrity.verify docs)"
            )
        iteration = p_it if p_it is not None else iteration
    if iteration is None and layout is not None and layout.iterations:
        iteration = layout.iterations[-1]
    return iteration, p_dir


def verify_checkpoint(
    local_dir: Optional[Union[str, os.PathLike]] = None,
    persistent_dir: Optional[Union[str, os.PathLike]] = None,
    *,
    iteration: Optional[int] = None,
    check_nonfinite: bool = True,
    verify_manifest: Optional[bool] = None,
    compare_objects: bool = True,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    mmap: bool = True,
    readahead: bool = True,
    torch_threads: Optional[int] = 1,
    group: Optional[Any] = None,
    progress: bool = False,
) -> VerifyReport:
    """Verify a local checkpoint against a persistent one, or either alone (see the module docstring).

    Args:
        local_dir: ``--non-persistent-local-ckpt-dir`` of the run (all ranks' ``<rank>/``
            directories; in distributed mode each rank may see only some of them).
        persistent_dir: a ``torch_dist`` iteration directory (``.../iter_0000010``) or the ``--save``
            root (the iteration is then the local one, or ``iteration``, or the latest).
        iteration: the iteration to verify (default: the persistent directory's; with a local
            directory alone, every local iteration, to find the newest complete and consistent one).
        check_nonfinite: scan floating-point tensors for NaN/Inf.
        verify_manifest: verify the checkpoint's ``integrity.json`` (xxh3 blocks or SHA-256) if the
            persistent checkpoint has one. Default (``None``): only when the persistent checkpoint is
            verified alone; with local files, comparing every tensor bitwise with local copies whose
            own checksums verify already checks the persistent tensor data (a corrupted persistent
            chunk differs from every copy), so the extra hash pass over the persistent files is
            opt-in.
        compare_objects: compare main-replica ``ShardedObject`` s with the persistent ones.
        batch_bytes: most persistent tensor bytes held at once per process.
        mmap: ``torch.load(mmap=True)`` for local files: map them instead of reading them into
            memory (no copy; falls back to reading for files that cannot be mapped).
        readahead: read the current file, its persistent ranges and the next file ahead of the
            checks in a background thread (large sequential reads into the page cache), so that I/O
            and checking overlap.
        torch_threads: torch intra-op threads while verifying (restored afterwards; ``None``: leave
            as is). Default 1: the checks run on blocks of 1 MiB, where multi-threaded kernels gain
            nothing and lose much on busy machines; use several processes (``group``) instead.
        group: a ``torch.distributed`` process group (e.g. ``torch.distributed.group.WORLD``) to
            divide the files among its ranks; ``None``: this process does everything. Every rank of
            the group must call this function with the same arguments.
        progress: show a ``tqdm`` progress bar (bytes) on rank 0 of the group.

    Returns:
        The :class:`VerifyReport` (identical on every rank). With local files it has
        ``local_iterations`` and ``newest_complete_iteration`` (see :mod:`megatron.integrity.report`).

    Raises:
        CheckpointInputError: neither directory given, a directory missing, no local files at all,
            not a torch_dist checkpoint, unreadable ``.metadata``.
        IterationMismatchError: the local checkpoint has no files of the persistent checkpoint's
            iteration.
    """
    saved_threads = torch.get_num_threads()
    if torch_threads is not None:
        torch.set_num_threads(int(torch_threads))
    try:
        return _verify(local_dir, persistent_dir, iteration, check_nonfinite, verify_manifest, compare_objects,
                       batch_bytes, mmap, readahead, group, progress)
    finally:
        torch.set_num_threads(saved_threads)


def _verify(local_dir, persistent_dir, iteration, check_nonfinite, verify_manifest, compare_objects, batch_bytes,
            mmap, readahead, group, progress) -> VerifyReport:
    t0 = time.perf_counter()
    if local_dir is None and persistent_dir is None:
        raise CheckpointInputError("nothing to verify: give a local checkpoint directory, a persistent one, or both")
    rank, world = _group_info(group)
    if verify_manifest is None:
        verify_manifest = local_dir is None
    opts = _Options(check_nonfinite=check_nonfinite, batch_bytes=int(batch_bytes), mmap=mmap,
                    compare_objects=compare_objects)

    def agree(fn):
        """Run ``fn`` on every rank; if it raised CheckpointInputError anywhere, raise it everywhere
        (so no rank waits in a collective for a rank that gave up)."""
        err = None
        out = None
        try:
            out = fn()
        except CheckpointInputError as e:
            err = e
        errs = _all_gather(None if err is None else (type(err).__name__, str(err)), group, world)
        for r, e in enumerate(errs):
            if e is not None:
                cls = IterationMismatchError if e[0] == "IterationMismatchError" else CheckpointInputError
                raise cls(e[1] if world == 1 else f"rank {r}: {e[1]}")
        return out

    layout = agree(lambda: discover_local(local_dir) if local_dir is not None else None)
    if layout is not None and world > 1:
        # in a distributed run, iterations and leftovers are the union over ranks (node-local directories)
        seen = _all_gather((set(layout.files), layout.dirty, layout.rejected, layout.markers), group, world)
        for it in sorted(set().union(*(x[0] for x in seen))):
            layout.files.setdefault(it, [])
        layout.dirty = sorted({rel for x in seen for rel in x[1]})
        layout.rejected = sorted({rel for x in seen for rel in x[2]})
        layout.markers = {rel: m for x in seen for rel, m in sorted(x[3].items())}
    all_iterations = layout is not None and iteration is None and persistent_dir is None

    def open_persistent():
        if layout is not None and not any(layout.files.values()):
            raise CheckpointInputError(
                f"no local checkpoint files (<rank>/iter_<N>_<rank>_local.pt) under {layout.root}; pass the "
                "run's --non-persistent-local-ckpt-dir"
            )
        it, p_dir = _choose_iteration(layout, persistent_dir, iteration)
        pc = PersistentCheckpoint(p_dir, it) if p_dir is not None else None
        man = pc.manifest() if (pc is not None and verify_manifest) else None
        return it, pc, man

    iteration, pc, manifest = agree(open_persistent)
    if pc is not None and iteration is None:
        iteration = pc.iteration
    mode = "local+persistent" if (layout is not None and pc is not None) else ("local" if layout else "persistent")
    part = _Partial()

    # --- what this rank does ---
    man_names = _manifest_names(manifest) if manifest else []
    my_local: List[LocalFile] = []
    my_data_files: List[str] = []
    my_manifest: List[str] = []
    # local alone without an iteration: every local iteration (to find the newest complete one)
    checked = (layout.iterations if all_iterations else [iteration]) if layout is not None else []
    copies: List[LocalFile] = []
    if layout is not None:
        mine = {f.rel: f for it in checked for f in layout.files.get(it, [])}
        visible: List[List[LocalFile]] = _all_gather(list(mine.values()), group, world)
        copies = sorted({f.rel: f for fs in visible for f in fs}.values(), key=lambda f: f.rel)
        units = [[(f.rel, (f.iteration, f.owner_rank), f.size) for f in fs] for fs in visible]
        assigned = _local_units(units, world)[rank]
        my_local = sorted((mine[r] for r in assigned),
                          key=lambda f: (f.iteration, f.owner_rank, f.role != "primary", f.rel))
    if pc is not None and layout is None:
        units = [(n, max(s, 0), set(range(world))) for n, s in pc.data_files.items()]
        my_data_files = sorted(_assign(units, world)[rank])
    if man_names:
        units = [(n, _size(pc.path / n), set(range(world))) for n in man_names]
        my_manifest = sorted(_assign(units, world)[rank])

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        total = sum(f.size for f in my_local) + sum(max(pc.data_files[n], 0) for n in my_data_files) \
            + sum(_size(pc.path / n) for n in my_manifest)
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                   desc="verify" if world == 1 else f"verify (rank 0 of {world})")
    step = bar.update if bar is not None else None

    ra = ReadAhead(readahead)
    try:
        if my_manifest:
            _check_manifest_files(pc, my_manifest, manifest, part)
            if step:
                step(sum(_size(pc.path / n) for n in my_manifest))
        # one file of look-ahead: file k+1 is opened and its ranges queued before file k is checked
        def open_and_plan(k: int) -> Optional[_OpenedLocal]:
            f = my_local[k]
            try:
                op = _open_local(f, opts, part)
                _plan_readahead(op, pc, ra, opts.mmap)
                return op
            except Exception:  # noqa: BLE001 - never leave the other ranks waiting
                part.problems.append(Problem("verifier_error", f"{_where(f)}: {traceback.format_exc()}",
                                             file=f.rel, holder_rank=f.holder_rank, owner_rank=f.owner_rank,
                                             role=f.role, iteration=f.iteration))
                return None

        nxt = open_and_plan(0) if my_local else None
        for k, lf in enumerate(my_local):
            cur = nxt
            nxt = open_and_plan(k + 1) if k + 1 < len(my_local) else None
            if cur is None:
                continue
            try:
                _check_opened(cur, pc, opts, part, ra, step)
            except Exception:  # noqa: BLE001
                part.problems.append(Problem("verifier_error", f"{_where(lf)}: {traceback.format_exc()}",
                                             file=lf.rel, holder_rank=lf.holder_rank, owner_rank=lf.owner_rank,
                                             role=lf.role, iteration=lf.iteration))
        for name in my_data_files:
            try:
                _check_persistent_file(pc, name, opts, part, step, ra)
            except Exception:  # noqa: BLE001
                part.problems.append(Problem("verifier_error", f"persistent {name}: {traceback.format_exc()}",
                                             file=name, role="persistent"))
    finally:
        ra.close()
        if bar is not None:
            bar.close()

    parts: List[_Partial] = _all_gather(part, group, world)
    report = _merge(parts, layout, pc, mode, iteration, manifest, verify_manifest, checked, copies)
    wall = time.perf_counter() - t0
    bytes_read = sum(p.bytes_read for p in parts)
    data_bytes = sum(f.file_bytes for f in report.files)
    report.timing = {"wall_s": wall, "workers": world, "bytes_read": bytes_read, "file_bytes": data_bytes,
                     "gb_per_s": data_bytes / wall / 1e9 if wall > 0 else 0.0}
    return report


def _merge(parts: List[_Partial], layout: Optional[LocalLayout], pc: Optional[PersistentCheckpoint], mode: str,
           iteration: Optional[int], manifest: Optional[dict], verify_manifest: bool,
           checked: Sequence[int] = (), copies: Sequence[LocalFile] = ()) -> VerifyReport:
    """The report from every worker's findings (the same on every rank: only gathered data is used).

    Args:
        checked: the local iterations whose files were checked.
        copies: every local file of those iterations that some rank saw (whether or not it could be
            checked).
    """
    report = VerifyReport(mode=mode, local_dir=str(layout.rank_root) if layout else None,
                          persistent_dir=str(pc.path) if pc else None, iteration=iteration,
                          iterations=list(checked))
    prints: Dict[str, _CopyPrint] = {}
    for p in parts:
        report.files += p.files
        report.problems += p.problems
        report.warnings += p.warnings
        prints.update(p.prints)
    if layout is not None:
        _leftover_warnings(report, layout)
    if pc is not None:
        report.problems += pc.check_metadata()
        if verify_manifest:
            failed = sorted({x for p in parts for x in p.manifest_failed})
            if manifest is None:
                report.manifest = {"present": False, "verified": None, "files": 0, "failed_files": []}
                report.warnings.append(Problem("no_manifest", f"{pc.path / INTEGRITY_FNAME} is absent (checkpoint "
                                               "saved without --verify-integrity): file hashes not checked",
                                               role="persistent"))
            else:
                report.manifest = {"present": True, "verified": not failed,
                                   "files": len(manifest.get("files", {})),
                                   "failed_files": [n for n, _ in failed]}
                for n, why in failed:
                    report.problems.append(Problem("manifest", f"persistent {n}: {why}",
                                                   file=None if n == "*" else n, role="persistent"))
    if layout is not None and copies:
        _local_iterations(report, list(checked), list(copies), prints, layout.dirty)
    if layout is not None and pc is not None:
        regions: Dict[str, Dict[Tuple[tuple, tuple], int]] = {}
        for p in parts:
            for k, v in p.regions.items():
                dst = regions.setdefault(k, {})
                for reg, n in v.items():
                    dst[reg] = dst.get(reg, 0) + n
        for key in sorted(pc.tensors):
            md = pc.tensors[key]
            got = sorted(regions.get(key, {}))
            if not got:
                report.problems.append(Problem("local_incomplete", f"persistent tensor '{key}' {list(md.size)} is in "
                                               "no local file", key=key, shape=list(md.size)))
                continue
            for e in check_chunk_cover(tuple(md.size), got):
                report.problems.append(Problem("local_incomplete", f"local shards of '{key}' {list(md.size)}: {e}",
                                               key=key, shape=list(md.size)))
        _suspects(report, regions)
    report.sort()
    return report


def _holder_of(rel: str) -> Optional[int]:
    """The rank directory a relative local path lies in (its first all-digit component)."""
    for part in Path(rel).parts:
        if part.isdigit():
            return int(part)
    return None


def _leftover_warnings(report: VerifyReport, layout: LocalLayout) -> None:
    """Warnings naming what interrupted saves and the local tier's fallback left behind."""
    for rel in layout.dirty:
        report.warnings.append(Problem("dirty_file", f"{rel}: unfinished local save (*.dirty.pt, left by an "
                                       "interrupted save); ignored", file=rel, holder_rank=_holder_of(rel)))
    for rel in layout.rejected:
        report.warnings.append(Problem("rejected_file", f"{rel}: quarantined by the local tier (rejected when the "
                                       "run loaded its local checkpoint); not verified", file=rel,
                                       holder_rank=_holder_of(rel)))
    for rel, m in sorted(layout.markers.items()):
        if "unreadable" in m:
            what = f"unreadable: {m['unreadable']}"
        else:
            reason = str(m.get("reason", "?"))
            what = f"iteration {m.get('iteration', '?')}: {reason if len(reason) <= 200 else reason[:197] + '...'}"
        rank = m.get("rank", _holder_of(rel))
        report.warnings.append(Problem("bad_tier_marker", f"{rel}: bad-tier marker of rank {rank} ({what}); the next "
                                       "start loads the persistent checkpoint", file=rel, holder_rank=_holder_of(rel),
                                       details={k: v for k, v in m.items() if isinstance(v, (str, int, float))}))


# kinds of problems after which a local copy does not count as one that verifies
_UNUSABLE_KINDS = frozenset({"unreadable", "not_a_local_checkpoint", "checksum_mismatch", "verifier_error",
                             "iteration", "identity"})
_IDENTITY_KEY_FIELDS = ("run_id", "save_token", "iteration", "owner_rank")


def _identity_differences(a: Optional[dict], b: Optional[dict]) -> List[str]:
    """Fields in which two identity records differ: ``run_id``, ``save_token``, ``iteration``,
    ``owner_rank`` first, then the others in name order; nested records (``run_settings``,
    ``topology``) as ``name.field``."""
    if a is None and b is None:
        return []
    if a is None or b is None:
        return ["identity record (one copy has none)"]
    out = []
    for k in list(_IDENTITY_KEY_FIELDS) + sorted((set(a) | set(b)) - set(_IDENTITY_KEY_FIELDS), key=str):
        va, vb = a.get(k), b.get(k)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            out += [f"{k}.{n}" for n in sorted(set(va) | set(vb), key=str) if va.get(n) != vb.get(n)]
        else:
            out.append(str(k))
    return out


def _tensor_map(cp: _CopyPrint) -> Dict[Tuple[str, Optional[tuple]], list]:
    """(key, global offset) -> [(dtype, shape, checksum)]: the stored checksum where the file has
    one (a copy whose bytes were damaged after the save still agrees with intact copies; the damage
    is a checksum problem of its own), else the checksum of the bytes."""
    m: Dict[Tuple[str, Optional[tuple]], list] = {}
    for key, off, dtype, shape, stored, actual in cp.tensors:
        m.setdefault((key, off), []).append((dtype, shape, stored if stored is not None else actual))
    return m


def _compare_copies(a: _CopyPrint, b: _CopyPrint) -> Tuple[List[str], int]:
    """Keys of the tensors in which two copies differ (missing on one side included), and how many
    distinct tensors (key, offset) the two hold together."""
    ma, mb = _tensor_map(a), _tensor_map(b)
    keys = sorted(set(ma) | set(mb), key=lambda k: (k[0], k[1] or ()))
    return [k[0] for k in keys if ma.get(k) != mb.get(k)], len(keys)


def _signature(cp: _CopyPrint) -> Tuple[tuple, str]:
    """Hashable summary of a copy: equal for copies that agree (see :func:`_compare_copies`)."""
    items = sorted(_tensor_map(cp).items(), key=lambda kv: (kv[0][0], kv[0][1] or ()))
    return tuple((k, tuple(v)) for k, v in items), json.dumps(cp.identity, sort_keys=True, default=str)


def _save_of(cp: Optional[_CopyPrint]) -> Optional[Tuple[Any, Any]]:
    ident = cp.identity if cp is not None else None
    if not ident or "unusable" in ident:
        return None
    return ident.get("run_id"), ident.get("save_token")


def _strict_majority(counts: Dict[Any, int]) -> Any:
    """The value counted most often if no other is counted as often, else ``None``."""
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    if not ranked or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
        return None
    return ranked[0][0]


def _missing_text(it: int, owner: int, newest: Optional[int], dirty_of: Dict[Tuple[int, int], List[str]]) -> str:
    """Why ``owner``'s shard of iteration ``it`` is absent, as far as the directory tells."""
    d = dirty_of.get((it, owner))
    if d:
        return f"rank {owner}'s shard missing (interrupted save: {', '.join(d)})"
    return f"rank {owner}'s shard missing" + (" (interrupted save)" if newest is not None and it > newest else "")


def _local_iterations(report: VerifyReport, checked: List[int], copies: List[LocalFile],
                      prints: Dict[str, _CopyPrint], dirty: Sequence[str]) -> None:
    """Per checked local iteration: are all shards there with a copy that verifies (complete), do
    all copies of each shard agree and do all shards come from one save (consistent)? Adds
    ``copies_differ`` / ``mixed_saves`` / ``missing_owner`` / ``missing_copy`` problems and
    ``incomplete_iteration`` warnings, and sets ``report.local_iterations`` and
    ``report.newest_complete_iteration`` (see :mod:`megatron.integrity.report`).

    A missing shard is a problem unless another checked iteration is complete and consistent
    (then the loader can use that one: the missing shard is the trace of an interrupted save, a
    warning); too few copies of a shard (``--replication-factor``) are a problem in an iteration
    that is otherwise complete."""
    results = {f.file: f for f in report.files if f.role in ("primary", "replica")}
    bad = {p.file for p in report.problems if p.kind in _UNUSABLE_KINDS and p.file}
    dirty_of: Dict[Tuple[int, int], List[str]] = {}
    for rel in dirty:
        parsed = parse_local_name(Path(rel).name)
        if parsed is not None:
            dirty_of.setdefault((parsed[0], parsed[1]), []).append(rel)
    by_it: Dict[int, Dict[int, List[LocalFile]]] = {}
    for f in copies:
        by_it.setdefault(f.iteration, {}).setdefault(f.owner_rank, []).append(f)
    top_owner = max(f.owner_rank for f in copies)

    facts = []
    for it in checked:
        shards = by_it.get(it, {})
        files = [f for fs in shards.values() for f in fs]
        world = max((results[f.rel].world_size or 0 for f in files if f.rel in results), default=0)
        factor = max((results[f.rel].replication_factor or 1 for f in files if f.rel in results), default=1)
        n_owners = max(world, max(shards, default=-1) + 1) if world else top_owner + 1
        saves: Dict[Any, int] = {}
        for f in files:
            sv = _save_of(prints.get(f.rel))
            if sv is not None:
                saves[sv] = saves.get(sv, 0) + 1
        common_save = _strict_majority(saves)
        reasons: List[Any] = []  # str, or ("missing", owner): worded once the newest complete one is known
        rows, missing, few, shard_saves = [], [], [], {}
        for owner in range(n_owners):
            fs = sorted(shards.get(owner, []), key=lambda f: (f.role != "primary", f.holder_rank, f.rel))
            loaded = [f for f in fs if f.rel in prints and prints[f.rel].loaded]
            usable = [f for f in loaded if f.rel in results and f.rel not in bad]
            row = {"owner_rank": owner, "copies": sorted(f.rel for f in fs), "usable": sorted(f.rel for f in usable),
                   "consistent": True}
            rows.append(row)
            if not fs:
                missing.append(owner)
                reasons.append(("missing", owner))
                continue
            if not usable:
                reasons.append(f"rank {owner}'s shard: no copy verifies ({', '.join(row['copies'])})")
            if len(fs) < factor:
                few.append((owner, fs))
            ref = loaded[0] if loaded else None
            sig: Dict[str, Any] = {}  # with more than 2 copies: which ones agree (majority -> suspect)
            for other in loaded[1:]:
                differing, total = _compare_copies(prints[ref.rel], prints[other.rel])
                fields = _identity_differences(prints[ref.rel].identity, prints[other.rel].identity)
                if not differing and not fields:
                    continue
                row["consistent"] = False
                suspect, why = None, None
                sa, sb = _save_of(prints[ref.rel]), _save_of(prints[other.rel])
                if common_save is not None and sa != sb and common_save in (sa, sb):
                    suspect = ref if sb == common_save else other
                    why = f"its run id / save token differ from the other files of iteration {it}"
                elif len(loaded) > 2:
                    if not sig:
                        sig = {f.rel: _signature(prints[f.rel]) for f in loaded}
                    sigs: Dict[Any, int] = {}
                    for v in sig.values():
                        sigs[v] = sigs.get(v, 0) + 1
                    best = _strict_majority(sigs)
                    if best is not None and (sig[ref.rel] == best) != (sig[other.rel] == best):
                        suspect = other if sig[ref.rel] == best else ref
                        why = "the other copies agree with each other"
                msg = (f"rank {owner}'s shard of iteration {it}: {ref.role} {ref.rel} and {other.role} {other.rel} "
                       + (f"differ in {len(differing)} of {total} tensors" if differing else f"hold the same {total} "
                          "tensors")
                       + (f"; identity records differ in {', '.join(fields)}" if fields else ""))
                if suspect is not None:
                    msg += f" [suspect: {suspect.role} {suspect.rel}: {why}]"
                report.problems.append(Problem(
                    "copies_differ", msg, file=other.rel, holder_rank=other.holder_rank, owner_rank=owner,
                    role=other.role, iteration=it,
                    details={"files": [ref.rel, other.rel], "holders": [ref.holder_rank, other.holder_rank],
                             "differing_tensors": len(differing), "tensors": total,
                             "first_differing_keys": differing[:5], "identity_fields": fields,
                             "suspect": suspect.rel if suspect is not None else None}))
                reasons.append(f"rank {owner}'s shard: {ref.role} {ref.rel} and {other.role} {other.rel} differ")
            if row["consistent"] and ref is not None and _save_of(prints[ref.rel]) is not None:
                shard_saves[owner] = _save_of(prints[ref.rel])
        distinct = sorted(set(shard_saves.values()), key=str)
        if len(distinct) > 1:
            groups = "; ".join(
                f"run {run} save {tok} (rank(s) {[o for o, v in sorted(shard_saves.items()) if v == (run, tok)]})"
                for run, tok in distinct)
            report.problems.append(Problem("mixed_saves", f"iteration {it}: its files come from {len(distinct)} saves: "
                                           f"{groups}; a checkpoint is one save of all ranks", iteration=it,
                                           details={"saves": [list(d) for d in distinct]}))
            reasons.append(f"shards from {len(distinct)} saves")
        complete = not missing and all(r["usable"] for r in rows)
        consistent = all(r["consistent"] for r in rows) and len(distinct) <= 1
        facts.append(dict(it=it, n=n_owners, world=world, factor=factor, files=len(files), rows=rows,
                          reasons=reasons, missing=missing, few=few, complete=complete, consistent=consistent))

    ok = [f["it"] for f in facts if f["complete"] and f["consistent"]]
    newest = max(ok) if ok else None
    out = []
    for f in facts:
        it = f["it"]
        reasons = [_missing_text(it, r[1], newest, dirty_of) if isinstance(r, tuple) else r for r in f["reasons"]]
        copies_text = [(o, f"rank {o}'s shard of iteration {it} has {len(fs)} local cop"
                           f"{'y' if len(fs) == 1 else 'ies'} (held by ranks {sorted(x.holder_rank for x in fs)}); "
                           f"the run replicated with --replication-factor {f['factor']}") for o, fs in f["few"]]
        if f["missing"] and newest is not None:
            notes = [_missing_text(it, o, newest, dirty_of) for o in f["missing"]]
            notes += [f"rank {o}'s shard has {len(fs)} of {f['factor']} copies" for o, fs in f["few"]]
            report.warnings.append(Problem("incomplete_iteration", f"iteration {it}: {'; '.join(notes)}; newest "
                                           f"complete and consistent local iteration: {newest}", iteration=it,
                                           details={"missing_owners": f["missing"],
                                                    "newest_complete_iteration": newest}))
        else:
            ran = f"the run had {f['world']} ranks" if f["world"] else f"owner ranks up to {f['n'] - 1} seen"
            for o in f["missing"]:
                report.problems.append(Problem("missing_owner", f"no local file holds rank {o}'s shard of iteration "
                                               f"{it} ({ran})", owner_rank=o, iteration=it))
            for o, text in copies_text:
                report.problems.append(Problem("missing_copy", text, owner_rank=o, iteration=it))
        out.append({"iteration": it, "owners": f["n"], "files": f["files"], "complete": f["complete"],
                    "consistent": f["consistent"], "reasons": reasons, "shards": f["rows"]})
    report.local_iterations = out
    report.newest_complete_iteration = newest


def _suspects(report: VerifyReport, regions: Dict[str, Dict[Tuple[tuple, tuple], int]]) -> None:
    """Mark each value mismatch with the side most likely wrong (``details['suspect']``):
    ``"local file changed after save"`` when the file's stored checksum of the tensor fails;
    ``"persistent"`` when every local copy of the region (primary and replicas) differs from the
    persistent data while matching its own checksum; ``"this local copy"`` when other copies of
    the region match the persistent data; ``"unknown"`` for a single copy without a checksum verdict."""
    failed_ck = {(p.file, p.key, tuple(p.global_offset or ())) for p in report.problems if p.kind == "checksum_mismatch"}
    bad: Dict[Tuple[str, tuple], int] = {}
    for p in report.problems:
        if p.kind == "value_mismatch":
            rk = (p.key, tuple(p.global_offset or ()))
            bad[rk] = bad.get(rk, 0) + 1
    for p in report.problems:
        if p.kind != "value_mismatch":
            continue
        off = tuple(p.global_offset or ())
        copies = sum(n for (o, _s), n in regions.get(p.key, {}).items() if o == off)
        if (p.file, p.key, off) in failed_ck:
            p.details["suspect"] = "local file changed after save (its stored checksum fails)"
        elif bad[(p.key, off)] < copies:
            p.details["suspect"] = "this local copy (other copies of the region match the persistent data)"
        elif copies > 1:
            p.details["suspect"] = "persistent (all local copies differ from it, none fails its checksum)"
        else:
            p.details["suspect"] = "unknown (single local copy)"
        p.message += f" [suspect: {p.details['suspect']}]"
