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
import inspect
import logging
from typing import Any

from megatron.overlay import Fix, Patcher
from megatron.overlay.registry import wraps_upstream

logger = logging.getLogger("megatron.fixes")

PER_RANK_KEY = "rng_state_per_rank"
_EXPERT_PREFIX = (
    "expert"  # tracker names of per-expert-rank streams: expert-parallel-rng, expert-...
)


def state_digest(state: Any) -> str:
    """Short SHA-256 of one RNG state (a ``torch.ByteTensor``, or anything ``repr``-able), for
    comparing states in logs: 12 hex characters."""
    import torch

    if isinstance(state, torch.Tensor):
        data = state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    else:
        data = repr(state).encode()
    return hashlib.sha256(data).hexdigest()[:12]


def stream_digests(rng_state: dict) -> dict[str, str]:
    """Digest of every stream of one rank's RNG state dict (as ``get_rng_state`` builds it):
    ``torch`` (CPU), ``cuda`` and each tracker stream by name."""
    out = {
        "torch": state_digest(rng_state["torch_rng_state"]),
        "cuda": state_digest(rng_state["cuda_rng_state"]),
    }
    for name, st in sorted(rng_state.get("rng_tracker_states", {}).items()):
        out[name] = state_digest(st)
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


class RngStateEpFix(Fix):
    name = "rng_state_ep"
    title = (
        "per-rank RNG states in torch_dist checkpoints (expert-parallel streams restored per rank)"
    )
    upstream_refs = ("Megatron-LM PR 6858 (get_rng_state keys rng_state by (PP, TP) only)",)
    package = "megatron-core"

    def upstream_behaves(self) -> bool:
        from megatron.training import checkpointing

        src = inspect.getsource(checkpointing.get_rng_state)
        # Upstream's fix adds the expert axes to the key (the (PP, TP)-only key is the defect).
        return "(pp_size, tp_size)," not in src

    def install(self, patcher: Patcher) -> None:
        import torch
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.training import checkpointing

        upstream_get = checkpointing.get_rng_state

        @wraps_upstream(upstream_get)
        def get_rng_state(
            ckpt_format, tp_group, pp_group, dp_cp_group=None, dp_group=None, key_prefix=""
        ):
            """Upstream's RNG states, as one ShardedObject per rank."""
            out = upstream_get(
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

        patcher.replace(
            checkpointing,
            "get_rng_state",
            get_rng_state,
            "EP ranks sharing (PP, TP) share one RNG key: only one writes it and all "
            "restore it; the replacement saves one ShardedObject per rank",
        )

        upstream_load = dist_checkpointing.load

        @wraps_upstream(upstream_load)
        def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
            """Upstream's load; reads this rank's RNG entry, or the old layout."""
            entry = (
                sharded_state_dict.get("rng_state")
                if isinstance(sharded_state_dict, dict)
                else None
            )
            old = getattr(entry, "megatron_fixes_old_layout", None)
            if old is None:
                return upstream_load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            current = entry.data  # this run's states, as seeded (template of the load)
            keys = _checkpoint_object_keys(checkpoint_dir)
            rank = torch.distributed.get_rank()
            if keys is not None and entry.unique_key not in keys:
                if any(k.startswith(f"{entry.key}/") for k in keys):
                    mode = "other_world"
                    sharded_state_dict.pop("rng_state")
                else:
                    mode = "old_layout"
                    sharded_state_dict["rng_state"] = old
            else:
                mode = "per_rank"
            result = upstream_load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
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
            loaded = loaded_sd["rng_state"]
            topo = current[0]["rng_topology"]
            restored = []
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
                restored.append(got)
            loaded_sd["rng_state"] = restored
            logger.warning(
                "rng_state: rank %d loads %s; restored %s",
                rank,
                how,
                _fmt(stream_digests(restored[0])),
            )
            return result

        patcher.replace(
            dist_checkpointing,
            "load",
            load,
            "checkpoints of the old (PP, TP) RNG layout must still load, and EP/ETP "
            "changes need an explicit rule for the expert streams",
        )

        upstream_gen = checkpointing.generate_state_dict

        @wraps_upstream(upstream_gen)
        def generate_state_dict(*args, **kwargs):
            """Upstream's; logs a digest of each RNG stream saved."""
            sd = upstream_gen(*args, **kwargs)
            rng = sd.get("rng_state") if isinstance(sd, dict) else None
            if isinstance(rng, ShardedObject) and rng.key.endswith(PER_RANK_KEY) and rng.data:
                logger.debug(  # per save and rank: state_digest.json records them (resume proof)
                    "rng_state: rank %d saves %s",
                    torch.distributed.get_rank(),
                    _fmt(stream_digests(rng.data[0])),
                )
            return sd

        patcher.replace(
            checkpointing,
            "generate_state_dict",
            generate_state_dict,
            "logs a digest of each RNG stream this rank saves, so per-rank save and "
            "restore can be compared in logs",
        )


def _dp_cp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(with_context_parallel=True)


def _checkpoint_object_keys(checkpoint_dir: Any) -> set[str] | None:
    """Unique keys of the ShardedObjects in a ``torch_dist`` checkpoint (its ``.metadata``), or
    ``None`` when the directory has no such metadata (another format: left to upstream)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        meta = FileSystemReader(str(checkpoint_dir)).read_metadata()
    except Exception:  # noqa: BLE001 - not a torch_dist checkpoint: upstream decides
        return None
    return {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}


FIX = RngStateEpFix()
