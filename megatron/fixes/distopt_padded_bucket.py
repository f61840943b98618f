"""Fix: a distributed-optimizer save (``dp_reshardable``, the default ``torch_dist`` format)
fails when a grad bucket's unpadded size ends inside alignment padding (Megatron-LM PR 5898, open;
megatron-core 0.19.2 and main).

A bucket closed before the shared embedding (pipeline parallelism with tied embeddings) records as
its unpadded size the embedding's 64-aligned start, not the end of its last parameter.
``DistributedOptimizer.sharded_param_state_dp_reshardable`` covers the gap after the last
parameter with a padding ``ShardedTensor`` that runs to the end of the rank's DP shard, past the
unpadded size that is the tensor's global shape: DCP refuses the plan ("out of bounds chunk") and
the save dies, leaving a partial ``iter_*``. The fix cuts each padding entry at the global shape;
padding is never loaded (upstream skips it), so nothing else changes.

Design notes: ``docs/fixes/distopt_padded_bucket.md``.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

from megatron.fixes.standins import group, upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

#: The stand-in's shared embedding (elements; its weight has ``weight`` elements, default 8).
_EMBEDDING_NUMEL = 100


def _is_padding(entry: dict) -> bool:
    """True for a bucket entry upstream inserted as padding (``'padding'`` is ``True``, wrapped in
    a ``LocalNonpersistentObject`` after upstream's conversion)."""
    flag = entry.get("padding", False)
    return bool(getattr(flag, "obj", flag))


def clip_to_global_shape(sh_ten: Any) -> Any:
    """``sh_ten`` (a 1-D ``ShardedTensor`` of padding) cut so that it ends at its global shape:
    its data narrowed to the first ``global_shape[0] - global_offset[0]`` elements (a view) and
    ``local_shape`` to match; returned unchanged when it already fits (or is not 1-D)."""
    if len(sh_ten.global_shape) != 1 or sh_ten.prepend_axis_num:
        return sh_ten
    room = sh_ten.global_shape[0] - sh_ten.global_offset[0]
    if sh_ten.local_shape[0] <= room:
        return sh_ten
    data = None if sh_ten.data is None else sh_ten.data[:room]
    return replace(sh_ten, data=data, local_shape=(room,))


def _bucket_entries(state: dict) -> Iterator[dict]:
    """Every entry (one parameter's or one padding's tensors) of every bucket of ``state`` (the
    dict ``sharded_param_state_dp_reshardable`` returns: ``state[gbuf_idx][dtype]`` is a list of
    buckets, each a list of entries)."""
    for gbuf_idx, by_dtype in state.items():
        if not isinstance(gbuf_idx, int):
            continue  # per_bucket_numel, per_bucket_numel_unpadded
        for buckets in by_dtype.values():
            for bucket in buckets:
                yield from bucket


def clip_padding(state: dict) -> dict:
    """``sharded_param_state_dp_reshardable``'s ``state`` with every padding entry's
    ``ShardedTensor`` s cut at their global shape (:func:`clip_to_global_shape`), in place;
    parameter entries are left as they are (one past its bucket would be a real defect for DCP
    to refuse). Returns ``state``."""
    from megatron.core.dist_checkpointing import ShardedTensor

    for entry in _bucket_entries(state):
        if _is_padding(entry):
            for key, value in entry.items():
                if isinstance(value, ShardedTensor):
                    entry[key] = clip_to_global_shape(value)
    return state


# --- the probe ----------------------------------------------------------------------------------


def padded_bucket_stand_in(weight: int = 8, dp_rank: int = 0, dp_size: int = 1) -> SimpleNamespace:
    """One data-parallel rank of a stand-in distributed optimizer (no process group) over a model
    of two fp32 parameters, a shared embedding (100 elements) then a weight (``weight`` elements),
    laid out by upstream's own ``_compute_per_buffer_param_layout`` and ranged by its
    ``_build_gbuf_range_map``. Iterated backwards (upstream's bucket order) the weight fills bucket
    0 from 0; the shared embedding starts a bucket of its own at the next 64-aligned offset, which
    bucket 0 records as its unpadded size. Default (``weight`` 8, DP 1): bucket 0 has 64 unpadded
    elements (8 of them the weight's, 56 alignment) in a 128-element grad buffer.
    Its ``get_parameter_state_dp_reshardable`` is upstream's; ``shard_states`` (parameter ->
    ``param``, ``exp_avg``, ``exp_avg_sq``) holds each parameter's shard in bucket order, filled
    from ``1000 * (i + 1) + 100 * k`` onwards (the weight: 1000, 1100, 1200).

    Returns the stand-in (the ``self`` of upstream's ``sharded_param_state_dp_reshardable``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    params = []
    for numel, shared in ((_EMBEDDING_NUMEL, True), (weight, False)):
        p = torch.nn.Parameter(torch.zeros(numel))
        p.shared_embedding = shared
        params.append(p)
    ddp_config = SimpleNamespace(pad_buckets_for_high_nccl_busbw=False)
    layout = D._compute_per_buffer_param_layout(params, None, dp_size, ddp_config)
    buckets = [
        SimpleNamespace(grad_data=torch.zeros(end - start), offset=start, numel_unpadded=unpadded)
        for (start, end), unpadded in zip(layout.bucket_indices, layout.per_bucket_numel_unpadded)
    ]
    buffer = SimpleNamespace(
        data_parallel_group=group(dp_rank, dp_size),
        num_optimizer_shards=dp_size,
        param_index_map=layout.param_index_map,
        buckets=buckets,
        param_dtype=torch.float32,
        grad_dtype=torch.float32,
    )
    gbuf_ranges = [D._build_gbuf_range_map(buffer)]
    shard_sizes = {  # param -> the size of its shard on this rank
        p: r["param"].size
        for buckets_of_dtype in gbuf_ranges[0].values()
        for bucket in buckets_of_dtype
        for p, r in bucket["param_map"].items()
    }
    states = {
        p: {
            key: torch.arange(n, dtype=torch.float32) + 1000.0 * (i + 1) + 100 * k
            for k, key in enumerate(("param", "exp_avg", "exp_avg_sq"))
        }
        for i, (p, n) in enumerate(shard_sizes.items())
    }

    opt = SimpleNamespace(
        data_parallel_group=group(dp_rank, dp_size),
        data_parallel_group_idx=0,
        distributed_optimizer_instance_id=0,
        gbuf_ranges=gbuf_ranges,
        buffers=[buffer],
        per_bucket_numel=[[b.grad_data.numel() for b in buckets]],
        per_bucket_numel_unpadded=[list(layout.per_bucket_numel_unpadded)],
        shard_states=states,
        _get_main_param_and_optimizer_states=lambda p: dict(states[p]),
    )
    opt.get_parameter_state_dp_reshardable = lambda: D.get_parameter_state_dp_reshardable(opt)
    return opt


def sharded_tensors(state: dict) -> dict[str, list]:
    """The ``ShardedTensor`` s of a ``sharded_param_state_dp_reshardable`` result, by key."""
    from megatron.core.dist_checkpointing import ShardedTensor

    out: dict[str, list] = {}
    for entry in _bucket_entries(state):
        for value in entry.values():
            if isinstance(value, ShardedTensor):
                out.setdefault(value.key, []).append(value)
    return out


def chunk_problems(by_key: dict[str, list]) -> list[str]:
    """What DCP's global-plan validation would refuse in these ``ShardedTensor`` s (every rank's,
    by key): a chunk past its global shape, or chunks whose volume differs from the tensor's.
    Empty when the save plan is valid."""
    problems = []
    for key, tensors in sorted(by_key.items()):
        (size,) = {tuple(t.global_shape) for t in tensors}
        for t in tensors:
            if any(o + n > s for o, n, s in zip(t.global_offset, t.local_shape, size)):
                problems.append(f"{key}: chunk at {t.global_offset} of {t.local_shape} past {size}")
        volume = sum(t.data.numel() for t in tensors)
        if volume != torch.Size(size).numel():
            problems.append(f"{key}: chunks cover {volume} of {torch.Size(size).numel()} elements")
    return problems


def upstream_reshardable() -> Callable:
    """Upstream's own ``sharded_param_state_dp_reshardable`` (under any fix's wrapper)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return upstream_own(DistributedOptimizer.sharded_param_state_dp_reshardable)


def upstream_plans_padded_bucket(fn: Callable | None = None) -> bool:
    """True if upstream's ``sharded_param_state_dp_reshardable`` (or ``fn``), on
    :func:`padded_bucket_stand_in`, describes every bucket with chunks DCP accepts; False when a
    chunk runs past its tensor (the defect), and on anything unexpected."""
    fn = fn or upstream_reshardable()
    try:
        state = fn(padded_bucket_stand_in(), {}, is_loading=False)
        return not chunk_problems(sharded_tensors(state))
    except Exception:  # noqa: BLE001 - a probe that cannot tell keeps the fix active
        return False


def wrap_sharded_param_state_dp_reshardable(upstream: Callable) -> Callable:
    """Factory of the replacement of ``DistributedOptimizer.sharded_param_state_dp_reshardable``:
    upstream's, each padding entry then cut at its tensor's global shape (:func:`clip_padding`)."""

    @wraps_upstream(upstream)
    def sharded_param_state_dp_reshardable(
        self, model_sharded_state_dict, is_loading=False, metadata=None
    ):
        """Upstream's bucket-space optimizer state, its padding chunks inside their tensors."""
        return clip_padding(upstream(self, model_sharded_state_dict, is_loading, metadata))

    return sharded_param_state_dp_reshardable


class DistOptPaddedBucketFix(Fix):
    name = "distopt_padded_bucket"
    title = (
        "distributed-optimizer (dp_reshardable) saves of a bucket whose unpadded size ends in "
        "alignment padding (PP with a shared embedding) describe chunks inside the tensor"
    )
    upstream_refs = (
        "Megatron-LM PR 5898 (DistributedOptimizer.sharded_param_state_dp_reshardable: exclude "
        "bucket-end padding from optimizer checkpoints; open)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
            ".sharded_param_state_dp_reshardable",
            wrap_sharded_param_state_dp_reshardable,
            "the padding after a bucket's last parameter ran to the end of the DP shard, past "
            "the unpadded bucket size that is its tensor's global shape (DCP: 'out of bounds "
            "chunk'); each padding chunk is now cut at the global shape",
            params=("model_sharded_state_dict", "is_loading", "metadata"),
        ),
    )

    def upstream_behaves(self) -> bool:
        return upstream_plans_padded_bucket()


FIX = DistOptPaddedBucketFix()
