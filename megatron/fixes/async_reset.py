"""Fix: after an aborted async save, the next save consumes the aborted one's write results.

megatron-core 0.19.2's ``megatron.training.async_utils.reset_persistent_async_worker`` (called by
upstream's in-process restart, ``inprocess_restart.AbortCheckpoint``, to abort async checkpointing)
leaves the aborted save's write results in the real module-global results queue (the next save's
finalisation takes them, so its metadata describes other files), and rebuilds the queue without
``--async-ckpt-use-cpu-shm`` (on CPU the worker then initialises CUDA and dies).

Design notes: ``docs/fixes/async_reset.md``.
"""

from __future__ import annotations

import importlib
import inspect
import types
from typing import Callable

from megatron.overlay import Fix, Patch, alias_of, value
from megatron.overlay.registry import wraps_upstream

_MODULE = "megatron.training.async_utils"
#: Modules holding a module-global ``_results_queue`` (nvrx strategy, mcore strategy).
_QUEUE_MODULES = (
    "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)


def _queue_modules() -> list[types.ModuleType]:
    out = []
    for name in _QUEUE_MODULES:
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            continue
    return out


def drop_results_queues() -> int:
    """Shut down the manager of, and unset, the module-global write-results queue of each async
    strategy's ``filesystem_async`` module (NVRx and megatron-core), so that the next async save
    creates a fresh, empty queue (``get_write_results_queue``).

    Returns:
        How many queues were dropped (0 when none had been created).
    """
    dropped = 0
    for module in _queue_modules():
        queue = getattr(module, "_results_queue", None)
        if queue is None:
            continue
        manager = getattr(queue, "_manager", None)
        if manager is not None:
            try:
                manager.shutdown()
            except Exception:  # noqa: BLE001 - already shut down (upstream's own reset reached it)
                pass
        module._results_queue = None
        dropped += 1
    return dropped


def wrap_reset_persistent_async_worker(upstream: Callable) -> Callable:
    """Factory of the replacement of
    ``megatron.training.async_utils.reset_persistent_async_worker``: upstream's abort of async
    checkpointing, then :func:`drop_results_queues`."""

    @wraps_upstream(upstream)
    def reset_persistent_async_worker(async_strategy):
        """Upstream's abort of async checkpointing, then the real write-results queues dropped
        (:func:`megatron.fixes.async_reset.drop_results_queues`): the next save starts from an
        empty queue instead of consuming the aborted save's results."""
        upstream(async_strategy)
        drop_results_queues()

    return reset_persistent_async_worker


def _get_async_calls_queue():
    """Get or lazily build the async calls queue, with ``cpu_shm_mode`` from
    ``--async-ckpt-use-cpu-shm`` as ``init_persistent_async_worker`` builds it
    (megatron.fixes.async_reset)."""
    au = importlib.import_module(_MODULE)
    if au._async_calls_queue is None:
        args = au.get_args()
        strategy, modules = au.get_async_strategy(getattr(args, "async_strategy", "nvrx"))
        cls = modules["AsyncCallsQueue"]
        kwargs = {}
        if (
            strategy == "nvrx"
            and getattr(args, "async_ckpt_use_cpu_shm", False)
            and "cpu_shm_mode" in inspect.signature(cls.__init__).parameters
        ):
            kwargs["cpu_shm_mode"] = True
        au._async_calls_queue = cls(
            persistent=getattr(args, "use_persistent_ckpt_worker", False), **kwargs
        )
    return au._async_calls_queue


class _ProbeManager:
    def shutdown(self) -> None:
        pass


class _ProbeQueue:
    _manager = _ProbeManager()


class AsyncResetFix(Fix):
    name = "async_reset"
    title = "an aborted async save leaves nothing behind for the next save"
    upstream_refs = (
        "megatron-core megatron/training/async_utils.py reset_persistent_async_worker "
        "(resets an import-time alias of filesystem_async._results_queue) and "
        "_get_async_calls_queue (drops --async-ckpt-use-cpu-shm)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            f"{_MODULE}.reset_persistent_async_worker",
            wrap_reset_persistent_async_worker,
            "the module-global results queue keeps the aborted save's write results, "
            "which the next save's finalisation takes: its metadata describes other files",
            params=("async_strategy",),
        ),
        Patch(
            f"{_MODULE}._get_async_calls_queue",
            value(_get_async_calls_queue),
            "the queue rebuilt after a reset drops --async-ckpt-use-cpu-shm: on CPU its "
            "worker initialises CUDA, dies, and the trainer waits for it forever",
        ),
        Patch(
            "megatron.training.inprocess_restart.reset_persistent_async_worker",
            alias_of(f"{_MODULE}.reset_persistent_async_worker"),
            "in-process restart's AbortCheckpoint calls it through that name",
        ),
    )

    def upstream_behaves(self) -> bool:
        au = importlib.import_module(_MODULE)
        return self._reset_drops_real_queue(au) and self._rebuild_keeps_cpu_shm(au)

    @staticmethod
    def _reset_drops_real_queue(au) -> bool:
        modules = _queue_modules()
        saved = (
            [m._results_queue for m in modules],
            au._async_calls_queue,
            getattr(au, "_results_queue", None),
        )
        try:
            for m in modules:
                m._results_queue = _ProbeQueue()
            au._async_calls_queue = None
            au._results_queue = None  # upstream's alias: must not reach a real queue here
            au.reset_persistent_async_worker("mcore")
            return all(m._results_queue is None for m in modules)
        finally:
            for m, q in zip(modules, saved[0]):
                m._results_queue = q
            au._async_calls_queue, au._results_queue = saved[1], saved[2]

    @staticmethod
    def _rebuild_keeps_cpu_shm(au) -> bool:
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        try:
            _, modules = get_async_strategy("nvrx")
        except Exception:  # noqa: BLE001 - no NVRx: only the mcore strategy, without the flag
            return True
        cls = modules["AsyncCallsQueue"]
        if "cpu_shm_mode" not in inspect.signature(cls.__init__).parameters:
            return True
        args = types.SimpleNamespace(
            async_strategy="nvrx", use_persistent_ckpt_worker=True, async_ckpt_use_cpu_shm=True
        )
        seen = {}

        class Probe:
            def __init__(self, persistent=True, cpu_shm_mode=False, **kwargs):
                seen["cpu_shm_mode"] = cpu_shm_mode

        saved = au._async_calls_queue
        saved_get_args, saved_strategy = au.get_args, au.get_async_strategy
        try:
            au._async_calls_queue = None
            au.get_args = lambda: args
            au.get_async_strategy = lambda *a, **k: ("nvrx", {**modules, "AsyncCallsQueue": Probe})
            au._get_async_calls_queue()
            return bool(seen.get("cpu_shm_mode"))
        finally:
            au._async_calls_queue = saved
            au.get_args, au.get_async_strategy = saved_get_args, saved_strategy


FIX = AsyncResetFix()
