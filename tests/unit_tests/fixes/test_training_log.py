"""Fix ``training_log``: the printed loss of the second iteration after a start is that iteration's.

Runs upstream's real ``megatron.training.training.training_log`` in this process, the way
``train()`` calls it (``is_first_iteration=True`` on the first iteration of a start), with its
collaborators that need a job (args, timers, writers, model-parallel reductions) replaced by stubs,
and reads the printed log lines. The entrypoint-level check (printed ``lm loss`` == ``--loss-log``
value on every iteration, across a resume) is in ``tests/functional_tests/test_resume.py``.
"""

from __future__ import annotations

import re
import types
from unittest import mock

import pytest
import torch

import megatron.fixes
from megatron.fixes.training_log import (
    FIX,
    first_line_is_interval_line,
    upstream_resets_first_interval_line,
)
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper


class _Timer:
    def elapsed(self, barrier=False, reset=True):
        return 0.5

    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass


class _Timers:
    def __call__(self, name, log_level=None):
        return _Timer()

    def log(self, *args, **kwargs):
        pass

    def write(self, *args, **kwargs):
        pass


def _args(log_interval: int):
    return types.SimpleNamespace(
        log_interval=log_interval,
        timing_log_level=0,
        perform_rl_step=False,
        micro_batch_size=2,
        data_parallel_size=2,
        gtp_weight_remat_size=1,
        world_size=2,
        seq_length=64,
        freeze_all_layers=False,
        num_experts=None,
        mtp_num_layers=None,
        dsa_indexer_loss_coeff=None,
        record_memory_history=False,
        log_throughput=False,
        log_timers_to_tensorboard=False,
        train_iters=100,
        consumed_train_samples=0,
        skipped_train_samples=0,
        log_energy=False,
        log_memory_interval=None,
        rl_profile=False,
        rl_use_sequence_packing=False,
        tensorboard_log_interval=1,
        profile_ranks=[],
    )


@pytest.fixture
def printed(monkeypatch):
    """Runs ``training_log`` for (iteration, loss) pairs of one start; returns the printed losses
    (iteration -> value of the ``lm loss:`` field)."""
    from megatron.training import training

    from megatron.cpu import runtime  # upstream allocates its accumulators on device='cuda'

    runtime.activate()
    lines: list[str] = []

    def run(losses: list[tuple[int, float]], log_interval: int = 1) -> dict[int, float]:
        args = _args(log_interval)
        stubs = dict(
            get_args=lambda: args,
            get_timers=_Timers,
            get_tensorboard_writer=lambda: None,
            get_wandb_writer=lambda: None,
            get_one_logger=lambda: None,
            get_energy_monitor=lambda: None,
            get_num_microbatches=lambda: 1,
            num_floating_point_operations=lambda *a, **k: 1.0,
            reduce_max_stat_across_model_parallel_group=lambda value, group=None: value,
            print_rank_last=lines.append,
            one_logger_utils=mock.MagicMock(),
        )
        total: dict = {}
        with (
            mock.patch.multiple(training, **stubs),
            mock.patch("megatron.training.global_vars.get_args", lambda: args),
        ):
            for n, (iteration, loss) in enumerate(losses):
                args.consumed_train_samples += 4
                training.training_log(
                    {"lm loss": torch.tensor([loss])},
                    total,
                    1e-3,
                    iteration,
                    1.0,
                    False,
                    0,
                    1.0,
                    None,
                    None,
                    None,
                    pg_collection=None,
                    is_first_iteration=n == 0,
                )
        out = {}
        for line in lines:
            m = re.search(r"iteration\s+(\d+)/.*\blm loss: (\S+) \|", line)
            if m:
                out[int(m.group(1))] = float(m.group(2))
        lines.clear()
        return out

    yield run
    runtime.deactivate()


def test_interval_boundary_rule():
    assert first_line_is_interval_line(16, 1) and first_line_is_interval_line(20, 10)
    assert not first_line_is_interval_line(16, 10) and first_line_is_interval_line(3, None)


def test_guard_unfixed_upstream_averages_the_first_two_iterations(printed):
    megatron.fixes.reset()
    # a resume at iteration 15, --log-interval 1: iterations 16 and 17 lost 6.0 and 5.0
    got = printed([(16, 6.0), (17, 5.0), (18, 4.0)])
    assert got == {16: 6.0, 17: 5.5, 18: 4.0}  # 17 prints the mean of 16 and 17


def test_fixed_line_prints_its_own_iteration(printed):
    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    try:
        assert printed([(16, 6.0), (17, 5.0), (18, 4.0)]) == {16: 6.0, 17: 5.0, 18: 4.0}
        # --log-interval 10, start at 16 (not a boundary): the line at 20 still covers 16-20, as
        # upstream intends for interval statistics
        got = printed(
            [(16, 6.0), (17, 5.0), (18, 4.0), (19, 3.0), (20, 2.0), (21, 9.0)], log_interval=10
        )
        assert got == {16: 6.0, 20: 4.0}
        # --log-interval 5, start at 15 (a boundary): 16-20 is a regular interval
        got = printed(
            [(15, 6.0), (16, 5.0), (17, 4.0), (18, 3.0), (19, 2.0), (20, 1.0)], log_interval=5
        )
        assert got == {15: 6.0, 20: 3.0}
    finally:
        FIX.reset()


# --- the behavioural probe -----------------------------------------------------------------------


def _collaborators():
    from megatron.training import global_vars, training

    names = ("get_args", "get_timers", "print_rank_last", "one_logger_utils", "get_telemetry")
    return {n: vars(training).get(n) for n in names}, global_vars.get_args


def test_probe_sees_the_defect_and_leaves_nothing_behind():
    megatron.fixes.reset()
    before = _collaborators()
    assert FIX.upstream_behaves() is False
    assert upstream_resets_first_interval_line() is False
    assert _collaborators() == before


def test_probe_is_not_fooled_by_a_rewritten_or_wrapped_upstream(monkeypatch):
    from megatron.training import training

    megatron.fixes.reset()
    upstream = training.training_log
    copy = rewritten_copy(
        upstream, {"should_reset": "reset_after_line", "advanced_iters_key": "advanced_key"}
    )
    assert upstream_resets_first_interval_line(copy) is False
    monkeypatch.setattr(training, "training_log", trivial_wrapper(upstream))
    assert FIX.upstream_behaves() is False


def test_probe_sees_the_fixed_function_behave():
    from megatron.training import training

    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    try:
        assert upstream_resets_first_interval_line(training.training_log) is True
        assert FIX.upstream_behaves() is False  # upstream's own, under the fix's wrapper
    finally:
        FIX.reset()
