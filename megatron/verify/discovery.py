"""Which checkpoint files the verifier checks: the local files under a root
(:func:`discover_local`; names from :mod:`megatron.integrity.local_layout`), the iteration
verified (:func:`choose_iteration`) and what is verified (:class:`Plan`).

Raises :class:`~megatron.integrity.persistent.CheckpointInputError` for input it cannot verify and
:class:`IterationMismatchError` when the local and persistent checkpoints are of other iterations.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from megatron.integrity.local_layout import (
    FILE_PATTERN_TEXT,
    MARKER_NAME,
    QUARANTINE_DIR,
    is_unfinished,
    parse_local_name,
)
from megatron.integrity.persistent import (
    CheckpointInputError,
    PersistentCheckpoint,
    resolve_persistent_dir,
)

__all__ = [
    "IterationMismatchError",
    "LocalFile",
    "LocalLayout",
    "Plan",
    "choose_iteration",
    "discover_local",
    "holder_of",
    "require_local_files",
    "where",
]


class IterationMismatchError(CheckpointInputError):
    """The local and persistent checkpoints given are not of the same iteration."""


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


def where(lf: LocalFile) -> str:
    """How messages name a local file: its relative path and what copy it is."""
    kind = (
        "primary"
        if lf.role == "primary"
        else f"replica of rank {lf.owner_rank}'s shard held by rank {lf.holder_rank}"
    )
    return f"{lf.rel} ({kind})"


def holder_of(rel: str) -> Optional[int]:
    """The rank directory a relative local path lies in (its first all-digit component)."""
    for part in Path(rel).parts:
        if part.isdigit():
            return int(part)
    return None


@dataclass
class LocalLayout:
    """Local checkpoint files found under a root.

    Attributes:
        root: the directory given.
        rank_root: the directory holding the ``<rank>/`` directories (``root`` or
            ``root/<session>``).
        files: iteration -> files, sorted by ``rel``.
        dirty: unfinished saves (``iter_*_local.dirty.pt``), relative paths.
        rejected: files in ``<rank>/rejected/`` (local files the training run quarantined),
            relative paths.
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

    def merge_seen(self, seen: List[tuple]) -> None:
        """Make iterations and leftovers the union of every rank's :meth:`seen` (a distributed
        run may see node-local directories only)."""
        for it in sorted(set().union(*(x[0] for x in seen))):
            self.files.setdefault(it, [])
        self.dirty = sorted({rel for x in seen for rel in x[1]})
        self.rejected = sorted({rel for x in seen for rel in x[2]})
        self.markers = {rel: m for x in seen for rel, m in sorted(x[3].items())}

    def seen(self) -> tuple:
        """What this process saw, for :meth:`merge_seen` on every rank (picklable)."""
        return set(self.files), self.dirty, self.rejected, self.markers


def _read_marker(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"unreadable": f"{type(e).__name__}: {e}"}
    if isinstance(data, dict):
        return data
    return {"unreadable": f"a JSON {type(data).__name__}, not an object"}


_Scan = Tuple[Dict[int, List[LocalFile]], List[str], List[str], Dict[str, dict]]


def _scan_rank_dirs(d: Path, root: Path) -> _Scan:
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
                lf = LocalFile(str(f.resolve()), rel, holder, owner, it, f.stat().st_size)
                files.setdefault(it, []).append(lf)
            elif is_unfinished(f.name):
                dirty.append(rel)
            elif f.name == MARKER_NAME and f.is_file():
                markers[rel] = _read_marker(f)
            elif f.name == QUARANTINE_DIR and f.is_dir():
                rejected += sorted(str(q.relative_to(root)) for q in f.rglob("*") if q.is_file())
    return files, dirty, rejected, markers


def discover_local(local_dir: Union[str, os.PathLike]) -> LocalLayout:
    """Find the local checkpoint files under ``local_dir``, and the leftovers of interrupted saves.

    Args:
        local_dir: the run's ``--non-persistent-local-ckpt-dir`` (holding ``<rank>/``
            directories), or that directory's ``<session_id>/`` subdirectory.

    Returns:
        A :class:`LocalLayout` (possibly with no files: for distributed runs a rank may see none),
        with its ``dirty``, ``rejected`` and ``markers`` leftovers.

    Raises:
        CheckpointInputError: ``local_dir`` does not exist or is not a directory, or several
            session directories hold checkpoints (pass one of them).
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


def require_local_files(layout: LocalLayout) -> None:
    """Raises CheckpointInputError: no rank saw any local checkpoint file."""
    if not any(layout.files.values()):
        raise CheckpointInputError(
            f"no local checkpoint files ({FILE_PATTERN_TEXT}) under {layout.root}; pass the "
            "run's --non-persistent-local-ckpt-dir"
        )


def choose_iteration(
    layout: Optional[LocalLayout],
    persistent_dir: Optional[Union[str, os.PathLike]],
    iteration: Optional[int],
) -> Tuple[Optional[int], Optional[Path]]:
    """``(iteration, persistent iteration directory or None)`` to verify (see
    :func:`megatron.verify.verify_checkpoint`).

    Raises:
        CheckpointInputError: the local checkpoint has no ``iteration``, or
            :func:`~megatron.integrity.persistent.resolve_persistent_dir` refused.
        IterationMismatchError: the persistent iteration is not among the local ones.
    """
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
        local_its = layout.iterations if layout is not None else []
        if local_its and p_it is not None and p_it not in layout.files:
            raise IterationMismatchError(
                f"iteration mismatch: the persistent checkpoint {p_dir} is iteration {p_it}, the "
                f"local checkpoint in {layout.rank_root} holds iteration(s) {layout.iterations}. "
                f"Verify against a persistent checkpoint of the same iteration (e.g. "
                f"{p_dir.parent / f'iter_{layout.iterations[-1]:07d}'}), or save both tiers at one "
                "iteration (see megatron.verify docs)"
            )
        iteration = p_it if p_it is not None else iteration
    if iteration is None and layout is not None and layout.iterations:
        iteration = layout.iterations[-1]
    return iteration, p_dir


@dataclass
class Plan:
    """What is verified (the same on every rank), and this rank's share of it."""

    layout: Optional[LocalLayout]
    pc: Optional[PersistentCheckpoint]
    manifest: Optional[dict]
    iteration: Optional[int]
    checked: List[int] = field(default_factory=list)  # local iterations checked
    copies: List[LocalFile] = field(default_factory=list)  # every local file of those, any rank
    my_local: List[LocalFile] = field(default_factory=list)
    my_data_files: List[str] = field(default_factory=list)
    my_manifest: List[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        """``"local+persistent"``, ``"local"`` or ``"persistent"``."""
        if self.layout is not None and self.pc is not None:
            return "local+persistent"
        return "local" if self.layout else "persistent"
