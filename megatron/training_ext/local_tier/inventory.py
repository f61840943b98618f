"""What one rank can read at the start of a load, without any collective: its local files (the
header of every copy, memory-mapped; the own primary of the newest iteration fully loaded and
verified), the files in the other rank directories of its host (for a reshard), its bad-tier
marker, the persistent iteration and the settings the decision needs.

Every rank's :class:`Inventory` is gathered once (:mod:`.manager`); :func:`.plan.decide` decides
from the gathered inventories alone.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.integrity import local_identity, local_layout, persistent_dirs, unpickle
from megatron.training_ext.local_tier.checks import header_fingerprint, verify_state_dict
from megatron.training_ext.local_tier.common import exc_text, shorten
from megatron.training_ext.local_tier.markers import read_marker
from megatron.training_ext.local_tier.reshard import dp_only_change

__all__ = [
    "Inventory",
    "LocalCopy",
    "RankDir",
    "ReshardSettings",
    "Taken",
    "remove_dirty",
    "take_inventory",
    "verify_primary",
]


@dataclass(frozen=True)
class LocalCopy:
    """One local file, as the rank that can read it judged it (gathered to all ranks).

    Attributes:
        iteration, owner: whose shard of which iteration its name says.
        holder: the rank that read it (and would read or send it).
        problem: why it cannot be used; ``None``: usable so far.
        run_id, token: its identity record's run id and save token.
        fingerprint: hash of its stored checksum record (:func:`.checks.header_fingerprint`).
        foreign: why its run id differs from the holder's (which settings), if it does.
        bytes_verified: checksums and finiteness were checked against its bytes.
        path: where the holder reads it.
        dir_rank: the rank directory it is in (``== owner``: the primary).
        sibling: in another rank's directory on the holder's host (used only to reshard).
        saved_topology: the topology it was written under, when only the DP size differs.
    """

    iteration: int
    owner: int
    holder: int
    problem: Optional[str]
    run_id: Optional[str] = None
    token: Optional[str] = None
    fingerprint: Optional[str] = None
    foreign: Optional[str] = None
    bytes_verified: bool = False
    path: Optional[str] = None
    dir_rank: Optional[int] = None
    sibling: bool = False
    saved_topology: Optional[dict] = None


@dataclass(frozen=True)
class ReshardSettings:
    """What a reshard needs of this run's arguments: ``--save`` (where it writes), whether
    ``--load`` names another directory, ``--ckpt-format`` and ``--auto-detect-ckpt-format``."""

    save: Optional[str] = None
    load_elsewhere: bool = False
    ckpt_format: str = "torch_dist"
    auto_detect: bool = False


@dataclass(frozen=True)
class Inventory:
    """What one rank found at the start of a load (gathered to all ranks).

    Attributes:
        rank, host: the rank and its host name.
        identity: (run id, its source, run settings, topology) as this rank derives them.
        generation: a random token of this process generation (rank 0's becomes the save token).
        marker: the bad-tier marker in its local directory, if any.
        persistent: the persistent iteration upstream's load will use (``None``: none).
        copies: every local file it can read (its own directory's first, newest first).
        leftovers: names of the ``*.dirty.pt`` files of an interrupted save it removed.
        load_dir: ``--load``.
        can_repair: a replication strategy can carry a shard between ranks.
        reshard: the settings a reshard needs.
    """

    rank: int
    host: str
    identity: tuple
    generation: str
    marker: Optional[dict]
    persistent: Optional[int]
    copies: Tuple[LocalCopy, ...]
    leftovers: Tuple[str, ...] = ()
    load_dir: Optional[str] = None
    can_repair: bool = True
    reshard: ReshardSettings = ReshardSettings()


@dataclass(frozen=True)
class RankDir:
    """This rank's local checkpoint directory (``<root>/<session>/<rank>``) and how NVRx reads
    one of its files (``load(ckpt_id)``: host tensors as stored)."""

    path: Path
    session_id: str
    rank: int
    load: Callable[[tuple], Any]

    def ckpt_id(self, iteration: int) -> tuple:
        """NVRx's id of this rank's shard of ``iteration``."""
        return (iteration, self.rank, self.session_id)


@dataclass
class Taken:
    """An inventory and what taking it loaded on this rank.

    Attributes:
        inventory: what is gathered.
        loaded: ckpt id -> (state dict, verification summary) of the primaries verified here.
        own_primary_s: seconds spent loading and verifying them.
    """

    inventory: Inventory
    loaded: Dict[tuple, tuple]
    own_primary_s: float


def take_inventory(rank_dir: RankDir, identity: tuple, args: Any, can_repair: bool) -> Taken:
    """This rank's inventory (no collectives): removes the leftovers of an interrupted save,
    reads every local file's header, loads and verifies the own primary of the newest own
    iteration, and reads the other rank directories of the host when no file has this start's
    topology.

    Args:
        rank_dir: this rank's directory.
        identity: (run id, source, run settings, topology) of this rank.
        args: the run's arguments (``--load``, ``--save``, ``--ckpt-step``, format flags).
        can_repair: a replication strategy is available.
    """
    run_id, _, settings, topo = identity
    leftovers = remove_dirty(rank_dir.path)
    copies, loaded, seconds = _read_own(rank_dir, run_id, settings, topo)
    if all(c.saved_topology is not None for c in copies):  # no file of this topology
        copies += _read_siblings(rank_dir, run_id, settings, topo)
    load_dir = getattr(args, "load", None)
    save = getattr(args, "save", None)
    inventory = Inventory(
        rank=rank_dir.rank,
        host=socket.gethostname(),
        identity=identity,
        generation=uuid.uuid4().hex,
        marker=read_marker(rank_dir.path),
        persistent=persistent_iteration(load_dir, args),
        copies=tuple(copies),
        leftovers=tuple(leftovers),
        load_dir=load_dir,
        can_repair=can_repair,
        reshard=ReshardSettings(
            save=save,
            load_elsewhere=bool(save and load_dir)
            and os.path.realpath(load_dir) != os.path.realpath(save),
            ckpt_format=getattr(args, "ckpt_format", "torch_dist"),
            auto_detect=bool(getattr(args, "auto_detect_ckpt_format", False)),
        ),
    )
    return Taken(inventory, loaded, seconds)


def _read_own(
    rank_dir: RankDir, run_id: str, settings: dict, topo: dict
) -> Tuple[List[LocalCopy], Dict[tuple, tuple], float]:
    """The copies in this rank's directory, newest first; the own primary of the newest own
    iteration loaded and verified. Returns (copies, loaded, seconds verifying)."""
    me = rank_dir.rank
    files = []
    if rank_dir.path.is_dir():
        for p in rank_dir.path.iterdir():
            parsed = local_layout.parse_local_name(p.name)
            if parsed is not None and not parsed[2] and p.is_file():
                files.append((parsed[0], parsed[1], p))
    own_iters = [it for it, owner, _ in files if owner == me]
    speculative = max(own_iters) if own_iters else None
    copies, loaded, seconds = [], {}, 0.0
    for it, owner, path in sorted(files, key=lambda x: (-x[0], x[1])):
        c = read_copy(it, owner, path, me, run_id, settings, topo)
        if c.problem is None and c.foreign is None and owner == me and it == speculative:
            c, verified, dt = verify_primary(rank_dir, c)
            seconds += dt
            if verified is not None:
                loaded[rank_dir.ckpt_id(it)] = verified
        copies.append(c)
    return copies, loaded, seconds


def _read_siblings(rank_dir: RankDir, run_id: str, settings: dict, topo: dict) -> List[LocalCopy]:
    """Copies of another DP size in the other rank directories of this host: after a restart at
    another DP size rank numbers move between nodes (used only to reshard, see reshard.py)."""
    out = []
    for sub in _sibling_dirs(rank_dir.path):
        for p in sub.iterdir():
            parsed = local_layout.parse_local_name(p.name)
            if parsed is None or parsed[2] or not p.is_file():
                continue
            c = read_copy(parsed[0], parsed[1], p, rank_dir.rank, run_id, settings, topo)
            if c.saved_topology is not None:
                out.append(replace(c, sibling=True))
    return out


def read_copy(
    it: int, owner: int, path: Path, me: int, run_id: str, settings: dict, topo: dict
) -> LocalCopy:
    """One local file's header judged against this run (no tensor data read)."""
    dir_rank = int(path.parent.name) if path.parent.name.isdigit() else None
    base = dict(iteration=it, owner=owner, holder=me, path=str(path), dir_rank=dir_rank)
    try:
        try:
            header = local_identity.read_header(path)
        except unpickle.UnsafeCheckpointError:
            raise  # never loaded another way
        except Exception:  # noqa: BLE001 - let torch tell what is wrong with the file
            header = unpickle.torch_load(path, mmap=True)
        rec = local_identity.get_identity(header)
    except Exception as e:  # noqa: BLE001 - a truncated/unreadable file is this copy's problem
        return LocalCopy(problem=f"unreadable: {exc_text(e)}", **base)
    problems = local_identity.identity_problems(rec, run_id, settings, topo, it, owner)
    foreign = saved_topology = None
    if rec is not None:
        base.update(run_id=rec.get("run_id"), token=rec.get("save_token"))
        if rec.get("run_id") != run_id:  # decided collectively against the agreed run id
            foreign, problems = problems[0], problems[1:]
        saved = rec.get("topology")
        if problems and dp_only_change(saved, topo) is None:
            rest = local_identity.identity_problems(rec, run_id, settings, saved, it, owner)
            if foreign is not None:
                rest = rest[1:]
            if not rest:
                saved_topology = dict(saved)
    return LocalCopy(
        problem="; ".join(problems) or None,
        fingerprint=header_fingerprint(header),
        foreign=foreign,
        saved_topology=saved_topology,
        **base,
    )


def verify_primary(rank_dir: RankDir, c: LocalCopy) -> Tuple[LocalCopy, Optional[tuple], float]:
    """Load this rank's primary ``c`` as upstream does and check it against its checksums and
    finiteness record. Returns (``c`` judged by its bytes, (state dict, summary) when it
    verifies, seconds spent)."""
    t0 = time.perf_counter()
    try:
        sd = rank_dir.load(rank_dir.ckpt_id(c.iteration))  # host tensors: verified first
        errors, summary = verify_state_dict(sd, f"rank {c.holder}'s primary", check_checksums=True)
        sd.restore_tensor_device(non_blocking=False)
    except Exception as e:  # noqa: BLE001
        errors, summary = [f"unreadable: {exc_text(e)}"], ""
    seconds = time.perf_counter() - t0
    if errors:
        return (
            replace(c, bytes_verified=True, problem=shorten("; ".join(errors), 400)),
            None,
            seconds,
        )
    return replace(c, bytes_verified=True), (sd, summary), seconds


def remove_dirty(directory: Path) -> List[str]:
    """Delete the ``*.dirty.pt`` files (leftovers of an interrupted save) in ``directory``;
    returns their names."""
    removed = []
    if directory.is_dir():
        for p in sorted(directory.iterdir()):
            parsed = local_layout.parse_local_name(p.name)
            if parsed is not None and parsed[2] and p.is_file():
                p.unlink(missing_ok=True)
                removed.append(p.name)
    return removed


def persistent_iteration(load_dir: Optional[str], args: Any) -> Optional[int]:
    """The persistent iteration upstream's load will use: ``--ckpt-step`` (also as set by the
    persistent tier when the tracker is overruled), else the tracker's (no collectives)."""
    if not load_dir:
        return None
    step = getattr(args, "ckpt_step", None)
    if step:
        return int(step)
    tracker = persistent_dirs.read_tracker(load_dir)
    return None if tracker.release else tracker.iteration


def _sibling_dirs(own: Path) -> List[Path]:
    """The other ``<rank>/`` directories next to this rank's local checkpoint directory."""
    root = own.parent
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and p.name != own.name),
        key=lambda p: int(p.name),
    )
