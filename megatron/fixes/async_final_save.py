"""Fix: the final save after training restarts the persistent async checkpoint worker.

megatron-core 0.19.2's ``train()`` ends with ``maybe_finalize_async_save(blocking=True,
terminate=True)`` whether or not the run is about to exit: the persistent checkpoint worker is
shut down, and when ``train()`` returns, ``pretrain()``'s final save (the last iteration, when
it is not a multiple of ``--save-interval``) spawns a new one and waits for it: 7.2-9.4 s of
blocking against about 0.15 s for a save inside the loop (Megatron-LM PR 6767, which terminates
only when ``train()`` exits the process).

The replacements: ``train()`` runs with the terminate of its end-of-training finalisation deferred
(every pending save is still finalised, blocking); when ``train()`` leaves through ``sys.exit``
(a planned exit), the deferred terminate happens on the way out; when it returns, the worker
stays up for ``pretrain()``'s final save, and ``pretrain()``'s own finalisation (after the final
save and the evaluation) terminates it. One worker per run. Detection of a fixed upstream is by
behaviour: upstream's own ``train`` is not run (it needs a whole model); the probe cannot tell,
so the fix is active on the proven versions (on a fixed upstream the deferral is a no-op: no
terminate inside ``train()`` is left to defer).
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable

from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

_TRAINING = "megatron.training.training"
_ASYNC = "megatron.training.async_utils"

#: ``depth``: how many ``train()`` calls are running; ``owed``: a terminate was deferred.
_STATE = threading.local()


def _depth() -> int:
    return getattr(_STATE, "depth", 0)


def terminate_now() -> None:
    """The deferred terminate: ``megatron.training.async_utils.maybe_finalize_async_save(
    blocking=True, terminate=True)`` through the module (the fixes' replacements included)."""
    _STATE.owed = False
    importlib.import_module(_ASYNC).maybe_finalize_async_save(blocking=True, terminate=True)


def wrap_finalize_in_training(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.training.maybe_finalize_async_save``
    (the name ``train()`` and ``pretrain()`` call): inside ``train()``, ``terminate=True`` is
    deferred (the blocking finalisation still runs); elsewhere upstream's as it is."""

    @wraps_upstream(upstream)
    def maybe_finalize_async_save(blocking: bool = False, terminate=False):
        """Upstream's; inside train() the worker is not terminated (megatron.fixes.async_final_save:
        pretrain() saves once more after train() returns)."""
        if terminate and _depth() > 0:
            upstream(blocking=blocking, terminate=False)
            _STATE.owed = True
            return
        upstream(blocking=blocking, terminate=terminate)

    return maybe_finalize_async_save


def wrap_train(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.training.train``: upstream's, with the
    terminate of its end-of-training finalisation deferred; paid on a ``SystemExit`` out of it."""

    @wraps_upstream(upstream)
    def train(*args, **kwargs):
        """Upstream's train(); the checkpoint worker outlives it for pretrain()'s final save
        (megatron.fixes.async_final_save), and is terminated when train() exits the process."""
        _STATE.depth = _depth() + 1
        try:
            return upstream(*args, **kwargs)
        except SystemExit:
            if getattr(_STATE, "owed", False):
                terminate_now()
            raise
        finally:
            _STATE.depth = _depth() - 1

    return train


class AsyncFinalSaveFix(Fix):
    name = "async_final_save"
    title = "one persistent async checkpoint worker per run: the final save does not respawn it"
    upstream_refs = (
        "Megatron-LM PR 6767 (train() terminates the persistent checkpoint worker; pretrain()'s "
        "final save starts a new one)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            f"{_TRAINING}.maybe_finalize_async_save",
            wrap_finalize_in_training,
            "train() terminates the persistent checkpoint worker although pretrain() saves "
            "again after it returns",
            params=("blocking", "terminate"),
        ),
        Patch(
            f"{_TRAINING}.train",
            wrap_train,
            "the deferred terminate is paid when train() exits the process (a planned exit)",
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """Cannot tell: the defect is in the order of upstream's ``train()`` and ``pretrain()``,
        which need a whole model to run; active on the proven versions."""
        return None


FIX = AsyncFinalSaveFix()
