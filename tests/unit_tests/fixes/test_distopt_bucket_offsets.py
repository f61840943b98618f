"""Fix ``distopt_bucket_offsets`` in isolation, on the probe's stand-in optimizer (2 grad buckets,
bucket 0 padded; no process group): the unfixed save reads bucket 1 shifted, the fixed save gives
every parameter its own values, and the load path is upstream's. The entrypoint tests are in
tests/functional_tests/test_distopt_bucket_offsets.py."""

from __future__ import annotations

import pytest
import torch

import megatron.fixes
from megatron.fixes.distopt_bucket_offsets import (
    FIX,
    bucketed_stand_in,
    pad_world_tensors,
    saved_tensors,
    upstream_fully_reshardable,
    upstream_saves_every_bucket_right,
)
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper

_ON_MAIN_UPSTREAM_BEHAVES = pytest.mark.fixed_upstream(
    "megatron-core==0.20.0",
    "Megatron-LM PR 5077 is on upstream main: upstream saves every bucket right (stands aside)",
)


def _save(case, fn=None):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    fn = fn or D.sharded_param_state_fully_reshardable
    return fn(case.optimizer, case.model_sharded_state_dict, is_loading=False, metadata={})


@_ON_MAIN_UPSTREAM_BEHAVES
def test_guard_unfixed_upstream_saves_bucket_1_shifted(caplog):
    megatron.fixes.reset()
    assert not upstream_saves_every_bucket_right()
    case = bucketed_stand_in()
    with caplog.at_level("WARNING"):
        saved = saved_tensors(_save(case, upstream_fully_reshardable()))
    assert torch.equal(saved["optimizer.state.param.p0"], case.expected["optimizer.state.param.p0"])
    # p1 [8, 12) of the 12-element compact tensors: p2's values; p2 [12, 16): past the end, zeros.
    assert torch.equal(saved["optimizer.state.param.p1"], torch.tensor([9.0, 10.0, 11.0, 12.0]))
    assert torch.equal(saved["optimizer.state.exp_avg.p1"], torch.arange(109.0, 113.0))
    assert torch.equal(saved["optimizer.state.exp_avg_sq.p2"], torch.zeros(2, 2))
    assert "'p2' param range exceeds unpadded buffer by 4 elements" in caplog.text


@_ON_MAIN_UPSTREAM_BEHAVES
def test_fixed_save_gives_every_parameter_its_own_values(fixed, caplog):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    assert D.sharded_param_state_fully_reshardable.__wrapped__ is upstream_fully_reshardable()
    case = bucketed_stand_in()
    gather = case.optimizer.get_parameter_state_dp_zero
    with caplog.at_level("WARNING"):
        state = _save(case)
    saved = saved_tensors(state)
    assert sorted(saved) == sorted(case.expected)
    for key, want in case.expected.items():
        assert torch.equal(saved[key], want), (key, saved[key], want)
    assert torch.equal(saved["optimizer.state.param.p1"], torch.tensor([5.0, 6.0, 7.0, 8.0]))
    assert torch.equal(
        saved["optimizer.state.exp_avg_sq.p2"], torch.tensor([[1009.0, 1010.0], [1011.0, 1012.0]])
    )
    assert "exceeds unpadded buffer" not in caplog.text
    # The ShardedTensor metadata is upstream's: the model parameter's, under the optimizer key.
    sh = state[2]["exp_avg"]
    assert (sh.key, sh.global_shape, sh.global_offset, sh.replica_id) == (
        "optimizer.state.exp_avg.p2",
        (2, 2),
        (0, 0),
        0,
    )
    # Upstream's gather was called as upstream calls it; the shadow is gone afterwards.
    assert case.calls == [dict(use_gloo_comm=False, empty_data=False, return_on_all_ranks=True)]
    assert case.optimizer.get_parameter_state_dp_zero is gather  # the stand-in's own, put back


@_ON_MAIN_UPSTREAM_BEHAVES
def test_fixed_save_leaves_no_shadow_on_a_real_optimizer_class_instance(fixed):
    """On an object whose get_parameter_state_dp_zero is a method (a DistributedOptimizer's), the
    instance attribute is deleted after the call, also when upstream raises."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    case = bucketed_stand_in()
    gather = case.optimizer.get_parameter_state_dp_zero

    class Optimizer:
        def get_parameter_state_dp_zero(self, **kwargs):
            return gather(**kwargs)

    opt = Optimizer()
    opt.__dict__.update(
        {k: v for k, v in vars(case.optimizer).items() if k != "get_parameter_state_dp_zero"}
    )
    saved = saved_tensors(
        D.sharded_param_state_fully_reshardable(
            opt, case.model_sharded_state_dict, False, {"unused": True}
        )
    )
    assert all(torch.equal(saved[k], v) for k, v in case.expected.items())
    assert "get_parameter_state_dp_zero" not in vars(opt)
    with pytest.raises(ValueError, match="not in model_sharded_state_dict"):
        D.sharded_param_state_fully_reshardable(opt, {}, is_loading=False, metadata={})
    assert "get_parameter_state_dp_zero" not in vars(opt)


@_ON_MAIN_UPSTREAM_BEHAVES
def test_load_templates_are_upstreams(fixed):
    """is_loading: the templates (empty data, padded offsets, zero-filled past the end as
    upstream does) are exactly upstream's; nothing is re-padded."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    fixed_case, upstream_case = bucketed_stand_in(), bucketed_stand_in()
    got = D.sharded_param_state_fully_reshardable(
        fixed_case.optimizer, fixed_case.model_sharded_state_dict, is_loading=True, metadata={}
    )
    want = upstream_fully_reshardable()(
        upstream_case.optimizer,
        upstream_case.model_sharded_state_dict,
        is_loading=True,
        metadata={},
    )
    assert sorted(got) == sorted(want)
    for idx in want:
        assert sorted(got[idx]) == sorted(want[idx])
        for k, w in want[idx].items():
            g = got[idx][k]
            assert (g.key, g.global_shape, g.global_offset, g.replica_id) == (
                w.key,
                w.global_shape,
                w.global_offset,
                w.replica_id,
            )
            assert torch.equal(g.data, w.data)
    assert (
        fixed_case.calls
        == upstream_case.calls
        == [dict(use_gloo_comm=False, empty_data=True, return_on_all_ranks=True)]
    )


@_ON_MAIN_UPSTREAM_BEHAVES
def test_fixed_save_loads_back_to_every_parameters_own_state(fixed):
    """Round trip through upstream's load_parameter_state_from_fully_reshardable (unpatched):
    the model-shaped tensors of a fixed save land, flattened, on each parameter's own state."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    case = bucketed_stand_in()
    loaded_state = {
        idx: {k: sh.data.clone() for k, sh in tensors.items()}
        for idx, tensors in _save(case).items()
    }
    received = {}
    case.optimizer._set_main_param_and_optimizer_states = lambda p, t: received.__setitem__(p, t)
    D.load_parameter_state_from_fully_reshardable(case.optimizer, loaded_state)
    for name, p in case.params.items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            want = case.expected[f"optimizer.state.{key}.{name}"].flatten()
            assert torch.equal(received[p][key], want), (name, key)


def test_pad_world_tensors_layout_and_refusal():
    buckets = bucketed_stand_in().optimizer.buffers[0].buckets
    world = {"param": torch.arange(1.0, 13.0), "numel_unpadded": 12}
    padded = pad_world_tensors(world, buckets)
    assert padded["numel_unpadded"] == 20
    assert torch.equal(
        padded["param"],
        torch.tensor([1, 2, 3, 4, 0, 0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12, 0, 0, 0, 0.0]),
    )
    assert pad_world_tensors({}, buckets) == {}
    with pytest.raises(RuntimeError, match="upstream's layout changed"):
        pad_world_tensors({"param": torch.zeros(20)}, buckets)


def test_probe_verdict_survives_a_rewritten_or_wrapped_upstream(monkeypatch):
    """The probe's verdict on upstream's own function (the defect on the pinned release) is the
    same for a copy with other names and text, and for a trivial wrapper over it."""
    import importlib.metadata

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    from megatron.overlay import pins

    megatron.fixes.reset()
    verdict = upstream_saves_every_bucket_right()
    if importlib.metadata.version("megatron-core") == pins.RELEASES["megatron-core"]:
        assert verdict is False
    upstream = upstream_fully_reshardable()
    copy = rewritten_copy(upstream, {"world_tensors": "gathered", "state_ten": "values"})
    assert upstream_saves_every_bucket_right(copy) is verdict
    monkeypatch.setattr(D, "sharded_param_state_fully_reshardable", trivial_wrapper(upstream))
    assert FIX.upstream_behaves() is verdict
