"""ModelOpt's ``_modelopt_get_extra_state`` without ``torch.cuda.synchronize()`` on CPU machines.

nvidia-modelopt 0.47.0 ``modelopt.torch.opt.plugins.megatron._modelopt_get_extra_state`` (the
``get_extra_state`` ModelOpt binds to every quantized module) calls ``torch.cuda.synchronize()``
unconditionally before serialising the state, so ``state_dict()`` of any quantized module raises
on a machine without CUDA. The wrapper runs upstream's own code with ``torch.cuda.synchronize``
as a no-op when CUDA is not available, and upstream's function unchanged otherwise; it returns a
uint8 tensor (the pickled state) or ``None``, as upstream. Probe:
:func:`probe_upstream_syncs_without_cuda`.
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Any, Callable

import torch

from megatron.overlay import Fix
from megatron.overlay.registry import Patcher, wraps_upstream

logger = logging.getLogger(__name__)

_OPT_PLUGIN = "modelopt.torch.opt.plugins.megatron"


class _NoCudaError(Exception):
    """Raised by the probe's ``torch.cuda.synchronize``."""


class _CudaWithoutSync:
    """``torch.cuda`` as seen by one upstream function: ``synchronize`` is a no-op (or raises, for
    the probe), ``is_available`` may be forced to ``False``."""

    def __init__(self, sync_raises: bool = False) -> None:
        self._sync_raises = sync_raises

    def synchronize(self, *args, **kwargs) -> None:
        if self._sync_raises:
            raise _NoCudaError("torch.cuda.synchronize() called on a machine without CUDA")

    def is_available(self) -> bool:
        return False if self._sync_raises else torch.cuda.is_available()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithoutCudaSync:
    """``torch`` as seen by one upstream function, with :class:`_CudaWithoutSync` as ``cuda``."""

    def __init__(self, sync_raises: bool = False) -> None:
        self.cuda = _CudaWithoutSync(sync_raises)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _with_torch(fn: Callable, torch_proxy: Any) -> Callable:
    """The same code object as ``fn`` with the global name ``torch`` resolved to ``torch_proxy``."""
    return types.FunctionType(
        fn.__code__,
        {**fn.__globals__, "torch": torch_proxy},
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,
    )


def _wrap_get_extra_state(original: Callable) -> Callable:
    cpu_variant = _with_torch(original, _TorchWithoutCudaSync())

    @wraps_upstream(original)
    def get_extra_state(self):
        """ModelOpt's ``_modelopt_get_extra_state``; without CUDA, minus its
        ``torch.cuda.synchronize()``."""
        if torch.cuda.is_available():
            return original(self)
        return cpu_variant(self)

    return get_extra_state


def probe_upstream_syncs_without_cuda(get_extra_state: Callable) -> bool | None:
    """Run upstream's code for a module with one extra-state callback, as on a machine without
    CUDA (``torch.cuda.is_available()`` False, ``torch.cuda.synchronize()`` raising).

    Returns:
        True if it calls ``torch.cuda.synchronize()`` (nvidia-modelopt 0.47.0), False if it
        serialises the state without it, None if the probe cannot run.
    """
    module = types.SimpleNamespace(
        modelopt_get_extra_state_callbacks=[lambda m: {"probe": {"num_bits": 8}}]
    )
    try:
        state = _with_torch(get_extra_state, _TorchWithoutCudaSync(sync_raises=True))(module)
    except _NoCudaError:
        return True
    except Exception as e:  # noqa: BLE001 - a probe that cannot run proves nothing
        logger.info("extra-state probe could not run: %r", e)
        return None
    return False if isinstance(state, torch.Tensor) else None


class ExtraStateCudaSyncFix(Fix):
    """``state_dict()`` of a ModelOpt-quantized module works without CUDA."""

    name = "modelopt_moe.extra_state_cuda_sync"
    title = "ModelOpt extra state serialised without torch.cuda.synchronize() when CUDA is absent"
    upstream_refs = (
        "nvidia-modelopt _modelopt_get_extra_state: unconditional torch.cuda.synchronize()",
    )
    package = "nvidia-modelopt"

    def upstream_behaves(self) -> bool:
        """Upstream behaves if its ``_modelopt_get_extra_state`` serialises the state without
        calling ``torch.cuda.synchronize()`` when CUDA is absent."""
        try:
            opt_plugin = __import__(_OPT_PLUGIN, fromlist=["_modelopt_get_extra_state"])
        except ImportError:
            return False
        fn = inspect.unwrap(opt_plugin._modelopt_get_extra_state)  # upstream's own
        return probe_upstream_syncs_without_cuda(fn) is False

    def install(self, patcher: Patcher) -> None:
        opt_plugin = __import__(_OPT_PLUGIN, fromlist=["_modelopt_get_extra_state"])
        patcher.replace(
            opt_plugin,
            "_modelopt_get_extra_state",
            _wrap_get_extra_state(opt_plugin._modelopt_get_extra_state),
            why="it called torch.cuda.synchronize() unconditionally, so state_dict() of any "
            "quantized module failed on a machine without CUDA",
        )


FIX = ExtraStateCudaSyncFix()
