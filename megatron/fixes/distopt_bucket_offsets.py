"""Fix: fully-reshardable distributed-optimizer saves read every parameter after the first grad
bucket at a shifted offset (Megatron-LM PR 5077, not in megatron-core 0.19.2).

``DistributedOptimizer.sharded_param_state_fully_reshardable`` slices the world tensors that
``get_parameter_state_dp_zero`` gathers (each bucket's end padding stripped) with the offsets of
``buffer.param_index_map`` (padding counted). With more than one bucket (``--overlap-grad-reduce``)
the main parameters and Adam moments of every parameter past bucket 0 are saved from the wrong
place, the overrun zero-filled with only a warning; a resume diverges at its first step. The fix
re-inserts the padding (zeros) into the world tensors that save reads, so upstream's offsets hold.

Design notes: ``docs/fixes/distopt_bucket_offsets.md``.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

from megatron.fixes.standins import upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

#: The optimizer-state keys of the stand-in (torch Adam's, besides ``param``).
_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def bucket_segments(buckets) -> list[tuple[int, int, int]]:
    """``(compact_start, padded_start, numel_unpadded)`` of each bucket of one grad buffer.

    ``compact_start`` is where ``get_parameter_state_dp_zero`` puts the bucket in its world
    tensors (earlier buckets' padding stripped), ``padded_start`` where ``param_index_map`` counts
    it from (the bucket's offset in the buffer: earlier buckets' ``grad_data`` sizes, padding
    included).
    """
    segments, compact, padded = [], 0, 0
    for bucket in buckets:
        segments.append((compact, padded, bucket.numel_unpadded))
        compact += bucket.numel_unpadded
        padded += bucket.grad_data.numel()
    return segments


def pad_world_tensors(world_tensors: dict, buckets) -> dict:
    """One buffer's world tensors (``get_parameter_state_dp_zero``'s layout: the buckets back to
    back, their end padding stripped) laid out as the buffer is: each bucket at its offset, zeros
    in its end padding, so that ``param_index_map`` offsets index them. ``numel_unpadded`` becomes
    the new length (upstream's invariant: the length of every world tensor).

    Raises:
        RuntimeError: a tensor's length is not the sum of the buckets' unpadded sizes (not the
            layout this fix knows: re-padding it would misplace values).
    """
    if not world_tensors:  # a rank that receives nothing
        return world_tensors
    segments = bucket_segments(buckets)
    compact = sum(n for _, _, n in segments)
    padded = sum(b.grad_data.numel() for b in buckets)
    out = {}
    for key, value in world_tensors.items():
        if key == "numel_unpadded" or not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        if value.dim() != 1 or value.numel() != compact:
            raise RuntimeError(
                f"distopt_bucket_offsets: world tensor {key!r} has shape {tuple(value.shape)}, "
                f"expected ({compact},) (the buckets' unpadded sizes {[n for *_, n in segments]} "
                "back to back); upstream's layout changed, the fix does not know it"
            )
        full = value.new_zeros(padded)
        for compact_start, padded_start, n in segments:
            full[padded_start : padded_start + n].copy_(value[compact_start : compact_start + n])
        out[key] = full
    if "numel_unpadded" in world_tensors:
        out["numel_unpadded"] = padded
    return out


def pad_dp_zero_state(optimizer: Any, state: dict | None) -> dict | None:
    """``get_parameter_state_dp_zero``'s result with every buffer's world tensors re-padded
    (:func:`pad_world_tensors`); ``None`` (a rank that receives nothing) stays ``None``."""
    if state is None:
        return None
    out = dict(state)
    for gbuf_idx, buffer in enumerate(optimizer.buffers):
        if gbuf_idx in state:
            out[gbuf_idx] = {
                dtype: pad_world_tensors(world, buffer.buckets)
                for dtype, world in state[gbuf_idx].items()
            }
    return out


@contextlib.contextmanager
def bucket_padded_gather(optimizer: Any) -> Iterator[None]:
    """While open, ``optimizer.get_parameter_state_dp_zero(...)`` returns its world tensors with
    the bucket padding re-inserted (:func:`pad_dp_zero_state`): an attribute of this one
    instance, shadowing the class's method, removed on exit (an instance attribute it shadowed is
    put back)."""
    name = "get_parameter_state_dp_zero"
    had, own = name in vars(optimizer), vars(optimizer).get(name)
    gather = getattr(optimizer, name)

    def get_parameter_state_dp_zero(*args, **kwargs):
        return pad_dp_zero_state(optimizer, gather(*args, **kwargs))

    setattr(optimizer, name, get_parameter_state_dp_zero)
    try:
        yield
    finally:
        if had:
            setattr(optimizer, name, own)
        else:
            delattr(optimizer, name)


# --- the probe ----------------------------------------------------------------------------------


#: The stand-in's world tensors: the first value of each (then +1 per element).
_STAND_IN_FIRST = {"param": 1.0, "exp_avg": 101.0, "exp_avg_sq": 1001.0}
#: Where each stand-in parameter's values start in the (compact) world tensors.
_STAND_IN_COMPACT_START = {"p0": 0, "p1": 4, "p2": 8}


def bucketed_stand_in() -> SimpleNamespace:
    """A stand-in distributed optimizer with one fp32 grad buffer of 2 buckets (DP 1, no process
    group), for upstream's ``sharded_param_state_fully_reshardable``.

    Bucket 0 holds ``p0`` (4 elements; ``grad_data`` 8: 4 of end padding), bucket 1 ``p1`` (4)
    and ``p2`` (2x2; ``grad_data`` 12: 4 of padding). ``param_index_map``: p0 [0, 4), p1 [8, 12),
    p2 [12, 16). The world tensors ``get_parameter_state_dp_zero`` returns are compact (12
    elements): ``param`` 1..12, ``exp_avg`` 101..112, ``exp_avg_sq`` 1001..1012.

    Returns:
        ``optimizer`` (the stand-in), ``model_sharded_state_dict`` (a ``ShardedTensor`` per
        parameter, keys ``p0``..``p2``), ``params`` (name -> parameter), ``expected`` (the right
        save: ``optimizer.state.<key>.<name>`` -> tensor of the parameter's shape), ``calls`` (the
        keyword arguments of every ``get_parameter_state_dp_zero`` call).
    """
    from megatron.core.dist_checkpointing import ShardedTensor

    params = {
        "p0": torch.nn.Parameter(torch.zeros(4)),
        "p1": torch.nn.Parameter(torch.zeros(4)),
        "p2": torch.nn.Parameter(torch.zeros(2, 2)),
    }
    calls: list[dict] = []
    model_sharded_state_dict = {
        name: ShardedTensor.from_rank_offsets(name, p) for name, p in params.items()
    }
    expected = {
        f"optimizer.state.{key}.{name}": (
            torch.arange(4, dtype=torch.float32) + first + _STAND_IN_COMPACT_START[name]
        ).reshape(p.shape)
        for key, first in _STAND_IN_FIRST.items()
        for name, p in params.items()
    }
    return SimpleNamespace(
        optimizer=_stand_in_optimizer(params, calls),
        model_sharded_state_dict=model_sharded_state_dict,
        params=params,
        expected=expected,
        calls=calls,
    )


def _stand_in_gather(calls: list[dict]) -> Callable:
    """The stand-in's ``get_parameter_state_dp_zero``: records its keyword arguments in
    ``calls``, returns compact world tensors of 12 fp32 elements (:data:`_STAND_IN_FIRST`
    onwards; zeros for ``empty_data``) of the one buffer."""

    def get_parameter_state_dp_zero(
        use_gloo_comm=True, empty_data=False, return_on_all_ranks=False
    ):
        calls.append(
            dict(
                use_gloo_comm=use_gloo_comm,
                empty_data=empty_data,
                return_on_all_ranks=return_on_all_ranks,
            )
        )
        world: dict[str, Any] = {
            key: torch.zeros(12) if empty_data else torch.arange(12, dtype=torch.float32) + first
            for key, first in _STAND_IN_FIRST.items()
        }
        world["numel_unpadded"] = 12
        return {"buckets_coalesced": True, 0: {torch.float32: world}}

    return get_parameter_state_dp_zero


def _stand_in_optimizer(params: dict, calls: list[dict]) -> SimpleNamespace:
    """The stand-in distributed optimizer over ``params`` (``p0``..``p2``): one fp32 grad buffer
    of 2 buckets with end padding (see :func:`bucketed_stand_in`), each parameter's whole range
    on this rank, the gather of :func:`_stand_in_gather`, no inner optimizer."""
    from megatron.core.optimizer.distrib_optimizer import Range

    buffer = SimpleNamespace(
        param_index_map={
            params["p0"]: (0, 4, 0),
            params["p1"]: (8, 12, 1),
            params["p2"]: (12, 16, 1),
        },
        buckets=[
            SimpleNamespace(grad_data=torch.zeros(8), numel_unpadded=4),
            SimpleNamespace(grad_data=torch.zeros(12), numel_unpadded=8),
        ],
        numel_unpadded=12,
    )
    return SimpleNamespace(
        gbuf_ranges=[
            {
                torch.float32: [
                    {"param_map": {params["p0"]: {"param": Range(0, 4)}}},
                    {
                        "param_map": {
                            params["p1"]: {"param": Range(0, 4)},
                            params["p2"]: {"param": Range(0, 4)},
                        }
                    },
                ]
            }
        ],
        buffers=[buffer],
        get_parameter_state_dp_zero=_stand_in_gather(calls),
        optimizer=None,
    )


def saved_tensors(model_space_state: dict) -> dict[str, torch.Tensor]:
    """``sharded_param_state_fully_reshardable``'s result as ``ShardedTensor`` key -> data."""
    return {sh.key: sh.data for tensors in model_space_state.values() for sh in tensors.values()}


def upstream_fully_reshardable():
    """Upstream's own ``sharded_param_state_fully_reshardable`` (under any fix's wrapper)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return upstream_own(DistributedOptimizer.sharded_param_state_fully_reshardable)


def upstream_saves_every_bucket_right(fn=None) -> bool:
    """True if upstream's ``sharded_param_state_fully_reshardable`` (or ``fn``), run on
    :func:`bucketed_stand_in` for a save, gives every parameter (those of bucket 1 included) its
    own values; False when it reads them shifted, and on anything unexpected (an exception)."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    fn = fn or upstream_fully_reshardable()
    case = bucketed_stand_in()
    upstream_log = logging.getLogger(dopt.__name__)
    was_disabled = upstream_log.disabled
    upstream_log.disabled = True  # its "param range exceeds unpadded buffer" warning, expected here
    try:
        saved = saved_tensors(
            fn(case.optimizer, case.model_sharded_state_dict, is_loading=False, metadata={})
        )
        return sorted(saved) == sorted(case.expected) and all(
            torch.equal(saved[k], v) for k, v in case.expected.items()
        )
    except Exception:  # noqa: BLE001 - a probe that cannot tell keeps the fix active
        return False
    finally:
        upstream_log.disabled = was_disabled


def wrap_sharded_param_state_fully_reshardable(upstream: Callable) -> Callable:
    """Factory of the replacement of
    ``DistributedOptimizer.sharded_param_state_fully_reshardable``: upstream's; for a save, run
    with the instance's ``get_parameter_state_dp_zero`` re-padded (:func:`bucket_padded_gather`)."""

    @wraps_upstream(upstream)
    def sharded_param_state_fully_reshardable(
        self, model_sharded_state_dict, is_loading=False, metadata=None
    ):
        """Upstream's; for a save, the world tensors it slices carry the bucket padding that
        its ``param_index_map`` offsets count (:func:`bucket_padded_gather`)."""
        if is_loading:  # templates only (empty data): upstream's, unchanged
            return upstream(self, model_sharded_state_dict, is_loading, metadata)
        with bucket_padded_gather(self):
            return upstream(self, model_sharded_state_dict, is_loading, metadata)

    return sharded_param_state_fully_reshardable


class DistOptBucketOffsetsFix(Fix):
    name = "distopt_bucket_offsets"
    title = (
        "fully-reshardable distributed-optimizer saves with several grad buckets "
        "(--overlap-grad-reduce) store every parameter's state from its own offset"
    )
    upstream_refs = (
        "Megatron-LM PR 5077 (DistributedOptimizer.sharded_param_state_fully_reshardable: "
        "adjust param ranges for the bucket-end padding stripped from the world tensors)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
            ".sharded_param_state_fully_reshardable",
            wrap_sharded_param_state_fully_reshardable,
            "with several grad buckets the save sliced the gathered world tensors (bucket "
            "padding stripped) at param_index_map offsets (padding counted): every parameter "
            "after bucket 0 saved shifted; during a save the instance's "
            "get_parameter_state_dp_zero now returns them with the padding re-inserted",
            params=("model_sharded_state_dict", "is_loading", "metadata"),
        ),
    )

    def upstream_behaves(self) -> bool:
        return upstream_saves_every_bucket_right()


FIX = DistOptBucketOffsetsFix()
