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

from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

_DEFECT = "should_reset = not is_first_iteration\n"


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

    def upstream_behaves(self) -> bool:
        from megatron.training import training

        return _DEFECT not in inspect.getsource(training.training_log)


FIX = TrainingLogFix()
