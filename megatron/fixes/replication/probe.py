"""Capability probe of ``upstream_behaves()``: does the installed upstream ``replicate`` hand its
transport plain, dense tensors holding the dequantized / densified values?

It runs upstream's ``replicate`` on a one-rank stand-in group that records what reaches
``all_gather_batch``, with a tiny state dict holding a probe quantized tensor (a storage-less
wrapper subclass with its own ``dequantize``) and a non-contiguous view. NVRx 0.7.0 hands over
the quantized tensor itself. Any error (changed internals) counts as "does not behave".
"""

from __future__ import annotations

import logging
import pickle
from typing import Callable, List, Optional

import torch

logger = logging.getLogger("megatron.fixes.replication")


class _ProbeQuantized(torch.Tensor):
    """Storage-less wrapper subclass with its own ``dequantize``: int8 payload * scale."""

    @staticmethod
    def __new__(cls, payload: torch.Tensor, scale: float):
        self = torch.Tensor._make_wrapper_subclass(cls, payload.shape, dtype=torch.float32)
        self._payload, self._scale = payload, scale
        return self

    def dequantize(self, *args, **kwargs):
        return self._payload.to(torch.float32) * self._scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.dequantize() if isinstance(x, _ProbeQuantized) else x

        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        return func(*args, **kwargs)


class _ProbeStateDict:
    """Minimal TensorAwareStateDict for the probe (duck-typed)."""

    def __init__(self, tensors):
        self._tensors = list(tensors)
        self._hollow = False

    @property
    def tensors(self):
        return iter(self._tensors)

    @property
    def is_hollow(self):
        return self._hollow

    def pop_tensors(self):
        out, self._tensors, self._hollow = self._tensors, [], True
        return out

    def insert_tensors(self, tensors):
        self._tensors, self._hollow = list(tensors), False

    def __getstate__(self):
        return {"_tensors": [], "_hollow": self._hollow}


class _RecordingGroup:
    """One-rank stand-in for ``GroupWrapper`` that records what reaches the transport."""

    world_size = 1
    my_group_rank = 0
    my_global_rank = 0
    ranks = [0]
    group = None
    backend = "gloo"

    def __init__(self):
        self.handed: List[torch.Tensor] = []

    def get_global_rank(self, group_rank=None):
        return 0

    def get_group_rank(self, global_rank=None):
        return 0

    def all_gather_object(self, obj):
        return [pickle.loads(pickle.dumps(obj))]

    def all_gather_batch(self, tensors, target_device=None):
        self.handed = list(tensors)
        return [[t for t in tensors]]


def upstream_handles_unfaithful_tensors(
    upstream_cls: Optional[type], replicate: Optional[Callable]
) -> bool:
    """Run ``replicate`` (upstream's, unbound) on an ``upstream_cls`` instance built without
    ``__init__``; True iff the transport got only plain, dense tensors with the right values."""
    if upstream_cls is None or replicate is None:
        return False
    payload = torch.tensor([[1, -2, 3], [4, 5, -6]], dtype=torch.int8)
    quantized = _ProbeQuantized(payload, 0.5)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    strided = base[:, ::2]
    expected = [quantized.dequantize(), strided.contiguous()]
    strategy = upstream_cls.__new__(upstream_cls)
    recorder = _RecordingGroup()
    strategy.local_group = recorder
    strategy.target_device = None
    try:
        replicate(strategy, _ProbeStateDict([quantized, strided]), "probe")
    except Exception as e:  # noqa: BLE001 - changed internals: treat as not behaving
        logger.debug("replication probe: upstream replicate raised %r", e)
        return False
    handed = recorder.handed
    if len(handed) != len(expected):
        return False
    for got, want in zip(handed, expected):
        if type(got) not in (torch.Tensor, torch.nn.Parameter) or not got.is_contiguous():
            return False
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False
    return True
