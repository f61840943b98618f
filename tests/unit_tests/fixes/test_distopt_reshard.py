"""Fix ``distopt_reshard`` in isolation: the copy into torch Adam's state without ``step`` (the
fully-reshardable load), and the refusal to change TP/PP naming the flag that works. The entrypoint
tests are in tests/functional_tests/test_distopt_reshard.py."""

from __future__ import annotations

import argparse
import inspect
from types import SimpleNamespace

import pytest
import torch

import megatron.fixes
from megatron.fixes.distopt_reshard import (
    FIX,
    STALE_FLAG,
    UPSTREAM_ADVICE,
    refusal_helps,
    reshard_advice,
    upstream_copy_needs_step,
    upstream_refusal,
)
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper

#: Upstream's refusal, as load_checkpoint builds it for a TP 2 checkpoint loaded at TP 1.
UPSTREAM_REFUSAL = (
    "(TP, PP) mismatch after resume ((1, 1) vs (2, 1) from checkpoint): not supported for "
    "DistributedOptimizer with sharding type dp_reshardable. " + UPSTREAM_ADVICE
)


def _adam_like():
    """A stand-in DistributedOptimizer with one 4-element fp32 main parameter whose torch-Adam
    state holds step 7 and zeros."""
    main = torch.zeros(4)
    state = {"step": torch.tensor(7.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    return (
        main,
        state,
        SimpleNamespace(
            model_param_group_index_map={"p": (0, 0)},
            config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
            optimizer=SimpleNamespace(param_groups=[{"params": [main]}], state={main: state}),
        ),
    )


def _source():
    """What load_parameter_state_from_fully_reshardable passes: no 'step'."""
    return {
        "param": torch.full((4,), 1.5),
        "exp_avg": torch.full((4,), 2.5),
        "exp_avg_sq": torch.full((4,), 3.5),
    }


def test_guard_unfixed_upstream_copy_raises_keyerror_step():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    megatron.fixes.reset()
    assert upstream_copy_needs_step()
    _, _, opt = _adam_like()
    with pytest.raises(KeyError, match="step"), torch.no_grad():
        D._set_main_param_and_optimizer_states(opt, "p", _source())


def test_fixed_copy_fills_every_tensor_and_leaves_step_alone():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    try:
        main, state, opt = _adam_like()
        with torch.no_grad():
            D._set_main_param_and_optimizer_states(opt, "p", _source())
        assert torch.equal(main, torch.full((4,), 1.5))
        assert torch.equal(state["exp_avg"], torch.full((4,), 2.5))
        assert torch.equal(state["exp_avg_sq"], torch.full((4,), 3.5))
        assert state["step"].item() == 7.0  # load_state_dict sets it from the param groups
        src = _source()
        del src["exp_avg_sq"]  # any other missing key is still upstream's KeyError
        with pytest.raises(KeyError, match="exp_avg_sq"), torch.no_grad():
            D._set_main_param_and_optimizer_states(opt, "p", src)
    finally:
        FIX.reset()


def test_upstream_refusal_text_is_what_the_fix_rewrites():
    """The pieces reshard_advice keys on are in upstream's load_checkpoint (else the fix would pass
    the refusal through unchanged, and upstream_behaves would say so)."""
    from megatron.training import checkpointing

    megatron.fixes.reset()
    src = inspect.getsource(checkpointing.load_checkpoint)
    assert "not supported for DistributedOptimizer with sharding type" in src
    assert UPSTREAM_ADVICE in src


def test_the_flag_upstream_names_changes_nothing():
    """--ckpt-fully-parallel-save (on or off) leaves the format dp_reshardable; only
    --dist-ckpt-optim-fully-reshardable makes it fully_reshardable. Upstream's own argument check
    calls the flag deprecated and without effect."""
    from megatron.training import arguments, checkpointing

    def sharding(**kw):
        args = argparse.Namespace(
            use_distributed_optimizer=True,
            ckpt_format="torch_dist",
            distrib_optim_fully_reshardable_mem_efficient=False,
            **kw,
        )
        return checkpointing._build_sharded_state_dict_metadata(args, dp_cp_group=object())[
            "distrib_optim_sharding_type"
        ]

    for fully_parallel in (True, False):
        assert (
            sharding(
                ckpt_fully_parallel_save=fully_parallel, dist_ckpt_optim_fully_reshardable=False
            )
            == "dp_reshardable"
        )
        assert (
            sharding(
                ckpt_fully_parallel_save=fully_parallel, dist_ckpt_optim_fully_reshardable=True
            )
            == "fully_reshardable"
        )
    assert "--ckpt-fully-parallel-save flag is deprecated and has no effect" in inspect.getsource(
        arguments
    )


def test_reshard_advice_names_the_flag_that_works():
    msg = reshard_advice(UPSTREAM_REFUSAL)
    assert msg.startswith("(TP, PP) mismatch after resume ((1, 1) vs (2, 1) from checkpoint): ")
    assert "'dp_reshardable' format" in msg and "adding --dist-ckpt-optim-fully-reshardable" in msg
    assert "--no-load-optim" in msg and UPSTREAM_ADVICE not in msg
    assert reshard_advice("some other RuntimeError") is None


def test_installed_load_checkpoint_rewrites_only_the_refusal(monkeypatch):
    from megatron.training import checkpointing, training

    megatron.fixes.reset()
    calls = []

    def stub(*args, **kwargs):
        calls.append(kwargs.get("what"))
        if kwargs.get("what") == "refusal":
            raise RuntimeError(UPSTREAM_REFUSAL)
        if kwargs.get("what") == "other":
            raise RuntimeError("unrelated")
        return (10, 0.0)

    monkeypatch.setattr(checkpointing, "load_checkpoint", stub)
    monkeypatch.setattr(training, "load_checkpoint", stub)
    assert FIX.apply().value == "active"
    try:
        assert training.load_checkpoint is checkpointing.load_checkpoint is not stub
        assert checkpointing.load_checkpoint(what="ok") == (10, 0.0)
        with pytest.raises(RuntimeError, match="unrelated"):
            training.load_checkpoint(what="other")
        with pytest.raises(RuntimeError, match="adding --dist-ckpt-optim-fully-reshardable") as e:
            training.load_checkpoint(what="refusal")
        assert e.value.__cause__ is None and e.value.__suppress_context__
        assert calls == ["ok", "other", "refusal"]
    finally:
        FIX.reset()
    assert checkpointing.load_checkpoint is stub and training.load_checkpoint is stub


# --- the behavioural probe -----------------------------------------------------------------------


def test_probe_observes_the_refusal_and_leaves_nothing_behind():
    from megatron.training import checkpointing

    megatron.fixes.reset()
    before = {
        n: vars(checkpointing)[n] for n in ("get_args", "print_rank_0", "_load_base_checkpoint")
    }
    refusal = upstream_refusal()
    assert refusal == UPSTREAM_REFUSAL
    assert STALE_FLAG in refusal and not refusal_helps(refusal)
    assert FIX.upstream_behaves() is False
    assert {n: vars(checkpointing)[n] for n in before} == before


def test_probe_is_not_fooled_by_rewritten_or_wrapped_upstream(monkeypatch):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D
    from megatron.training import checkpointing

    megatron.fixes.reset()
    copy = rewritten_copy(
        checkpointing.load_checkpoint,
        {"mismatch_msg": "what_differs", "ckpt_tp_pp": "saved_tp_pp", "run_tp_pp": "this_tp_pp"},
    )
    assert not refusal_helps(upstream_refusal(copy))
    setter = rewritten_copy(D._set_main_param_and_optimizer_states, {"dst_tensors": "targets"})
    assert upstream_copy_needs_step(setter)
    monkeypatch.setattr(checkpointing, "load_checkpoint", trivial_wrapper(copy))
    monkeypatch.setattr(D, "_set_main_param_and_optimizer_states", trivial_wrapper(setter))
    assert FIX.upstream_behaves() is False


def test_probe_sees_the_fixed_functions_behave():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D
    from megatron.training import checkpointing

    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    try:
        assert refusal_helps(upstream_refusal(checkpointing.load_checkpoint))
        assert not upstream_copy_needs_step(D._set_main_param_and_optimizer_states)
        assert FIX.upstream_behaves() is False  # upstream's own, under the fix's wrappers
    finally:
        FIX.reset()
