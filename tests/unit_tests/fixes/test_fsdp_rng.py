"""Fix ``fsdp_rng`` in isolation: the behavioural probe (upstream's ``get_rng_state`` as the
``fsdp_dtensor`` load calls it, without groups, on a stand-in rank with TP rank 1; no process
group, no device) and the replacement. The entrypoint guard is in
tests/functional_tests/test_fsdp_mla_mtp.py."""

from __future__ import annotations

import torch

import megatron.fixes
from megatron.fixes.fsdp_rng import FIX, upstream_keys_by_rank_without_groups
from megatron.fixes.standins import get_rng_state_stand_ins, parallel_state
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper


def _collaborators():
    from megatron.training import checkpointing

    names = ("get_args", "mpu", "get_pg_rank", "get_pg_size", "get_rng_state")
    return {n: vars(checkpointing)[n] for n in names}, torch.cuda.get_rng_state


def test_probe_sees_the_defect_and_leaves_nothing_behind():
    megatron.fixes.reset()
    before = _collaborators()
    assert upstream_keys_by_rank_without_groups() is False
    assert FIX.upstream_behaves() is False
    assert _collaborators() == before


def test_probe_is_not_fooled_by_a_rewritten_or_wrapped_upstream(monkeypatch):
    from megatron.training import checkpointing

    megatron.fixes.reset()
    upstream = checkpointing.get_rng_state
    copy = rewritten_copy(upstream, {"rng_state_list": "states", "tp_rank": "tensor_rank"})
    assert upstream_keys_by_rank_without_groups(copy) is False
    monkeypatch.setattr(checkpointing, "get_rng_state", trivial_wrapper(upstream))
    assert FIX.upstream_behaves() is False


def test_probe_sees_an_upstream_that_resolves_the_groups():
    """An upstream that resolves missing groups to the model-parallel ones (what the fix does)
    behaves."""
    from megatron.training import checkpointing

    megatron.fixes.reset()
    upstream = checkpointing.get_rng_state

    def resolving(ckpt_format, tp_group=None, pp_group=None, *args, **kwargs):
        if tp_group is None and pp_group is None:
            tp_group = checkpointing.mpu.get_tensor_model_parallel_group()
            pp_group = checkpointing.mpu.get_pipeline_model_parallel_group()
        return upstream(ckpt_format, tp_group, pp_group, *args, **kwargs)

    assert upstream_keys_by_rank_without_groups(resolving) is True


def test_fixed_get_rng_state_keys_by_this_ranks_coordinates(monkeypatch):
    from megatron.core import parallel_state as mpu
    from megatron.training import checkpointing

    megatron.fixes.reset()
    stand_in = parallel_state(tp=(1, 2), pp=(1, 2))
    for name in ("model_parallel_is_initialized", "get_tensor_model_parallel_group"):
        monkeypatch.setattr(mpu, name, getattr(stand_in, name))
    monkeypatch.setattr(
        mpu, "get_pipeline_model_parallel_group", stand_in.get_pipeline_model_parallel_group
    )
    assert FIX.apply().value == "active"
    try:
        with get_rng_state_stand_ins(stand_in):
            out = checkpointing.get_rng_state("fsdp_dtensor", None, None)
            assert list(out) == ["(1, 1)"]
            out = checkpointing.get_rng_state("torch_dist", None, None)  # other formats: as given
            assert out.global_offset[:2] == (0, 0)
    finally:
        FIX.reset()
