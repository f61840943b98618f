"""Fix: a planned exit on a non-persistent save iteration writes no persistent checkpoint.

megatron-core 0.19.2's ``megatron.training.training.checkpoint_and_decide_exit`` keeps one flag,
``saved_checkpoint``, for its regular persistent and non-persistent saves; the exits of
``--exit-interval`` and ``--exit-duration-in-mins`` save only when it is unset. An exit on an
iteration where a non-persistent (local or global) checkpoint was just saved therefore leaves the
persistent directory at an older iteration: the next allocation (other nodes, local storage gone)
resumes from there and the iterations since are lost (Megatron-Bridge PR 5922 fixed the same
logic in Bridge; upstream main still has it).

The replacement wraps ``checkpoint_and_decide_exit`` and records, through a wrapper of
``training.save_checkpoint_and_time`` (the name it saves through), whether a persistent save of
the iteration happened. When upstream decides to exit and ``--save`` is set but no persistent
checkpoint of that iteration was written, it writes one before returning, through the same
``save_checkpoint_and_time`` upstream uses (every rank reaches it: upstream's exit decision is
agreed on every rank). A SIGTERM exit with ``--exit-signal-handler`` saves persistently upstream
already; the wrapper sees that save and adds nothing.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import Callable

from megatron.fixes.standins import StandInArgs, replaced, upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

_TRAINING = "megatron.training.training"


@dataclass
class _Saves:
    """The persistent saves seen during one ``checkpoint_and_decide_exit`` call (iterations)."""

    persistent: list = field(default_factory=list)
    active: bool = False


_SAVES = _Saves()


def _is_persistent(kwargs: dict) -> bool:
    return not kwargs.get("non_persistent_ckpt", False)


def wrap_save_checkpoint_and_time(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.training.save_checkpoint_and_time``:
    upstream's, recording the iteration (int, first argument) of each persistent save
    (``non_persistent_ckpt`` false) made while ``checkpoint_and_decide_exit`` runs."""

    @wraps_upstream(upstream)
    def save_checkpoint_and_time(iteration, *args, **kwargs):
        """Upstream's; a persistent save inside ``checkpoint_and_decide_exit`` is recorded."""
        result = upstream(iteration, *args, **kwargs)
        if _SAVES.active and _is_persistent(kwargs):
            _SAVES.persistent.append(iteration)
        return result

    return save_checkpoint_and_time


def wrap_checkpoint_and_decide_exit(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.training.checkpoint_and_decide_exit``:
    upstream's; when it returns True (exit) with ``--save`` set and no persistent checkpoint of
    ``iteration`` was saved during the call, one is saved (``save_checkpoint_and_time`` without
    ``non_persistent_ckpt``) before True is returned. Returns upstream's bool unchanged."""
    from megatron.training import training as training_module

    @wraps_upstream(upstream)
    def checkpoint_and_decide_exit(
        model,
        optimizer,
        opt_param_scheduler,
        iteration,
        num_floating_point_operations_so_far,
        checkpointing_context,
        train_data_iterator,
    ):
        """Upstream's; a planned exit always leaves a persistent checkpoint of ``iteration``."""
        _SAVES.persistent.clear()
        _SAVES.active = True
        try:
            should_exit = upstream(
                model,
                optimizer,
                opt_param_scheduler,
                iteration,
                num_floating_point_operations_so_far,
                checkpointing_context,
                train_data_iterator,
            )
        finally:
            _SAVES.active = False
        saved = iteration in _SAVES.persistent
        _SAVES.persistent.clear()
        if should_exit and not saved and getattr(training_module.get_args(), "save", None):
            training_module.save_checkpoint_and_time(
                iteration,
                model,
                optimizer,
                opt_param_scheduler,
                num_floating_point_operations_so_far,
                checkpointing_context,
                train_data_iterator=train_data_iterator,
            )
        return should_exit

    return checkpoint_and_decide_exit


def upstream_saves_persistent_on_exit(fn: Callable | None = None) -> bool | None:
    """Whether upstream's ``checkpoint_and_decide_exit`` (or ``fn``) writes a persistent
    checkpoint when ``--exit-interval`` lands on a non-persistent save iteration (stand-in args:
    ``--save-interval 10 --non-persistent-save-interval 4 --exit-interval 12``, iteration 12; its
    saves and prints replaced by recorders, nothing written).

    Returns:
        ``False`` on megatron-core 0.19.2 and upstream main (the defect: one non-persistent save,
        then exit); ``True`` when a persistent save of iteration 12 is made; ``None`` when it does
        not decide to exit (the probe cannot tell).
    """
    from megatron.training import training as training_module

    fn = fn or upstream_own(training_module.checkpoint_and_decide_exit)
    args = StandInArgs(
        save="probe-not-written",
        save_interval=10,
        non_persistent_save_interval=4,
        exit_interval=12,
        exit_signal_handler=False,
        exit_duration_in_mins=None,
    )
    saves: list[tuple[int, bool]] = []

    def record(iteration, *a, **kw):
        saves.append((iteration, _is_persistent(kw)))

    with (
        contextlib.redirect_stdout(io.StringIO()),
        replaced(
            training_module,
            get_args=lambda: args,
            get_timers=lambda: None,
            save_checkpoint_and_time=record,
            print_datetime=lambda *a, **k: None,
        ),
    ):
        should_exit = fn(None, None, None, 12, 0.0, {}, None)
    if not should_exit:
        return None
    return (12, True) in saves


class PlannedExitSaveFix(Fix):
    name = "planned_exit_save"
    title = "a planned exit leaves a persistent checkpoint of its iteration, whatever tier saved"
    upstream_refs = (
        "Megatron-Bridge PR 5922 (checkpoint_and_decide_exit: one saved_checkpoint flag for "
        "persistent and non-persistent saves)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            f"{_TRAINING}.save_checkpoint_and_time",
            wrap_save_checkpoint_and_time,
            "records which iterations were saved persistently, so that a planned exit can tell "
            "a non-persistent save from a persistent one",
            params=("iteration",),
        ),
        Patch(
            f"{_TRAINING}.checkpoint_and_decide_exit",
            wrap_checkpoint_and_decide_exit,
            "--exit-interval / --exit-duration-in-mins on a non-persistent save iteration exit "
            "without a persistent checkpoint: the next allocation loses the iterations since the "
            "last persistent save",
            params=(
                "model",
                "optimizer",
                "opt_param_scheduler",
                "iteration",
                "num_floating_point_operations_so_far",
                "checkpointing_context",
                "train_data_iterator",
            ),
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """Upstream's own ``checkpoint_and_decide_exit`` on stand-in args
        (:func:`upstream_saves_persistent_on_exit`): behaves when its exit at a non-persistent
        save iteration saves persistently."""
        return upstream_saves_persistent_on_exit()


FIX = PlannedExitSaveFix()
