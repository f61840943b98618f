"""Fix: the printed ``lm loss`` of the second iteration after every start averages two iterations.

megatron-core 0.19.2's ``megatron.training.training.training_log`` prints a line at every
``--log-interval`` iteration and, in addition, at the first iteration of each start
(``is_first_iteration``, to show the initialisation overhead). For that first line it sets
``should_reset = not is_first_iteration``: the loss accumulators, the skipped/NaN counters and the
interval timer are *not* reset after it, so that the next interval line still covers the whole
interval. That is right when the first iteration is not itself an interval boundary, but wrong when
it is (``--log-interval 1``, or a resume just before a multiple of the interval): the next line
then averages two intervals, disagrees with ``--loss-log`` and makes a correct resume look wrong.

Design notes: ``docs/fixes/training_log.md``.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Callable

from megatron.fixes.standins import StandInArgs, replaced, upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

#: upstream's names of the counters ``training_log`` keeps in ``total_loss_dict``.
_COUNTERS = ("advanced iterations", "skipped iterations", "nan iterations")


def first_line_is_interval_line(iteration: int, log_interval: int | None) -> bool:
    """True when ``iteration`` (int, >= 1) is an interval boundary (``--log-interval``; ``None``
    or 0 counts as 1), i.e. its log line covers a regular interval and must reset the accumulators
    as every interval line does."""
    return iteration % max(1, int(log_interval or 1)) == 0


def wrap_training_log(upstream):
    """Factory of the replacement of ``megatron.training.training.training_log``: upstream's, with
    ``is_first_iteration`` False on interval boundaries (:func:`first_line_is_interval_line`)."""
    from megatron.training import global_vars

    position = list(inspect.signature(upstream).parameters).index("is_first_iteration")

    @wraps_upstream(upstream)
    def training_log(*args, **kwargs):
        """Upstream's, with ``is_first_iteration`` False on interval boundaries."""
        iteration = kwargs.get("iteration", args[3] if len(args) > 3 else None)
        if len(args) > position:
            first = args[position]
        else:
            first = kwargs.get("is_first_iteration", False)
        if (
            first
            and iteration is not None
            and first_line_is_interval_line(iteration, global_vars.get_args().log_interval)
        ):
            if len(args) > position:
                args = args[:position] + (False,) + args[position + 1 :]
            else:
                kwargs["is_first_iteration"] = False
        return upstream(*args, **kwargs)

    return training_log


class _ProbeTimer:
    """``timers('interval-time')`` of the probe: records the ``reset`` of each ``elapsed``."""

    def __init__(self, resets: list[bool]) -> None:
        self._resets = resets

    def elapsed(self, barrier: bool = False, reset: bool = True) -> float:
        self._resets.append(reset)
        return 1.0

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


class _ProbeTimers:
    """``get_timers()`` of the probe: every timer is a :class:`_ProbeTimer`; nothing is written."""

    def __init__(self) -> None:
        self.resets: list[bool] = []

    def __call__(self, name: str, log_level: int | None = None) -> _ProbeTimer:
        return _ProbeTimer(self.resets if name == "interval-time" else [])

    def log(self, *args, **kwargs) -> None:
        pass

    def write(self, *args, **kwargs) -> None:
        pass


def upstream_resets_first_interval_line(fn: Callable | None = None) -> bool | None:
    """Whether upstream's ``training_log`` (or ``fn``, called as upstream's) resets its interval
    statistics after the first line of a start when that first iteration is an interval boundary.

    Runs it once, in this process and without a job, as ``train()`` calls it at the first
    iteration after a start: iteration 2 with ``--log-interval 2``, ``is_first_iteration=True``,
    an empty ``loss_dict`` (no device tensors) and stand-ins for its collaborators (args, also
    ``global_vars.get_args``; timers, writers, microbatch calculator, model-parallel reduction,
    printing), all put back afterwards.

    Returns:
        True if after that line the iteration counters in ``total_loss_dict`` are 0 and the
        ``interval-time`` timer was reset (upstream behaves); False if they carry over into the
        next line (the defect: ``should_reset = not is_first_iteration``); None if no log line was
        printed (this probe cannot tell).

    Raises:
        Whatever upstream's function raises on the stand-ins (the caller cannot tell either).
    """
    from megatron.training import global_vars, training

    fn = fn or upstream_own(training.training_log)
    args = StandInArgs(
        log_interval=2,
        timing_log_level=0,
        micro_batch_size=1,
        data_parallel_size=1,
        gtp_weight_remat_size=1,
        world_size=1,
        seq_length=8,
        train_iters=10,
        consumed_train_samples=2,
        skipped_train_samples=0,
        tensorboard_log_interval=1,
        profile_ranks=[],
    )
    timers = _ProbeTimers()
    lines: list[str] = []
    total: dict = {}
    with (
        replaced(global_vars, get_args=lambda: args),
        replaced(
            training,
            get_args=lambda: args,
            get_timers=lambda: timers,
            get_tensorboard_writer=lambda: None,
            get_wandb_writer=lambda: None,
            get_one_logger=lambda: None,
            get_energy_monitor=lambda: None,
            get_telemetry=lambda: None,
            get_num_microbatches=lambda: 1,
            num_floating_point_operations=lambda *a, **k: 1.0,
            reduce_max_stat_across_model_parallel_group=lambda value, group=None: value,
            print_rank_last=lines.append,
            one_logger_utils=SimpleNamespace(
                track_app_tag=lambda *a, **k: None, track_e2e_metrics=lambda *a, **k: None
            ),
        ),
    ):
        fn(
            loss_dict={},
            total_loss_dict=total,
            learning_rate=1e-3,
            iteration=2,
            loss_scale=1.0,
            report_memory_flag=False,
            skipped_iter=0,
            grad_norm=None,
            params_norm=None,
            num_zeros_in_grad=None,
            max_attention_logit=None,
            pg_collection=None,
            is_first_iteration=True,
        )
    if not lines or not timers.resets:
        return None
    return all(total.get(k, 0) == 0 for k in _COUNTERS) and all(timers.resets)


class TrainingLogFix(Fix):
    name = "training_log"
    title = "printed loss of the first interval line after a start is reset like every other"
    upstream_refs = (
        "megatron-core training.py training_log: should_reset = not is_first_iteration",
    )
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.training.training.training_log",
            wrap_training_log,
            "the first log line after a start is not reset even when it is an interval "
            "line, so the next printed loss and time average two intervals",
            params=("iteration", "is_first_iteration"),
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """:func:`upstream_resets_first_interval_line` on upstream's own ``training_log``."""
        return upstream_resets_first_interval_line()


FIX = TrainingLogFix()
