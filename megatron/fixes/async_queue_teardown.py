"""Fix: every ``--async-save`` run ends with ``Exception ignored in AsyncCallsQueue.__del__``.

megatron-core 0.19.2's ``megatron.training.async_utils.maybe_finalize_async_save(terminate=True)``
closes the async calls queue but keeps it in the module global ``_async_calls_queue``. The closed
queue is then collected at interpreter teardown, where NVRx's ``AsyncCallsQueue.__del__`` closes
it again; with ``--async-ckpt-use-cpu-shm`` that close imports ``filesystem_async``, and the import
fails (``ImportError: sys.meta_path is None``): one traceback per rank at the end of a run that
succeeded.

The replacement runs upstream's function and, after a terminate, drops the closed queue from the
module global, so it is collected while imports still work (its second close finds nothing to do)
and the next save in the process builds a fresh queue instead of reusing a closed one. Detection
of a fixed upstream is by behaviour: upstream's own function, called with a stand-in queue and
``terminate=True``, no longer holds that queue afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import warnings
from typing import Callable

from megatron.fixes.standins import StandInArgs, replaced, upstream_own
from megatron.overlay import Fix, Patch, alias_of
from megatron.overlay.registry import wraps_upstream

_MODULE = "megatron.training.async_utils"


def wrap_maybe_finalize_async_save(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.async_utils.maybe_finalize_async_save``:
    upstream's; after ``terminate=True`` the closed queue is dropped from ``_async_calls_queue``."""

    @wraps_upstream(upstream)
    def maybe_finalize_async_save(blocking: bool = False, terminate=False):
        """Upstream's; a terminated queue is no longer kept in the module global
        (megatron.fixes.async_queue_teardown: it would be closed again at interpreter teardown,
        where NVRx's close cannot import)."""
        au = importlib.import_module(_MODULE)
        queue = au._async_calls_queue
        upstream(blocking=blocking, terminate=terminate)
        if terminate and queue is not None and au._async_calls_queue is queue:
            au._async_calls_queue = None

    return maybe_finalize_async_save


class _StandInQueue:
    """Records what upstream's finalisation does to the calls queue."""

    def __init__(self) -> None:
        self.closed = False

    def maybe_finalize_async_calls(self, blocking=False, no_dist=False):
        return []

    def get_num_unfinalized_calls(self) -> int:
        return 0

    def close(self, abort=False) -> None:
        self.closed = True


def upstream_keeps_closed_queue(fn: Callable | None = None) -> bool | None:
    """Whether upstream's ``maybe_finalize_async_save`` (or ``fn``) keeps the queue it closed with
    ``terminate=True`` in ``_async_calls_queue`` (the defect). ``None`` when it did not close the
    stand-in queue at all (the probe cannot tell)."""
    au = importlib.import_module(_MODULE)
    fn = fn or upstream_own(au.maybe_finalize_async_save)
    queue = _StandInQueue()
    args = StandInArgs(async_save=True)
    with (
        replaced(au, _async_calls_queue=queue, get_args=lambda: args),
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # upstream's rank lookup warns without a group
        fn(blocking=True, terminate=True)
        kept = au._async_calls_queue is queue
    if not queue.closed:
        return None
    return kept


class AsyncQueueTeardownFix(Fix):
    name = "async_queue_teardown"
    title = "an --async-save run ends without 'Exception ignored in AsyncCallsQueue.__del__'"
    upstream_refs = (
        "megatron-core megatron/training/async_utils.py maybe_finalize_async_save(terminate=True) "
        "keeps the closed queue; NVRx AsyncCallsQueue.__del__ closes it again at teardown",
    )
    package = "megatron-core"

    patches = (
        Patch(
            f"{_MODULE}.maybe_finalize_async_save",
            wrap_maybe_finalize_async_save,
            "the queue closed by terminate=True stays in the module global and is closed again "
            "at interpreter teardown, where NVRx's close fails to import (a traceback per rank)",
            params=("blocking", "terminate"),
        ),
        Patch(
            "megatron.training.training.maybe_finalize_async_save",
            alias_of(f"{_MODULE}.maybe_finalize_async_save", only_if_same=True),
            "train() and pretrain() call it through that name",
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """Upstream's own function with a stand-in queue (:func:`upstream_keeps_closed_queue`):
        behaves if it no longer holds the queue it closed."""
        kept = upstream_keeps_closed_queue()
        return None if kept is None else not kept


FIX = AsyncQueueTeardownFix()
