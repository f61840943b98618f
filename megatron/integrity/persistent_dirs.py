"""Where a persistent ``torch_dist`` checkpoint is, and whether its metadata is whole: the
iteration directory the verifier reads (:func:`resolve_persistent_dir`), its backend, and the
chunk coverage of every tensor (:func:`check_chunk_cover`). Input it cannot verify raises
:class:`CheckpointInputError` on every rank of the verifier's group."""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from megatron.overlay.collective import RankFailures
from megatron.overlay.errors import OverlayError

__all__ = [
    "TRACKER",
    "CheckpointInputError",
    "Tracker",
    "check_chunk_cover",
    "complete_iterations",
    "interrupted_torch_dist",
    "is_complete",
    "read_tracker",
    "resolve_persistent_dir",
    "volume",
    "write_tracker",
]

_ITER_DIR = re.compile(r"iter_(\d+)$")
TRACKER = "latest_checkpointed_iteration.txt"  # upstream's get_checkpoint_tracker_filename


class CheckpointInputError(RankFailures, OverlayError, ValueError):
    """The verifier was given something it cannot verify (missing directory, no checkpoint files,
    unsupported format, local and persistent iterations that differ...). The message says what is
    wrong and what to pass instead. Raised by the verifier on every rank of its group
    (``failures``: the ranks that found it)."""


# ---------------------------------------------------------------------------------------------
# What a --save root holds: the tracker (a hint) and the complete iteration directories (the truth)
# ---------------------------------------------------------------------------------------------


class Tracker(NamedTuple):
    """What ``latest_checkpointed_iteration.txt`` of a root says.

    ``iteration``: the iteration it names (``0`` for ``release``), ``None`` when it names none;
    ``problem``: why it names none (``None`` when it is valid or simply absent, see ``present``).
    """

    present: bool
    iteration: Optional[int]
    release: bool
    problem: Optional[str]


def read_tracker(root: Union[str, os.PathLike]) -> Tracker:
    """Read the tracker file of ``root`` without trusting it (no collectives, never exits).

    Returns:
        :class:`Tracker`; ``problem`` says why an existing tracker names no iteration (unreadable,
        empty, not a number: upstream's ``read_metadata`` then calls ``sys.exit()`` with code 0).
    """
    path = Path(root) / TRACKER
    if not path.is_file():
        return Tracker(False, None, False, None)
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return Tracker(True, None, False, f"{path} cannot be read ({e})")
    if text == "release":
        return Tracker(True, 0, True, None)
    if text.isdigit():
        return Tracker(True, int(text), False, None)
    shown = text if len(text) <= 40 else text[:40] + "..."
    return Tracker(True, None, False, f"{path} holds {shown!r}, not an iteration number")


def write_tracker(root: Union[str, os.PathLike], iteration: int) -> Path:
    """Point ``root``'s tracker at ``iteration`` (as upstream's save does), atomically: a temporary
    file renamed over it, so a reader sees the old or the new content, never a torn one.

    Raises:
        OSError: ``root`` is not writable.
    """
    path = Path(root) / TRACKER
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{int(iteration)}\n")
    os.replace(tmp, path)
    return path


#: What megatron-core's ``torch_dist`` save puts into DCP's ``.metadata``: its common state, one
#: ``ShardedObject`` keyed ``common_state`` (``dist_checkpointing.serialization.save``).
_MCORE_COMMON_STATE = b"common_state/shard_"


def is_complete(d: Union[str, os.PathLike]) -> bool:
    """Whether iteration directory ``d`` holds a finished save: DCP's ``.metadata`` (written by
    the coordinator after every rank's files), for a ``torch_dist`` save followed by
    megatron-core's ``metadata.json`` (:func:`interrupted_torch_dist`); ``fsdp_dtensor`` and
    ``torch_dcp`` saves have ``.metadata`` only; or the ``torch`` format's
    ``mp_rank_*/model_optim_rng.pt``. Its bytes are verified at load, not here."""
    if os.path.isfile(os.path.join(d, ".metadata")):
        return not interrupted_torch_dist(d)
    try:
        return any(
            n.startswith("mp_rank_") and os.path.isfile(os.path.join(d, n, "model_optim_rng.pt"))
            for n in os.listdir(d)
        )
    except OSError:
        return False


def interrupted_torch_dist(d: Union[str, os.PathLike]) -> bool:
    """Whether ``d`` is a ``torch_dist`` save stopped between DCP's ``.metadata`` and
    megatron-core's ``metadata.json`` (the coordinator writes them in that order, the latter in
    place): ``.metadata`` holds megatron-core's common state and ``metadata.json`` is missing or
    not a JSON object (empty: killed between its open and its write). Upstream's load reads a
    directory without ``metadata.json`` as a plain ``torch_dcp`` checkpoint
    (``_get_checkpoint_format``) and fails with ``Missing key in checkpoint state_dict: args``,
    and one with an empty ``metadata.json`` with a ``JSONDecodeError``; a crash there must resume
    the previous checkpoint instead. Reads ``.metadata``'s bytes (a search, no unpickling) only
    when ``metadata.json`` is not valid."""
    try:
        with open(os.path.join(d, "metadata.json")) as f:
            if isinstance(json.load(f), dict):
                return False
    except (OSError, ValueError):  # missing, or torn (upstream writes it in place): no config
        pass
    try:
        with open(os.path.join(d, ".metadata"), "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return m.find(_MCORE_COMMON_STATE) >= 0
    except (OSError, ValueError):  # missing, unreadable, or empty (mmap of 0 bytes)
        return False


def complete_iterations(root: Union[str, os.PathLike]) -> List[int]:
    """The iterations of the complete (:func:`is_complete`) ``iter_<N>`` directories of ``root``,
    ascending; ``[]`` when ``root`` is not a directory."""
    try:
        dirs = _iteration_dirs(Path(root))
    except OSError:
        return []
    return sorted(it for it, d in dirs.items() if it > 0 and is_complete(d))


# ---------------------------------------------------------------------------------------------
# Locating the iteration directory
# ---------------------------------------------------------------------------------------------


def _iteration_dirs(root: Path) -> Dict[int, Path]:
    out = {}
    for p in root.iterdir():
        m = _ITER_DIR.fullmatch(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


def resolve_persistent_dir(
    path: Union[str, os.PathLike], iteration: Optional[int] = None
) -> Tuple[Path, Optional[int]]:
    """Find the iteration directory of a persistent checkpoint.

    Args:
        path: either an iteration directory (holds ``.metadata``) or a ``--save`` root (holds
            ``iter_<7 digits>/`` directories and usually ``latest_checkpointed_iteration.txt``).
        iteration: for a root: which iteration to use (default: the one in
            ``latest_checkpointed_iteration.txt``, else the highest). For an iteration directory:
            must match its name.

    Returns:
        ``(iteration_dir, iteration)``; ``iteration`` is ``None`` only for a directory whose name is
        not ``iter_<n>`` (the caller then reads it from the checkpoint's common state).

    Raises:
        CheckpointInputError: the path does not exist, holds no checkpoint, the requested iteration
            is absent (the message lists the ones present), or the format is not ``torch_dist``.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointInputError(f"persistent checkpoint path {p} does not exist")
    if not p.is_dir():
        raise CheckpointInputError(f"persistent checkpoint path {p} is not a directory")
    if (p / ".metadata").is_file():
        m = _ITER_DIR.fullmatch(p.name)
        it = int(m.group(1)) if m else None
        if iteration is not None and it is not None and it != iteration:
            raise CheckpointInputError(
                f"persistent checkpoint {p} is iteration {it}, but iteration {iteration} was "
                f"requested; pass {p.parent / f'iter_{iteration:07d}'} (if it exists) or the "
                f"matching iteration"
            )
        _check_backend(p)
        return p, it if it is not None else iteration
    dirs = _iteration_dirs(p)
    if not dirs:
        raise CheckpointInputError(
            f"{p} is neither a torch_dist iteration directory (no .metadata file) nor a checkpoint "
            f"root (no iter_<N> subdirectories)"
        )
    if iteration is None:
        tracker = p / "latest_checkpointed_iteration.txt"
        text = tracker.read_text().strip() if tracker.is_file() else ""
        iteration = int(text) if text.isdigit() and int(text) in dirs else max(dirs)
    if iteration not in dirs:
        raise CheckpointInputError(
            f"persistent checkpoint root {p} has no iteration {iteration}; it has iteration(s) "
            f"{sorted(dirs)}. Save a persistent checkpoint at iteration {iteration} or verify a "
            f"local checkpoint of one of those iterations (--iteration)"
        )
    d = dirs[iteration]
    if not (d / ".metadata").is_file():
        raise CheckpointInputError(
            f"{d} has no .metadata file: the save of iteration {iteration} is incomplete or not "
            f"torch_dist"
        )
    _check_backend(d)
    return d, iteration


def _check_backend(d: Path) -> None:
    meta = d / "metadata.json"
    if not meta.is_file():
        return  # a plain DCP directory: readable the same way
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except (OSError, ValueError) as e:
        raise CheckpointInputError(f"cannot read {meta}: {e}") from e
    if backend != "torch_dist":
        raise CheckpointInputError(
            f"{d} is a '{backend}' checkpoint; only torch_dist checkpoints "
            "(--ckpt-format torch_dist) can be verified"
        )


# ---------------------------------------------------------------------------------------------
# Chunk geometry
# ---------------------------------------------------------------------------------------------


def volume(sizes: Sequence[int]) -> int:
    """Number of elements of a region of shape ``sizes`` (1 for ``()``)."""
    return math.prod(int(s) for s in sizes)


def _overlap(a_off, a_sz, b_off, b_sz) -> bool:
    return all(ao < bo + bs and bo < ao + asz for ao, asz, bo, bs in zip(a_off, a_sz, b_off, b_sz))


def check_chunk_cover(
    shape: Sequence[int], chunks: Sequence[Tuple[Sequence[int], Sequence[int]]]
) -> List[str]:
    """Whether ``chunks`` tile a tensor of ``shape`` exactly: every chunk inside the bounds, no two
    chunks overlapping, and together every element covered.

    Args:
        shape: global shape (elements per axis).
        chunks: ``(offsets, sizes)`` per chunk, in elements.

    Returns:
        Descriptions of what is wrong (empty when the cover is exact). Overlap detection sweeps
        along the longest axis, so it is about linear in the number of chunks for grid shardings.
    """
    errors: List[str] = []
    ndim = len(shape)
    good = []
    for off, sz in chunks:
        if len(off) != ndim or len(sz) != ndim:
            errors.append(f"chunk at {list(off)} has {len(off)} axes, the tensor has {ndim}")
        elif any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, shape)):
            errors.append(
                f"chunk at {list(off)} of size {list(sz)} exceeds the global shape {list(shape)}"
            )
        else:
            good.append((tuple(off), tuple(sz)))
    if ndim == 0:
        n = len(good)
        if n != 1:
            errors.append(f"0-d tensor stored in {n} chunks")
        return errors
    dim = max(range(ndim), key=lambda i: shape[i])
    order = sorted(range(len(good)), key=lambda i: good[i][0][dim])
    active: List[int] = []
    overlaps = 0
    for i in order:
        off, sz = good[i]
        active = [j for j in active if good[j][0][dim] + good[j][1][dim] > off[dim]]
        for j in active:
            if _overlap(off, sz, *good[j]) and volume(sz) and volume(good[j][1]):
                overlaps += 1
                if overlaps <= 3:
                    errors.append(f"chunks at {list(good[j][0])} and {list(off)} overlap")
        active.append(i)
    if overlaps > 3:
        errors.append(f"... {overlaps} overlapping chunk pairs in all")
    covered = sum(volume(sz) for _, sz in good)
    total = volume(shape)
    if not overlaps and covered != total:
        errors.append(f"chunks cover {covered} of {total} elements (gap of {total - covered})")
    return errors
