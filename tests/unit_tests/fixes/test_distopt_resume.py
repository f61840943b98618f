"""Fix ``distopt_resume`` in isolation, on stand-ins of the distributed optimizer (torch Adam, CPU
tensors, no process group): the behavioural probe of each of its three defects, and the
replacements. The entrypoint tests (resume with and without ``--bf16``) are in
tests/functional_tests/test_resume.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import megatron.fixes
from megatron.fixes import distopt_resume
from megatron.fixes.distopt_resume import (
    FIX,
    upstream_dp_reshardable_load_copies_fp32,
    upstream_load_gives_each_param_its_step,
    upstream_state_dict_of_fresh_adam,
)
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper

PROBES = (
    upstream_state_dict_of_fresh_adam,
    upstream_load_gives_each_param_its_step,
    upstream_dp_reshardable_load_copies_fp32,
)


@pytest.fixture
def D():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    megatron.fixes.reset()
    yield DistributedOptimizer
    FIX.reset()


def test_probe_sees_each_defect_and_leaves_nothing_behind(D):
    from megatron.core.optimizer import distrib_optimizer as dopt

    have = dopt.HAVE_APEX_OR_TE
    assert [probe() for probe in PROBES] == [False, False, False]
    assert FIX.upstream_behaves() is False
    assert dopt.HAVE_APEX_OR_TE is have


def test_probe_is_not_fooled_by_rewritten_or_wrapped_methods(D, monkeypatch):
    state_dict = rewritten_copy(
        D.state_dict, {"steps": "distinct_steps", "inner_state_dict": "inner"}
    )
    assert upstream_state_dict_of_fresh_adam(state_dict) is False
    load = rewritten_copy(
        D.load_state_dict, {"state_dict_state": "template_state", "steps": "group_steps"}
    )
    assert upstream_load_gives_each_param_its_step(load) is False
    loader = rewritten_copy(
        D.load_parameter_state_from_dp_reshardable, {"bucket_state": "this_bucket"}
    )
    setter = rewritten_copy(D._set_main_param_and_optimizer_states, {"dst_tensors": "targets"})
    assert upstream_dp_reshardable_load_copies_fp32(loader, setter) is False
    for name in (
        "state_dict",
        "load_state_dict",
        "load_parameter_state_from_dp_reshardable",
        "_set_main_param_and_optimizer_states",
    ):
        monkeypatch.setattr(D, name, trivial_wrapper(getattr(D, name)))
    assert FIX.upstream_behaves() is False


def test_probe_sees_the_fixed_methods_behave(D):
    assert FIX.apply().value == "active"
    assert upstream_state_dict_of_fresh_adam(D.state_dict) is True
    assert upstream_dp_reshardable_load_copies_fp32(setter=D._set_main_param_and_optimizer_states)
    assert FIX.upstream_behaves() is False  # upstream's own, under the fix's wrappers


def test_fixed_load_gives_each_param_its_own_step(monkeypatch):
    from megatron.core.optimizer import distrib_optimizer as dopt

    shared = torch.tensor(0.0)
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    stand_in = SimpleNamespace(
        optimizer=SimpleNamespace(state={p: {"step": shared} for p in params})
    )
    load = distopt_resume.wrap_load_state_dict(lambda self, sd: "loaded")
    monkeypatch.setattr(dopt, "HAVE_APEX_OR_TE", False)
    sd = {"param_state": {}, "optimizer": {"param_groups": [{"step": 7}, {"step": 7}]}}
    assert load(stand_in, sd) == "loaded"
    steps = [stand_in.optimizer.state[p]["step"] for p in params]
    assert steps[0] is not steps[1] and [float(s) for s in steps] == [7.0, 7.0]
    assert float(shared) == 0.0
    sd["optimizer"]["param_groups"][1]["step"] = 8
    with pytest.raises(RuntimeError, match="expected exactly one"):
        load(stand_in, sd)
