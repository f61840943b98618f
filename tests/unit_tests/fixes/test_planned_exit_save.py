"""Fix ``planned_exit_save`` in isolation, on upstream's own ``checkpoint_and_decide_exit`` with
stand-in args and recorders for its saves: upstream's exit at a non-persistent save iteration
saves nothing persistent (the guard); the fix adds the persistent save there, for
``--exit-interval`` and ``--exit-duration-in-mins``, and adds none where upstream already saved
persistently (a persistent-save iteration, SIGTERM with ``--exit-signal-handler``) or without
``--save``. The entrypoint tests are in tests/functional_tests/test_run_edges.py."""

from __future__ import annotations

import io
import time
from contextlib import contextmanager, redirect_stdout
from types import SimpleNamespace

import pytest

import megatron.fixes
from megatron.fixes.planned_exit_save import FIX, upstream_saves_persistent_on_exit
from megatron.fixes.standins import StandInArgs, replaced
from tests.unit_tests.fixes.probe_copies import trivial_wrapper


def _args(**over) -> StandInArgs:
    base = dict(save="ck", save_interval=10, non_persistent_save_interval=4, exit_interval=12)
    return StandInArgs(**{**base, **over})


@contextmanager
def _stand_ins(args, signal=False):
    """``training``'s args, timers, prints and signal handler stood in; upstream's
    ``save_checkpoint_and_time`` replaced by a recorder of ``(iteration, persistent)``, under the
    fix's wrapper when the fix is installed (it is re-applied over the recorder)."""
    import torch
    from megatron.training import training

    saves: list[tuple[int, bool]] = []

    def record(iteration, *a, **kw):
        saves.append((iteration, not kw.get("non_persistent_ckpt", False)))

    handler = SimpleNamespace(signals_received=lambda: [signal])
    installed = FIX.status.value == "active"
    save = record
    if installed:
        from megatron.fixes.planned_exit_save import wrap_save_checkpoint_and_time

        save = wrap_save_checkpoint_and_time(record)
    with (
        redirect_stdout(io.StringIO()),
        replaced(
            training,
            get_args=lambda: args,
            get_timers=lambda: None,
            print_datetime=lambda *a, **k: None,
            get_signal_handler=lambda: handler,
            save_checkpoint_and_time=save,
        ),
        replaced(torch.distributed, all_reduce=lambda *a, **k: None),
        replaced(torch, tensor=lambda *a, device=None, _t=torch.tensor, **k: _t(*a, **k)),
    ):
        yield saves


def _decide(iteration: int) -> bool:
    from megatron.training import training

    return training.checkpoint_and_decide_exit(None, None, None, iteration, 0.0, {}, None)


def test_guard_upstream_exits_at_a_local_save_iteration_without_a_persistent_save():
    megatron.fixes.reset()
    assert upstream_saves_persistent_on_exit() is False
    assert FIX.upstream_behaves() is False
    with _stand_ins(_args()) as saves:
        assert _decide(12) is True
    assert saves == [(12, False)]  # the local save only: --save keeps iteration 10


@pytest.mark.parametrize("kind", ["exit_interval", "exit_duration_in_mins"])
def test_fixed_every_planned_exit_leaves_a_persistent_checkpoint(monkeypatch, kind):
    from megatron.training import training

    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    try:
        if kind == "exit_interval":
            args = _args()
        else:  # the run has been going for longer than --exit-duration-in-mins
            args = _args(exit_interval=None, exit_duration_in_mins=1)
            monkeypatch.setattr(training, "_TRAIN_START_TIME", time.time() - 120)
        with _stand_ins(args) as saves:
            assert _decide(12) is True
        assert saves == [(12, False), (12, True)]
        with _stand_ins(args) as saves:  # a persistent-save iteration: saved once, not twice
            assert _decide(10) is False or kind == "exit_duration_in_mins"
        assert saves == [(10, True)]
        with _stand_ins(_args(save=None)) as saves:  # no --save: nothing to save
            assert _decide(12) is True
        assert saves == []
        sigterm = _args(exit_signal_handler=True)
        with _stand_ins(sigterm, signal=True) as saves:  # SIGTERM: upstream saves persistently
            assert _decide(11) is True
        assert saves == [(11, True)]
    finally:
        FIX.reset()


def test_probe_sees_the_defect_through_a_wrapper_and_under_the_fix(monkeypatch):
    from megatron.training import training

    megatron.fixes.reset()
    wrapped = trivial_wrapper(training.checkpoint_and_decide_exit)
    assert upstream_saves_persistent_on_exit(wrapped) is False
    assert FIX.apply().value == "active"
    try:
        assert FIX.upstream_behaves() is False  # upstream's own function, under the fix
    finally:
        FIX.reset()


def test_probe_accepts_a_behaving_upstream_and_cannot_tell_one_that_does_not_exit():
    from megatron.training import training

    def behaving(model, optimizer, sched, iteration, flops, ctx, it):
        training.save_checkpoint_and_time(iteration, model, optimizer, sched, flops, ctx)
        return True

    assert upstream_saves_persistent_on_exit(behaving) is True
    assert upstream_saves_persistent_on_exit(lambda *a: False) is None
