"""Resume from the local tier at another data-parallel size: a node lost with no spare (or spares
returned) costs no iterations.

NVRx's local checkpoints need the same world size at load as at save, and megatron-core asserts;
without a spare node a restart on fewer nodes therefore lost every iteration since the last
persistent save. Every shard of the local checkpoint usually still exists on the surviving nodes
(primaries and replicas), and the shards' ``ShardedTensor`` metadata places them in the
topology-independent checkpoint space. When the start's topology differs from the checkpoint's in
the data-parallel size only, :func:`assemble` loads one verified copy of every old rank's shard
(each on a rank that can read it), picks one copy of every tensor shard, and writes them with
upstream's ``dist_checkpointing.save`` as the ``torch_dist`` checkpoint of that iteration in
``--save`` (a durable copy, with this fork's checksums and the saved state digest). Upstream's
load then reads it resharded to the new DP size (model and ``dp_reshardable`` distributed-optimizer
state), and the resume proof compares the loaded state with the digest taken at the local save.
Design and measurements: ``docs/local-tier.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.integrity import persistent_dirs, unpickle
from megatron.overlay.collective import RankFailures, summarize
from megatron.training_ext.console import process_rank
from megatron.training_ext.local_tier.common import exc_text, gather_objects, logger, shorten
from megatron.training_ext.resume_proof import digest_of_save

__all__ = ["DP_SETTINGS", "ReshardError", "assemble", "dp_only_change", "plan_loaders"]

#: Topology settings that may differ between the local checkpoint and the start: the data-parallel
#: size (and the world size it implies) and how the local save spread its tensors over DP ranks.
DP_SETTINGS = ("world_size", "data_parallel_size", "non_persistent_local_ckpt_algo")
#: Where the old ranks' shards sit in the assembled state dict (dist_checkpointing keys tensors by
#: ``ShardedTensor.key``, not by their place in the dict).
_SHARDS_KEY = "local_tier_reshard"
#: The directory of ``--save`` in which the checkpoint is written before it is renamed into place.
STAGING = ".local_tier_reshard"


class ReshardError(RankFailures, RuntimeError):
    """The local checkpoint cannot be resumed at this DP size; the message says why (raised on
    every rank together). ``bad``: ``(old rank, new rank)`` of each copy that failed to load or
    verify, when that was the only problem (another copy may do). The start catches it and falls
    back to the persistent tier, naming the reason."""

    def __init__(self, message: str, bad: Sequence[Tuple[int, int]] = ()):
        super().__init__(message)
        self.bad = list(bad)


def dp_only_change(saved: Optional[dict], now: dict) -> Optional[str]:
    """Whether a local checkpoint written under topology ``saved`` can be resumed under ``now`` by
    resharding across DP.

    Args:
        saved, now: :func:`megatron.integrity.local_identity.topology` records.

    Returns:
        ``None`` when they differ in :data:`DP_SETTINGS` only (and do differ in the DP size),
        else the reason (the settings that differ, or ``"same topology"``).
    """
    if not isinstance(saved, dict):
        return "no topology record"
    other = sorted(
        k for k in set(saved) | set(now) if k not in DP_SETTINGS and saved.get(k) != now.get(k)
    )
    if other:
        return "another " + ", ".join(
            f"{k} ({saved.get(k)} in the checkpoint, {now.get(k)} now)" for k in other
        )
    if saved.get("data_parallel_size") == now.get("data_parallel_size"):
        return "same topology"
    return None


def plan_loaders(candidates: Dict[int, List[int]]) -> Dict[int, int]:
    """Which new rank loads each old rank's shard: balanced, deterministic (every rank computes
    the same plan from the same gathered inventory).

    Args:
        candidates: old rank -> new ranks holding a usable copy of its shard.

    Returns:
        old rank -> the new rank that loads it.

    Raises:
        ReshardError: an old rank has no candidate.
    """
    load: Dict[int, int] = {}
    plan: Dict[int, int] = {}
    for old in sorted(candidates):
        holders = sorted(set(candidates[old]))
        if not holders:
            raise ReshardError(f"no verified copy of rank {old}'s shard")
        pick = min(holders, key=lambda r: (load.get(r, 0), r != old, r))
        plan[old] = pick
        load[pick] = load.get(pick, 0) + 1
    return plan


def _replica_key(replica_id: Any) -> Tuple[int, ...]:
    return tuple(replica_id) if isinstance(replica_id, (tuple, list)) else (int(replica_id),)


def _main_replica(replica_id: Any) -> Any:
    return tuple(0 for _ in replica_id) if isinstance(replica_id, (tuple, list)) else 0


def _inventory(state_dicts: Dict[int, Any]) -> List[tuple]:
    """(shard id, replica id, old rank) of every ShardedTensor with data in this rank's loaded
    shards (a shard saved ``fully_parallel`` holds data for the tensors its DP rank wrote)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.utils import _sharded_tensor_shard_id

    out = []
    for old, sd in state_dicts.items():
        for sh in nested_values(sd.sharded_state_dict):
            if isinstance(sh, ShardedTensor) and sh.data is not None:
                out.append((_sharded_tensor_shard_id(sh), _replica_key(sh.replica_id), old))
    return out


def _winners(inventories: Sequence[List[tuple]]) -> Dict[Any, int]:
    """shard id -> the old rank whose copy is written: the copy with the smallest replica id
    (the main replica when it holds data), then the lowest old rank."""
    best: Dict[Any, tuple] = {}
    for inv in inventories:
        for shard_id, rid, old in inv:
            cur = best.get(shard_id)
            if cur is None or (rid, old) < cur:
                best[shard_id] = (rid, old)
    return {k: v[1] for k, v in best.items()}


def _select(sd: Any, old: int, winners: Dict[Any, int]) -> Any:
    """``sd``'s sharded part with only the tensor shards it wins (made main replicas) and all its
    ShardedObjects (their replica ids are the saving run's: one main copy of each)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.utils import _sharded_tensor_shard_id

    def keep(x):
        if isinstance(x, ShardedTensor):
            if x.data is None or winners.get(_sharded_tensor_shard_id(x)) != old:
                return None
            x.replica_id = _main_replica(x.replica_id)
        return x

    part = dict_list_map_inplace(keep, sd.sharded_state_dict)
    return _prune(part)


def _prune(x: Any) -> Any:
    if isinstance(x, dict):
        out = {k: _prune(v) for k, v in x.items()}
        return {k: v for k, v in out.items() if v is not None and v != {} and v != []}
    if isinstance(x, list):
        out = [_prune(v) for v in x]
        return [v for v in out if v is not None and v != {} and v != []]
    return x


def content_metadata(ckpt_args: Any) -> dict:
    """The ``sharded_state_dict`` metadata the local save used (upstream's
    ``_build_sharded_state_dict_metadata`` of the checkpoint's own arguments), without its
    process group: stored as the assembled checkpoint's content metadata, so the load reads the
    optimizer state in the format it was written in (``dp_reshardable``)."""
    from megatron.training import checkpointing

    meta = checkpointing._build_sharded_state_dict_metadata(ckpt_args, dp_cp_group=dist.group.WORLD)
    meta.pop("dp_cp_group", None)
    return meta


def assemble(
    *,
    iteration: int,
    loaders: Dict[int, int],
    paths: Dict[int, str],
    load_and_verify,
    target: str,
) -> Tuple[List[str], float, float, List[str]]:
    """Collective (world): write the local checkpoint of ``iteration`` as a ``torch_dist``
    checkpoint in ``target`` (``--save/iter_<N>``), from the old ranks' shards.

    Args:
        iteration: the local checkpoint's iteration.
        loaders: old rank -> the new rank that loads its shard (:func:`plan_loaders`).
        paths: old rank -> the file this rank loads (only the old ranks ``loaders`` gives it).
        load_and_verify: ``f(path, old_rank) -> state dict`` (an ``MCoreTensorAwareStateDict``
            whose checksums and finiteness were verified), raising on a bad copy.
        target: the iteration directory to create (written as ``--save/.local_tier_reshard/
            iter_<N>`` and renamed into place when complete); it must not hold a complete
            checkpoint.

    Returns:
        (the files this rank used, seconds spent reading and verifying them (the slowest rank),
        seconds in all, the directories set aside: an existing incomplete ``target`` is renamed
        ``<target>.incomplete-<time>``, never deleted).

    Raises:
        ReshardError: on every rank together: a copy failed to load or verify (naming it), the
            target holds a complete checkpoint, or the write failed.
    """
    t0 = time.perf_counter()
    mine = sorted(o for o, r in loaders.items() if r == process_rank())
    loaded, winners, read = _load_shards(mine, paths, load_and_verify, target, t0)
    src = loaders.get(0, 0)  # rank 0's common state: args, iteration, scheduler, digest
    box = [loaded[0].common if process_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    common = box[0]
    state: Dict[str, Any] = dict(common)
    state[_SHARDS_KEY] = {f"rank{old}": _select(sd, old, winners) for old, sd in loaded.items()}
    staged = _write_staged(state, common, target)
    aside = _publish(staged, target, iteration)
    return [paths[o] for o in mine], read, time.perf_counter() - t0, aside


def _load_shards(
    mine: List[int], paths: Dict[int, str], load_and_verify, target: str, t0: float
) -> Tuple[Dict[int, Any], Dict[Any, int], float]:
    """Collective: load and verify the old ranks' shards ``mine`` (this rank's part of the plan)
    and agree which old rank's copy of every tensor shard is written. Returns (old rank -> state
    dict, shard id -> old rank that writes it, seconds reading and verifying on the slowest
    rank).

    Raises:
        ReshardError: on every rank, naming each copy that failed (``bad``), or the target
            already holding a complete checkpoint.
    """
    loaded: Dict[int, Any] = {}
    errors: List[tuple] = []  # (old rank or None, text)
    if process_rank() == 0 and persistent_dirs.is_complete(target):
        errors.append((None, f"{target} already holds a complete checkpoint"))
    for old in mine:
        try:
            loaded[old] = load_and_verify(paths[old], old)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            errors.append((old, f"rank {old}'s shard {paths[old]}: {exc_text(e)}"))
    inventory = [] if errors else _inventory(loaded)
    gathered = gather_objects((errors, inventory, time.perf_counter() - t0))
    if any(e for e, _, _ in gathered):
        texts = [[t for _, t in e] for e, _, _ in gathered]
        bad = [(old, r) for r, (e, _, _) in enumerate(gathered) for old, _ in e]
        raise ReshardError(summarize(texts), bad=[] if any(o is None for o, _ in bad) else bad)
    winners = _winners([inv for _, inv, _ in gathered])
    return loaded, winners, max(r for _, _, r in gathered)


def _write_staged(state: Dict[str, Any], common: Dict[str, Any], target: str) -> str:
    """Collective: ``dist_checkpointing.save`` of ``state`` into the staging directory of
    ``target`` (a start killed during the write leaves no half-written ``iter_<N>``: the next
    start writes it again), under the local save's state digest. Returns the staging directory.

    Raises:
        ReshardError: on every rank, when the staging directory cannot be created or the write
            failed.
    """
    from megatron.core import dist_checkpointing

    record = common.get("state_digest")
    if isinstance(record, (str, bytes)):
        record = json.loads(record)
    root = os.path.dirname(target.rstrip("/"))
    staged = os.path.join(root, STAGING, os.path.basename(target.rstrip("/")))

    def stage():
        shutil.rmtree(staged, ignore_errors=True)  # ours: a killed earlier attempt's
        os.makedirs(staged)

    _on_rank0(stage, f"creating {staged}")
    try:
        with digest_of_save(record):
            dist_checkpointing.save(
                state,
                staged,
                content_metadata=content_metadata(common["args"]),
                validate_access_integrity=True,
            )
        error = None
    except Exception as e:  # noqa: BLE001 - dist_checkpointing raises the same on every rank
        error = exc_text(e)
        logger.exception("local tier: writing %s failed", staged)
    errs = gather_objects([error] if error else [])
    if any(errs):
        if process_rank() == 0:
            shutil.rmtree(staged, ignore_errors=True)
        raise ReshardError(f"writing {target} failed: {summarize(errs)}")
    return staged


def _publish(staged: str, target: str, iteration: int) -> List[str]:
    """Collective: rank 0 renames ``staged`` to ``target`` (an existing incomplete ``target``,
    an interrupted save of this iteration, is kept, renamed) and points the tracker at it.
    Returns the directories set aside (every rank)."""
    aside: List[str] = []

    def publish():
        if os.path.lexists(target):  # an interrupted save of this iteration: kept, renamed
            old = f"{target}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}"
            os.rename(target, old)
            aside.append(old)
        os.rename(staged, target)
        try:
            os.rmdir(os.path.dirname(staged))
        except OSError:
            pass
        persistent_dirs.write_tracker(os.path.dirname(target.rstrip("/")), iteration)

    _on_rank0(publish, f"renaming {staged} to {target}")
    box = [aside]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_rank0(fn, what: str) -> bool:
    """Collective: run ``fn`` on rank 0; every rank raises :class:`ReshardError` together when it
    failed (no rank is left waiting in a later collective). Returns True (it ran)."""
    error = None
    if process_rank() == 0:
        try:
            fn()
        except OSError as e:
            error = f"{what}: {exc_text(e)}"
    errs = gather_objects([error] if error else [])
    if any(errs):
        raise ReshardError(summarize(errs))
    return True


def describe(files: List[str], root: str) -> str:
    """The files a rank used, relative to the local checkpoint root."""
    rel = [os.path.relpath(f, root) if root else f for f in files]
    return shorten(", ".join(rel), 300) if rel else "none (its shards were loaded elsewhere)"


def loaded_state(path: str) -> Any:
    """``torch.load`` of one local checkpoint file (host tensors as stored), restricted to the
    allowlist of :mod:`megatron.integrity.unpickle`."""
    return unpickle.torch_load(path, map_location="cpu")
