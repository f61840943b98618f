"""Fix ``fsdp_rng``: every (PP, TP) rank restores its own RNG states from an ``fsdp_dtensor``
checkpoint.

megatron-core 0.19.2 keys the RNG states of an ``fsdp_dtensor`` checkpoint by
``"(pp_rank, tp_rank)"`` (``get_rng_state``), and the save writes every rank's key. But the load
builds its template with ``get_rng_state(args.ckpt_format, tp_group, pp_group)`` where
``load_checkpoint``'s ``tp_group``/``pp_group`` default to None (its ``torch_dist`` branch resolves
them to the model-parallel groups, the ``fsdp_dtensor`` branch does not), and
``get_pg_rank(None)`` is 0: every rank asks for key ``"(0, 0)"``, loads rank (0, 0)'s states, then
misses its own key and falls back to the first entry with a warning printed by rank 0 only. Every
rank with ``tp_rank > 0`` or ``pp_rank > 0`` resumes on rank 0's streams (dropout masks). Found by
the resume proof (``[resume-proof] ... RNG state of rank(s) 1 (torch); 3 (torch)`` after a TP 2
``fsdp_dtensor`` resume). The fix resolves missing groups to the model-parallel groups, as the
``torch_dist`` branch does.

Design notes: ``docs/fixes/fsdp_rng.md``.
"""

from __future__ import annotations

from typing import Callable

from megatron.fixes.standins import (
    get_rng_state_stand_ins,
    group,
    parallel_state,
    upstream_own,
)
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream


def upstream_keys_by_rank_without_groups(fn: Callable | None = None) -> bool:
    """True if upstream's ``get_rng_state("fsdp_dtensor", None, None)`` (or ``fn``) keys the states
    by this rank's (PP, TP) coordinates, as ``load_checkpoint``'s ``fsdp_dtensor`` branch calls
    it; False when it keys them ``"(0, 0)"`` (the defect).

    Shown on a stand-in rank with TP rank 1 of 2 (:func:`~megatron.fixes.standins.parallel_state`:
    no process group, no device; :func:`~megatron.fixes.standins.get_rng_state_stand_ins`), so
    it works on CPU before any backend starts; everything is put back afterwards.

    Raises:
        Whatever upstream's function raises on the stand-ins (the caller cannot tell).
    """
    from megatron.training import checkpointing as ckpt

    fn = fn or upstream_own(ckpt.get_rng_state)
    one = group(0, 1)
    with get_rng_state_stand_ins(parallel_state(tp=(1, 2))):
        out = fn("fsdp_dtensor", None, None, dp_cp_group=one, dp_group=one)
    return isinstance(out, dict) and list(out) == ["(0, 1)"]


def wrap_get_rng_state(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.checkpointing.get_rng_state``: upstream's,
    with ``fsdp_dtensor`` calls that pass no groups given the model-parallel groups (as the
    ``torch_dist`` branch of ``load_checkpoint`` resolves them)."""
    from megatron.core import parallel_state as mpu

    @wraps_upstream(upstream)
    def get_rng_state(ckpt_format, tp_group=None, pp_group=None, *args, **kwargs):
        """Upstream's; missing groups are the model-parallel groups (fsdp_dtensor)."""
        if (
            ckpt_format == "fsdp_dtensor"
            and tp_group is None
            and pp_group is None
            and mpu.model_parallel_is_initialized()
        ):
            tp_group = mpu.get_tensor_model_parallel_group()
            pp_group = mpu.get_pipeline_model_parallel_group()
        return upstream(ckpt_format, tp_group, pp_group, *args, **kwargs)

    return get_rng_state


class FsdpRngFix(Fix):
    name = "fsdp_rng"
    title = "fsdp_dtensor loads give every (PP, TP) rank its own RNG states, not rank (0, 0)'s"
    upstream_refs = (
        "megatron-core 0.19.2 checkpointing.load_checkpoint (fsdp_dtensor branch): "
        "get_rng_state(args.ckpt_format, tp_group=None, pp_group=None) keys the template '(0, 0)' "
        "on every rank",
    )
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.training.checkpointing.get_rng_state",
            wrap_get_rng_state,
            "fsdp_dtensor loads call it without groups: every rank keyed '(0, 0)' and restored "
            "rank (0, 0)'s RNG states; the replacement resolves the model-parallel groups",
            params=("ckpt_format", "tp_group", "pp_group"),
        ),
    )

    def upstream_behaves(self) -> bool:
        """:func:`upstream_keys_by_rank_without_groups` on upstream's own ``get_rng_state``."""
        return upstream_keys_by_rank_without_groups()


FIX = FsdpRngFix()
