"""Test doubles for the replication fix: a stand-in for Transformer Engine's quantized parameters.

``FakeFloat8Tensor`` behaves, for everything NVRx's replication touches, the way TE's
``Float8Tensor`` does (TE ``transformer_engine/pytorch/tensor/quantized_tensor.py`` and
``float8_tensor.py``):

* a wrapper subclass (``torch.Tensor._make_wrapper_subclass``) with no storage of its own; it holds
  ``_data`` (uint8 holding float8_e4m3fn bits), ``_scale_inv`` (float32) and ``_quantizer``; its
  ``dtype`` is the nominal (dequantized) dtype;
* ``__torch_dispatch__`` turns ``empty_like`` into ``quantizer.make_empty(...)``: a real,
  uninitialised quantized tensor. "Uninitialised" is made deterministic: the payload is filled with
  0xFF (NaN in float8_e4m3fn) and the scale with NaN, so a replica that never receives data reads
  NaN, as reported in NVRx issue 349;
* mutable-schema ops dequantize, run, and re-quantize the written quantized arguments; every other
  op (including ``c10d::broadcast_``, whose schema is not mutable) runs on dequantized temporaries,
  so data *received* into a quantized tensor is thrown away, exactly like TE;
* ``dequantize()`` is defined (so ``type(t).dequantize is not torch.Tensor.dequantize``);
* pickling keeps the quantizer; ``FakeFloat8TensorNoQuantizer`` pickles without it (like TE's
  ``Float8Tensor.__reduce_ex__``), so a receiver's ``empty_like`` fails with ``AttributeError``
  on ``make_empty``.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class FakeQuantizer:
    """Per-tensor current-scaling float8 quantizer (the role of TE's ``Float8Quantizer``)."""

    def __init__(self, tensor_cls=None):
        self.tensor_cls = tensor_cls or FakeFloat8Tensor

    def quantize(self, t: torch.Tensor) -> "FakeFloat8Tensor":
        t = t.detach()
        amax = t.abs().max().float().clamp(min=1e-12) if t.numel() else torch.tensor(1.0)
        scale = FP8_MAX / amax
        data = (t.float() * scale).to(FP8).view(torch.uint8)
        return self.tensor_cls(data, (1.0 / scale).reshape(1).to(torch.float32), t.dtype, self)

    def make_empty(self, shape, dtype, device) -> "FakeFloat8Tensor":
        data = torch.empty(tuple(shape), dtype=torch.uint8, device=device).fill_(0xFF)
        scale_inv = torch.empty(1, dtype=torch.float32, device=device).fill_(float("nan"))
        return self.tensor_cls(data, scale_inv, dtype, self)


def _rebuild(cls, data, scale_inv, dtype, quantizer):
    return cls(data, scale_inv, dtype, quantizer)


class FakeFloat8Tensor(torch.Tensor):
    """Storage-less float8 tensor with TE's dispatch behaviour (see the module docstring)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, quantizer):
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )
        self._data = data
        self._scale_inv = scale_inv
        self._quantizer = quantizer
        return self

    def dequantize(self, *, dtype=None) -> torch.Tensor:
        dtype = self.dtype if dtype is None else dtype
        return (self._data.view(FP8).to(torch.float32) * self._scale_inv).to(dtype)

    def quantize_(self, src: torch.Tensor) -> "FakeFloat8Tensor":
        q = self._quantizer.quantize(src.to(self.dtype))
        self._data.copy_(q._data)
        self._scale_inv.copy_(q._scale_inv)
        return self

    def __repr__(self):
        return f"{type(self).__name__}(data={self.dequantize()})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.empty_like.default:
            src = args[0]
            return src._quantizer.make_empty(
                src.shape,
                dtype=kwargs.get("dtype") or src.dtype,
                device=kwargs.get("device") or src.device,
            )
        if func is aten.detach.default:
            src = args[0]
            return type(src)(src._data, src._scale_inv, src.dtype, src._quantizer)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, FakeFloat8Tensor):
                dst.quantize_(src.dequantize() if isinstance(src, FakeFloat8Tensor) else src)
            else:
                dst.copy_(src.dequantize() if isinstance(src, FakeFloat8Tensor) else src)
            return dst

        def unwrap(x):
            return x.dequantize() if isinstance(x, FakeFloat8Tensor) else x

        new_args = tree_map(unwrap, args)
        new_kwargs = tree_map(unwrap, kwargs)
        out = func(*new_args, **new_kwargs)
        if func._schema.is_mutable:
            for arg, new_arg, schema_arg in zip(args, new_args, func._schema.arguments):
                if (
                    isinstance(arg, FakeFloat8Tensor)
                    and schema_arg.alias_info is not None
                    and schema_arg.alias_info.is_write
                ):
                    arg.quantize_(new_arg)
        return out

    def __reduce_ex__(self, protocol):
        return (_rebuild, (type(self), self._data, self._scale_inv, self.dtype, self._quantizer))


class FakeFloat8TensorNoQuantizer(FakeFloat8Tensor):
    """Variant whose pickling drops the quantizer (TE ``Float8Tensor.__reduce_ex__``)."""

    def __reduce_ex__(self, protocol):
        return (_rebuild, (type(self), self._data, self._scale_inv, self.dtype, None))


def quantize(t: torch.Tensor, tensor_cls=FakeFloat8Tensor) -> FakeFloat8Tensor:
    """Quantize a plain tensor into a ``tensor_cls`` with a pickled (or dropped) quantizer."""
    return FakeQuantizer(tensor_cls).quantize(t)


class ListStateDict:
    """A TensorAwareStateDict that is just a list of tensors (no sharding validation, so ranks
    can hold different numbers of tensors)."""

    def __init__(self, tensors):
        self._tensors, self.is_hollow = list(tensors), False

    @property
    def tensors(self):
        return iter(self._tensors)

    def pop_tensors(self):
        out, self._tensors, self.is_hollow = self._tensors, [], True
        return out

    def insert_tensors(self, tensors):
        self._tensors, self.is_hollow = list(tensors), False
