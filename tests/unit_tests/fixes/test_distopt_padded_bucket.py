"""Fix ``distopt_padded_bucket`` on the probe's stand-in distributed optimizer (laid out by
upstream's own ``_compute_per_buffer_param_layout``: bucket 0 closed before a shared embedding,
its unpadded size ending in 56 elements of alignment): upstream's padding chunk runs past the
tensor, the fixed one ends at it, parameter entries are upstream's, and a ``torch_dist`` save of
the fixed state loads back bitwise where upstream's save is refused. The entrypoint test (PP 2,
save and bitwise resume) is tests/functional_tests/test_distopt_padded_bucket.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import megatron.fixes
from megatron.fixes import FixStatus
from megatron.fixes.distopt_padded_bucket import (
    FIX,
    chunk_problems,
    padded_bucket_stand_in,
    sharded_tensors,
    upstream_plans_padded_bucket,
    upstream_reshardable,
)
from tests.helpers.dist import run_distributed
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper

BUCKET_0 = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32)"
PARAM_0 = f"{BUCKET_0}.bucket_idx_0.param"


def _save_state(fn=None, **stand_in):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    fn = fn or D.sharded_param_state_dp_reshardable
    return fn(padded_bucket_stand_in(**stand_in), {}, is_loading=False)


def _chunks(state, key=PARAM_0):
    return [
        (t.global_offset, tuple(t.local_shape), t.global_shape) for t in sharded_tensors(state)[key]
    ]


def test_stand_in_is_the_padded_layout():
    """What upstream's layout gives the stand-in: bucket 0 unpadded 64 (the weight's 8 elements,
    then the shared embedding's 64-alignment) in 128; the embedding's bucket 100 in 128."""
    opt = padded_bucket_stand_in()
    assert opt.per_bucket_numel == [[128, 128]]
    assert opt.per_bucket_numel_unpadded == [[64, 100]]


def test_guard_unfixed_upstream_pads_past_the_bucket():
    megatron.fixes.reset()
    assert not upstream_plans_padded_bucket()
    state = _save_state(upstream_reshardable())
    assert _chunks(state) == [((0,), (8,), (64,)), ((8,), (120,), (64,))]
    assert f"{PARAM_0}: chunk at (8,) of torch.Size([120]) past (64,)" in chunk_problems(
        sharded_tensors(state)
    )


def test_fixed_padding_ends_at_the_bucket(fixed):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    assert D.sharded_param_state_dp_reshardable.__wrapped__ is upstream_reshardable()
    for is_loading in (False, True):
        opt = padded_bucket_stand_in()
        state = D.sharded_param_state_dp_reshardable(opt, {}, is_loading=is_loading)
        assert chunk_problems(sharded_tensors(state)) == []
        assert _chunks(state) == [((0,), (8,), (64,)), ((8,), (56,), (64,))]
        weight, padding = state[0][(torch.float32, torch.float32)][0]
        assert (weight["padding"].obj, padding["padding"].obj) == (False, True)
        # the weight's entry is upstream's: its own state tensors, its values
        assert torch.equal(weight["exp_avg"].data, torch.arange(8.0) + 1100.0)
        assert (
            weight["param"].data.data_ptr()
            == next(iter(opt.shard_states.values()))["param"].data_ptr()
        )
        # the padding is a view of upstream's padding tensor (never loaded: upstream skips it)
        assert padding["exp_avg"].data.shape == (56,) and padding["exp_avg"].data.is_contiguous()
    assert not upstream_plans_padded_bucket()  # the probe sees upstream's own, not the fix


def test_fixed_two_dp_ranks_cover_each_bucket_exactly(fixed):
    """DP 2, a 150-element weight: rank 0's shard of bucket 0 is all weight, rank 1's holds the
    weight's last 22 elements and padding up to 192 (upstream: up to 256)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    ranks = {}
    for rank in (0, 1):
        ranks[rank] = _save_state(weight=150, dp_rank=rank, dp_size=2)
        upstream = _save_state(upstream_reshardable(), weight=150, dp_rank=rank, dp_size=2)
        if rank == 1:
            assert _chunks(upstream)[-1] == ((150,), (106,), (192,))
    assert _chunks(ranks[0]) == [((0,), (128,), (192,))]
    assert _chunks(ranks[1]) == [((128,), (22,), (192,)), ((150,), (42,), (192,))]
    both: dict = {}
    for state in ranks.values():
        for key, tensors in sharded_tensors(state).items():
            both.setdefault(key, []).extend(tensors)
    assert chunk_problems(both) == []
    assert D.sharded_param_state_dp_reshardable is not upstream_reshardable()


@pytest.mark.parametrize("copy", ["rewritten", "wrapper"])
def test_probe_sees_the_defect_through_other_source_text(copy):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    megatron.fixes.reset()
    upstream = upstream_reshardable()
    fn = (
        rewritten_copy(upstream, {"cur_param_end": "end_of_previous"})
        if copy == "rewritten"
        else trivial_wrapper(upstream)
    )
    assert not upstream_plans_padded_bucket(fn)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "sharded_param_state_dp_reshardable", fn)
        assert not upstream_plans_padded_bucket()


# --- a torch_dist save of the stand-in's optimizer state, one gloo rank -------------------------


def _dcp_body(rank: int, world: int, tmp: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    from megatron.cpu import runtime

    runtime.activate()  # megatron-core's torch_dist writer calls torch.cuda.synchronize()
    os.environ[megatron.fixes.DISABLE_ENV] = FIX.name  # this rank's process only
    megatron.fixes.apply()  # every other fix, as pretrain_gpt.py applies them
    assert FIX.status is FixStatus.NOT_APPLIED
    assert D.sharded_param_state_dp_reshardable is upstream_reshardable()
    unfixed, fixed_dir = Path(tmp) / "unfixed", Path(tmp) / "fixed"
    unfixed.mkdir()
    fixed_dir.mkdir()
    with pytest.raises(ValueError, match=r"Failed to validate global plan.*out of bounds chunk"):
        dist_checkpointing.save({"optimizer": _save_state()}, str(unfixed))
    assert not (unfixed / ".metadata").exists()

    del os.environ[megatron.fixes.DISABLE_ENV]
    assert FIX.apply().value == "active"
    saved = _save_state()
    dist_checkpointing.save({"optimizer": saved}, str(fixed_dir))
    template = padded_bucket_stand_in()
    for states in template.shard_states.values():
        for t in states.values():
            t.zero_()
    loaded = dist_checkpointing.load(
        {"optimizer": D.sharded_param_state_dp_reshardable(template, {}, is_loading=True)},
        str(fixed_dir),
    )["optimizer"]
    for gbuf in (0,):
        for bucket_saved, bucket_loaded in zip(
            saved[gbuf][(torch.float32, torch.float32)],
            loaded[gbuf][(torch.float32, torch.float32)],
        ):
            kept = [e for e in bucket_loaded if not e["padding"]]  # what upstream's load keeps
            want = [e for e in bucket_saved if not e["padding"].obj]
            assert len(kept) == len(want) == 1
            for key in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(kept[0][key], want[0][key].data), key
    assert loaded["per_bucket_numel_unpadded"] == [[64, 100]]
    FIX.reset()


def test_fixed_save_loads_back_bitwise_where_upstream_is_refused(tmp_path):
    """One gloo rank: with ``MEGATRON_FIXES_DISABLE=distopt_padded_bucket`` (every other fix
    applied) DCP refuses the save, as on the entrypoint; with the fix it saves and loads back."""
    run_distributed(_dcp_body, 1, str(tmp_path))
