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

from types import SimpleNamespace

from megatron.overlay import Fix, Patcher
from megatron.overlay.registry import wraps_upstream


def upstream_keys_by_rank_without_groups() -> bool:
    """True if upstream's ``get_rng_state("fsdp_dtensor", None, None)`` keys the states by this
    rank's (PP, TP) coordinates, shown on a stand-in parallel state with TP rank 1 (no process
    group). False when it keys them ``"(0, 0)"`` (the defect) or when it cannot tell (it needs a
    device RNG this machine does not have yet): the fix stays active, which is harmless where
    upstream behaves (it passes the groups upstream would resolve itself)."""
    from megatron.training import checkpointing as ckpt

    fn = ckpt.get_rng_state
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    one = SimpleNamespace(rank=lambda: 0, size=lambda: 1)
    stand_in = SimpleNamespace(
        get_tensor_model_parallel_rank=lambda: 1,
        get_pipeline_model_parallel_rank=lambda: 0,
        get_tensor_model_parallel_group=lambda: SimpleNamespace(rank=lambda: 1, size=lambda: 2),
        get_pipeline_model_parallel_group=lambda: one,
        get_data_parallel_world_size=lambda: 1,
        get_data_parallel_rank=lambda with_context_parallel=False: 0,
    )
    saved = ckpt.get_args, ckpt.mpu
    ckpt.get_args = lambda: SimpleNamespace(data_parallel_random_init=False)
    ckpt.mpu = stand_in
    try:
        out = fn("fsdp_dtensor", None, None, dp_cp_group=one, dp_group=one)
    except Exception:  # noqa: BLE001 - no device RNG (CPU before the backend starts): cannot tell
        return False
    finally:
        ckpt.get_args, ckpt.mpu = saved
    return isinstance(out, dict) and list(out) == ["(0, 1)"]


class FsdpRngFix(Fix):
    name = "fsdp_rng"
    title = "fsdp_dtensor loads give every (PP, TP) rank its own RNG states, not rank (0, 0)'s"
    upstream_refs = (
        "megatron-core 0.19.2 checkpointing.load_checkpoint (fsdp_dtensor branch): "
        "get_rng_state(args.ckpt_format, tp_group=None, pp_group=None) keys the template '(0, 0)' "
        "on every rank",
    )
    package = "megatron-core"

    def upstream_behaves(self) -> bool:
        return upstream_keys_by_rank_without_groups()

    def install(self, patcher: Patcher) -> None:
        from megatron.core import parallel_state as mpu
        from megatron.training import checkpointing

        upstream_get = checkpointing.get_rng_state

        @wraps_upstream(upstream_get)
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
            return upstream_get(ckpt_format, tp_group, pp_group, *args, **kwargs)

        patcher.replace(
            checkpointing,
            "get_rng_state",
            get_rng_state,
            "fsdp_dtensor loads call it without groups: every rank keyed '(0, 0)' and restored "
            "rank (0, 0)'s RNG states; the replacement resolves the model-parallel groups",
        )


FIX = FsdpRngFix()
