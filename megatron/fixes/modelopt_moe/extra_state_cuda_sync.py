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
from unittest import mock

import torch

from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

logger = logging.getLogger(__name__)

_OPT_PLUGIN = "modelopt.torch.opt.plugins.megatron"


class _NoCudaError(Exception):
    """Raised by the probe's ``torch.cuda.synchronize``."""


class _CudaWithoutSync:
    """``torch.cuda`` as seen by the CPU variant of the upstream function: ``synchronize`` is a
    no-op; everything else is ``torch.cuda``'s."""

    def synchronize(self, *args, **kwargs) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithoutCudaSync:
    """``torch`` as seen by one upstream function, with :class:`_CudaWithoutSync` as ``cuda``."""

    def __init__(self) -> None:
        self.cuda = _CudaWithoutSync()

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
    """Factory of the replacement of ModelOpt's ``_modelopt_get_extra_state`` (``original``):
    upstream's code, with ``torch.cuda.synchronize()`` a no-op when CUDA is not available."""
    cpu_variant = _with_torch(original, _TorchWithoutCudaSync())

    @wraps_upstream(original)
    def get_extra_state(self):
        """ModelOpt's ``_modelopt_get_extra_state``; without CUDA, minus its
        ``torch.cuda.synchronize()``."""
        if torch.cuda.is_available():
            return original(self)
        return cpu_variant(self)

    return get_extra_state


def _sync_without_cuda(*args, **kwargs) -> None:
    raise _NoCudaError("torch.cuda.synchronize() called on a machine without CUDA")


def probe_upstream_syncs_without_cuda(get_extra_state: Callable) -> bool | None:
    """Call ``get_extra_state`` (upstream's, or anything that calls it) for a stand-in module with
    one extra-state callback, as on a machine without CUDA: for the call,
    ``torch.cuda.is_available()`` returns False and ``torch.cuda.synchronize()`` raises (both put
    back afterwards, also on error).

    Returns:
        True if it calls ``torch.cuda.synchronize()`` (nvidia-modelopt 0.47.0), False if it
        serialises the state (a uint8 tensor) without it, None if the probe cannot run.
    """
    module = types.SimpleNamespace(
        modelopt_get_extra_state_callbacks=[lambda m: {"probe": {"num_bits": 8}}]
    )
    try:
        with (
            mock.patch.object(torch.cuda, "is_available", lambda: False),
            mock.patch.object(torch.cuda, "synchronize", _sync_without_cuda),
        ):
            state = get_extra_state(module)
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
    patches = (
        Patch(
            f"{_OPT_PLUGIN}._modelopt_get_extra_state",
            _wrap_get_extra_state,
            "it called torch.cuda.synchronize() unconditionally, so state_dict() of any "
            "quantized module failed on a machine without CUDA",
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """True if upstream's own ``_modelopt_get_extra_state`` serialises the state without
        calling ``torch.cuda.synchronize()`` when CUDA is absent, False if it calls it (or its
        module does not import), None if the probe cannot run
        (:func:`probe_upstream_syncs_without_cuda`)."""
        try:
            opt_plugin = __import__(_OPT_PLUGIN, fromlist=["_modelopt_get_extra_state"])
        except ImportError:
            return False
        fn = inspect.unwrap(opt_plugin._modelopt_get_extra_state)  # upstream's own
        syncs = probe_upstream_syncs_without_cuda(fn)
        return None if syncs is None else not syncs


FIX = ExtraStateCudaSyncFix()
