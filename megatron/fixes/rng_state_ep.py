"""Fix ``rng_state_ep``: every rank restores its own RNG states from a ``torch_dist`` checkpoint.

megatron-core 0.19.2's ``get_rng_state`` stores the RNG states (Python, NumPy, CPU, CUDA and the
model-parallel tracker's streams) as one ``ShardedObject('rng_state', ...)`` keyed by (PP, TP) only,
with the data-parallel rank as ``replica_id``. With expert parallelism the tracker's
``expert-parallel-rng`` stream is seeded per expert rank (``seed + 1024 + 100 * ep_rank +
etp_rank``), but only the data-parallel rank 0 of each (PP, TP) writes the object, and on load
every rank restores that rank's states: each rank with ``ep_rank > 0`` resumes on another rank's
expert stream (MoE router noise, expert dropout). Megatron-LM PR 6858 (on main after 0.19.2)
fixes this by giving the key the expert axes.

Design notes: ``docs/fixes/rng_state_ep.md``.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

from megatron.fixes.standins import get_rng_state_stand_ins, group, parallel_state, upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

logger = logging.getLogger("megatron.fixes")

PER_RANK_KEY = "rng_state_per_rank"
_EXPERT_PREFIX = (
    "expert"  # tracker names of per-expert-rank streams: expert-parallel-rng, expert-...
)


def rng_checksum(state: Any) -> str:
    """Short SHA-256 checksum of one RNG state (a ``torch.ByteTensor``, or anything
    ``repr``-able), for comparing states in logs: 12 hex characters."""
    import torch

    if isinstance(state, torch.Tensor):
        data = state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    else:
        data = repr(state).encode()
    return hashlib.sha256(data).hexdigest()[:12]


def stream_checksums(rng_state: dict) -> dict[str, str]:
    """Checksum (:func:`rng_checksum`) of every stream of one rank's RNG state dict (as
    ``get_rng_state`` builds it): ``torch`` (CPU), ``cuda`` and each tracker stream by name."""
    out = {
        "torch": rng_checksum(rng_state["torch_rng_state"]),
        "cuda": rng_checksum(rng_state["cuda_rng_state"]),
    }
    for name, st in sorted(rng_state.get("rng_tracker_states", {}).items()):
        out[name] = rng_checksum(st)
    return out


def _topology() -> dict[str, int]:
    import torch
    from megatron.core import parallel_state as ps

    return {
        "world": torch.distributed.get_world_size(),
        "rank": torch.distributed.get_rank(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
    }


def _fmt(d: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


# --- the replacements ---------------------------------------------------------------------------


def wrap_get_rng_state(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.checkpointing.get_rng_state``: upstream's
    RNG states, for ``torch_dist`` in a job with a model-parallel topology, as one
    ``ShardedObject`` per rank (key :data:`PER_RANK_KEY`, shape ``(world,)``, offset ``(rank,)``,
    ``replica_id`` 0), each state carrying ``rng_topology`` (:func:`_topology`). The object keeps
    upstream's own as ``megatron_fixes_old_layout`` (:func:`wrap_load` loads checkpoints of that
    layout). Anything else (other formats, no process group): upstream's result, unchanged."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    @wraps_upstream(upstream)
    def get_rng_state(
        ckpt_format, tp_group, pp_group, dp_cp_group=None, dp_group=None, key_prefix=""
    ):
        """Upstream's RNG states, as one ShardedObject per rank."""
        out = upstream(
            ckpt_format,
            tp_group,
            pp_group,
            dp_cp_group=dp_cp_group,
            dp_group=dp_group,
            key_prefix=key_prefix,
        )
        from megatron.core import parallel_state as ps

        if (
            not isinstance(out, ShardedObject)
            or not torch.distributed.is_initialized()
            or not ps.model_parallel_is_initialized()
        ):
            return out  # no job topology to key by: upstream's layout
        topo = _topology()
        states = [dict(s, rng_topology=topo) for s in out.data]
        per_rank = ShardedObject(
            f"{key_prefix}{PER_RANK_KEY}",
            states,
            (topo["world"],),
            (topo["rank"],),
            replica_id=0,
        )
        per_rank.megatron_fixes_old_layout = out  # for loading checkpoints of the old layout
        return per_rank

    return get_rng_state


def rng_load_mode(entry: Any, checkpoint_dir: Any) -> str:
    """How to load this rank's per-rank RNG entry (``entry``, a ``ShardedObject`` of
    :func:`wrap_get_rng_state`) from ``checkpoint_dir``: ``"per_rank"`` (the checkpoint holds this
    rank's entry, or is not a ``torch_dist`` checkpoint: left to upstream), ``"other_world"`` (it
    holds per-rank entries of another number of ranks) or ``"old_layout"`` (upstream's (PP, TP)
    object only)."""
    keys = _checkpoint_object_keys(checkpoint_dir)
    if keys is not None and entry.unique_key not in keys:
        if any(k.startswith(f"{entry.key}/") for k in keys):
            return "other_world"
        return "old_layout"
    return "per_rank"


def _reseed_expert_streams(got: dict, cur: dict) -> None:
    """In ``got`` (a loaded RNG state), every expert stream (:data:`_EXPERT_PREFIX`) becomes this
    run's (``cur``'s); one this run does not have is dropped."""
    tracker = dict(got.get("rng_tracker_states", {}))
    for name in list(tracker):
        if name.startswith(_EXPERT_PREFIX):
            mine = cur.get("rng_tracker_states", {}).get(name)
            if mine is None:
                del tracker[name]
            else:
                tracker[name] = mine
    for name, st in cur.get("rng_tracker_states", {}).items():
        if name.startswith(_EXPERT_PREFIX):
            tracker.setdefault(name, st)
    got["rng_tracker_states"] = tracker


def restore_rank_states(current: list, loaded: list, mode: str) -> tuple[list[dict], str]:
    """The RNG states this rank restores, and how (one phrase, for the log).

    Args:
        current: this run's states as seeded (the load template's data, each with
            ``rng_topology``).
        loaded: the states read from the checkpoint, in the same order.
        mode: ``"per_rank"`` or ``"old_layout"`` (:func:`rng_load_mode`).

    Returns:
        ``loaded`` without ``rng_topology``; its expert streams replaced by this run's where the
        checkpoint's are another rank's (old layout, written by data-parallel rank 0 only) or were
        saved under another EP/ETP layout (:func:`_reseed_expert_streams`).
    """
    topo = current[0]["rng_topology"]
    restored = []
    how = ""
    for cur, got in zip(current, loaded):
        got = dict(got)
        saved_topo = got.pop("rng_topology", None)
        if mode == "old_layout":
            keep_expert = _dp_cp_rank() == 0
            how = (
                "old (PP, TP) layout: this rank wrote it, all streams restored"
                if keep_expert
                else "old (PP, TP) layout written by data-parallel rank 0: dense streams "
                "from it, expert streams reseeded (this run's)"
            )
        else:
            keys_same = ("world", "rank", "ep", "ep_rank", "etp", "etp_rank")
            keep_expert = all(saved_topo.get(k) == topo[k] for k in keys_same)
            how = (
                "its own states, all streams restored"
                if keep_expert
                else f"own entry saved under EP={saved_topo.get('ep')} "
                f"ETP={saved_topo.get('etp')} "
                f"(ep_rank {saved_topo.get('ep_rank')}): dense streams restored, expert "
                f"streams reseeded for EP={topo['ep']} ETP={topo['etp']} "
                f"(ep_rank {topo['ep_rank']})"
            )
        if not keep_expert:
            _reseed_expert_streams(got, cur)
        restored.append(got)
    return restored, how


def wrap_load(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.core.dist_checkpointing.load``: upstream's; when
    the state dict's ``rng_state`` is a per-rank entry (:func:`wrap_get_rng_state`), this rank's
    entry is read (:func:`rng_load_mode`), or upstream's old (PP, TP) object, or nothing when the
    checkpoint was written by another number of ranks (every stream stays as this run seeded
    it); the states restored follow :func:`restore_rank_states`."""
    import torch

    @wraps_upstream(upstream)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        """Upstream's load; reads this rank's RNG entry, or the old layout."""
        entry = (
            sharded_state_dict.get("rng_state") if isinstance(sharded_state_dict, dict) else None
        )
        old = getattr(entry, "megatron_fixes_old_layout", None)
        if old is None:
            return upstream(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        current = entry.data  # this run's states, as seeded (template of the load)
        rank = torch.distributed.get_rank()
        mode = rng_load_mode(entry, checkpoint_dir)
        if mode == "other_world":
            sharded_state_dict.pop("rng_state")
        elif mode == "old_layout":
            sharded_state_dict["rng_state"] = old
        result = upstream(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        loaded_sd = result[0] if isinstance(result, tuple) else result
        if mode == "other_world":
            loaded_sd["rng_state"] = current
            logger.warning(
                "rng_state: rank %d: checkpoint %s was written by another number of "
                "ranks; RNG states not restored, every stream stays as this run "
                "seeded it",
                rank,
                checkpoint_dir,
            )
            return result
        restored, how = restore_rank_states(current, loaded_sd["rng_state"], mode)
        loaded_sd["rng_state"] = restored
        logger.warning(
            "rng_state: rank %d loads %s; restored %s",
            rank,
            how,
            _fmt(stream_checksums(restored[0])),
        )
        return result

    return load


def wrap_generate_state_dict(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.checkpointing.generate_state_dict``:
    upstream's, logging (DEBUG) a checksum of each RNG stream this rank saves in a per-rank
    entry."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    @wraps_upstream(upstream)
    def generate_state_dict(*args, **kwargs):
        """Upstream's; logs a checksum of each RNG stream saved."""
        sd = upstream(*args, **kwargs)
        rng = sd.get("rng_state") if isinstance(sd, dict) else None
        if isinstance(rng, ShardedObject) and rng.key.endswith(PER_RANK_KEY) and rng.data:
            logger.debug(  # per save and rank: state_digest.json records them (resume proof)
                "rng_state: rank %d saves %s",
                torch.distributed.get_rank(),
                _fmt(stream_checksums(rng.data[0])),
            )
        return sd

    return generate_state_dict


# --- the probe ----------------------------------------------------------------------------------


def upstream_saves_every_ep_rank(fn: Callable | None = None) -> bool | None:
    """Whether upstream's ``get_rng_state("torch_dist", ...)`` (or ``fn``) makes every expert-
    parallel rank's RNG states part of a ``torch_dist`` checkpoint.

    Calls it as each of two ranks of a stand-in job (:func:`~megatron.fixes.standins.
    parallel_state`: TP 1, PP 1, DP 2, EP 2: rank ``r`` is data-parallel and expert-parallel rank
    ``r``, both with (PP, TP) (0, 0); no process group, no device; groups passed as ``save``
    passes them), and compares the two ``ShardedObject`` s: a checkpoint keeps one object per
    unique key, written by its main replica (``replica_id`` 0).

    Returns:
        True if both are main replicas under distinct keys (each rank writes, and reads back, its
        own); False if rank 1's is a replica of rank 0's key (the defect of Megatron-LM PR 6858:
        only rank 0 writes, both restore its states, rank 1 resumes on rank 0's expert stream);
        None if upstream does not return a ``ShardedObject`` for ``torch_dist``.

    Raises:
        Whatever upstream's function raises on the stand-ins (the caller cannot tell).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, is_main_replica
    from megatron.training import checkpointing as ckpt

    fn = fn or upstream_own(ckpt.get_rng_state)
    one = group(0, 1)
    objects = []
    for rank in (0, 1):
        mpu = parallel_state(dp=(rank, 2), ep=(rank, 2))
        dp = group(rank, 2)
        with get_rng_state_stand_ins(mpu):
            objects.append(fn("torch_dist", one, one, dp_cp_group=dp, dp_group=dp))
    if not all(isinstance(o, ShardedObject) for o in objects):
        return None
    written = [o for o in objects if is_main_replica(o.replica_id)]
    return len(written) == 2 and written[0].unique_key != written[1].unique_key


class RngStateEpFix(Fix):
    name = "rng_state_ep"
    title = (
        "per-rank RNG states in torch_dist checkpoints (expert-parallel streams restored per rank)"
    )
    upstream_refs = ("Megatron-LM PR 6858 (get_rng_state keys rng_state by (PP, TP) only)",)
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.training.checkpointing.get_rng_state",
            wrap_get_rng_state,
            "EP ranks sharing (PP, TP) share one RNG key: only one writes it and all "
            "restore it; the replacement saves one ShardedObject per rank",
            params=("ckpt_format", "tp_group", "pp_group", "dp_cp_group", "dp_group", "key_prefix"),
        ),
        Patch(
            "megatron.core.dist_checkpointing.load",
            wrap_load,
            "checkpoints of the old (PP, TP) RNG layout must still load, and EP/ETP "
            "changes need an explicit rule for the expert streams",
            params=("sharded_state_dict", "checkpoint_dir"),
        ),
        Patch(
            "megatron.training.checkpointing.generate_state_dict",
            wrap_generate_state_dict,
            "logs a checksum of each RNG stream this rank saves, so per-rank save and "
            "restore can be compared in logs",
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """:func:`upstream_saves_every_ep_rank` on upstream's own ``get_rng_state``."""
        return upstream_saves_every_ep_rank()


def _dp_cp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(with_context_parallel=True)


def _checkpoint_object_keys(checkpoint_dir: Any) -> set[str] | None:
    """Unique keys of the ShardedObjects in a ``torch_dist`` checkpoint (its ``.metadata``), or
    ``None`` when the directory has no such metadata (another format: left to upstream)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron.integrity.dcp_metadata import DcpMetadataError, read_dcp_metadata

    try:
        meta = read_dcp_metadata(checkpoint_dir)
    except DcpMetadataError:  # not a torch_dist checkpoint: upstream decides
        return None
    return {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}


FIX = RngStateEpFix()
