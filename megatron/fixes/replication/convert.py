"""What a local checkpoint stores for each tensor: metadata checks, dequantization, densification.

:func:`check_tensor` refuses, by metadata only, tensors whose bytes cannot be stored faithfully
(meta, sparse, PyTorch-native quantized, tensor subclasses with their own ``__torch_dispatch__``
but no ``dequantize``). :func:`prepare_tensor` turns an accepted tensor into a plain C-contiguous
tensor of its nominal dtype and shape (Transformer Engine ``Float8Tensor`` / ``MXFP8Tensor`` are
dequantized, non-dense views made contiguous). :func:`prepare_owned` does both for a rank's whole
state dict before ``replicate`` sends anything.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from megatron.integrity.checksum import tensor as ck
from megatron.integrity.tensors import is_quantized
from megatron.overlay.collective import RankFailures


class UnsupportedTensorError(ValueError, RankFailures):
    """A tensor of a local checkpoint cannot be replicated faithfully.

    Raised on every rank of the replication group before any data is sent or any file written;
    the message names the key and the rank that holds it (``failures``: global rank -> reasons).
    :func:`prepare_tensor` raises it on one rank, with empty ``failures``.
    """

    def __init__(self, message: str, failures: Optional[dict] = None) -> None:
        RankFailures.__init__(self, message, failures)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

DTYPES = {ck.dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
"""Record dtype name -> ``torch.dtype`` (every dtype torch defines)."""
_DTYPE_NAMES = {d: n for n, d in DTYPES.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    return ck.dtype_name(dtype) if name is None else name


def _has_custom_dispatch(t: torch.Tensor) -> bool:
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _describe(key: str) -> str:
    return f"'{key}'"


def check_tensor(key: str, t: Any) -> Optional[str]:
    """Metadata check of one checkpoint tensor (no data is read).

    Returns:
        ``None`` if :func:`prepare_tensor` can convert it faithfully, else the reason, naming
        ``key``.
    """
    if not isinstance(t, torch.Tensor):
        return f"tensor {_describe(key)} is a {type(t).__name__}, not a torch.Tensor"
    if t.device.type == "meta":
        return f"tensor {_describe(key)} is on the meta device (it holds no data)"
    if is_quantized(t):
        return None  # dequantized by prepare_tensor
    if _has_custom_dispatch(t):
        return (
            f"tensor {_describe(key)} is a {type(t).__module__}.{type(t).__qualname__}: a tensor "
            "subclass with its own __torch_dispatch__ but no dequantize(); its bytes cannot be "
            "carried faithfully"
        )
    if t.layout is not torch.strided:
        return (
            f"tensor {_describe(key)} has layout {t.layout}; only dense (strided) tensors "
            "are supported"
        )
    if t.is_quantized:
        return (
            f"tensor {_describe(key)} is a PyTorch-native quantized tensor ({t.dtype}); "
            "not supported"
        )
    return None


def _dequantize(key: str, t: torch.Tensor) -> torch.Tensor:
    out = t.dequantize()
    if not isinstance(out, torch.Tensor) or is_quantized(out) or _has_custom_dispatch(out):
        raise UnsupportedTensorError(
            f"{type(t).__name__}.dequantize() of tensor {_describe(key)} returned "
            f"{type(out).__name__}, not a plain tensor"
        )
    if tuple(out.shape) != tuple(t.shape):
        raise UnsupportedTensorError(
            f"{type(t).__name__}.dequantize() of tensor {_describe(key)} has shape "
            f"{tuple(out.shape)}, expected {tuple(t.shape)}"
        )
    return out if out.dtype == t.dtype else out.to(t.dtype)


def prepare_tensor(
    key: str, t: torch.Tensor, device: Optional[torch.device] = None
) -> Tuple[torch.Tensor, bool]:
    """What a checkpoint stores for ``t``: a plain, C-contiguous tensor of ``t``'s nominal dtype
    and shape.

    Args:
        key: name used in error messages.
        t: a tensor that passed :func:`check_tensor`. A quantized tensor is dequantized
            (``t.dequantize()``, cast to ``t.dtype`` if the result has another dtype); a
            non-contiguous one is copied to a contiguous tensor; a plain contiguous tensor is
            returned as it is.
        device: if given and different from the tensor's device, the result is copied there.

    Returns:
        ``(tensor, converted)``; ``converted`` is True when the result is a new tensor.

    Raises:
        UnsupportedTensorError: ``check_tensor`` refuses it, or ``dequantize()`` did not return
            a plain tensor of ``t``'s shape.
    """
    reason = check_tensor(key, t)
    if reason is not None:
        raise UnsupportedTensorError(reason)
    converted = is_quantized(t)
    out = _dequantize(key, t) if converted else t
    if not out.is_contiguous():
        out = out.contiguous()
        converted = True
    if device is not None and out.device != torch.device(device):
        out = out.to(device)
        converted = True
    if converted:
        out = out.detach()
    return out, converted


def _tensor_names(state_dict: Any, count: int) -> List[Tuple[str, Optional[Tuple[int, ...]]]]:
    """(key, global_offset) per tensor, in ``state_dict.tensors`` order (non-hollow)."""
    sharded = getattr(type(state_dict), "_sharded_tensors", None)
    if sharded is not None:
        names = [
            (str(sh.key), tuple(int(o) for o in sh.global_offset))
            for sh in state_dict._sharded_tensors
        ]
        if len(names) == count:
            return names
    return [(f"tensor[{i}]", None) for i in range(count)]


@dataclass
class Owned:
    """A rank's own tensors, checked and converted by :func:`prepare_owned`.

    Attributes:
        errors: why tensors were refused (empty when every tensor can be stored).
        stored: what the primary and the replicas hold, one per tensor (empty after an error).
        send_src: where each tensor's bytes are sent from (``stored[i]``, or the original when it
            is plain, dense and already on the communication device).
        entries: checksum-record entries (``checksum`` still ``None``).
        dequantized: ``"Float8Tensor -> bfloat16"`` -> count, for the log.
    """

    errors: List[str] = field(default_factory=list)
    stored: List[torch.Tensor] = field(default_factory=list)
    send_src: List[torch.Tensor] = field(default_factory=list)
    entries: List[dict] = field(default_factory=list)
    dequantized: collections.Counter = field(default_factory=collections.Counter)


def _convert_owned(
    key: str, t: Any, place: Optional[torch.device], out: Owned
) -> Optional[torch.Tensor]:
    """What ``t`` is stored as, or None (after appending to ``out.errors``) when it cannot be.
    Once a tensor is refused, the rest are only checked (nothing more is converted)."""
    if type(t) in _PLAIN_TYPES and t.is_contiguous() and (place is None or t.device == place):
        if t.device.type == "meta":  # the only refusal a plain dense tensor can hit
            out.errors.append(check_tensor(key, t))
            return None
        return t  # the common case: stored and sent as it is
    reason = check_tensor(key, t)
    if reason is not None:
        out.errors.append(reason)
        return None
    if out.errors:
        return None
    try:
        s, _ = prepare_tensor(key, t, place)
    except Exception as e:  # noqa: BLE001 - reported on every rank by replicate
        out.errors.append(f"tensor '{key}': {type(e).__name__}: {e}")
        return None
    if is_quantized(t):
        out.dequantized[f"{type(t).__name__} -> {_dtype_name(s.dtype)}"] += 1
    return s


def prepare_owned(
    state_dict: Any, originals: List[Any], place: Optional[torch.device], device: torch.device
) -> Owned:
    """Check and convert a rank's tensors, one at a time (peak extra memory: one tensor).

    Args:
        state_dict: the rank's ``TensorAwareStateDict`` (for the keys; not modified).
        originals: its tensors, in ``state_dict.tensors`` order.
        place: device the stored tensors must be on (``None``: where they are).
        device: the communication device.
    """
    out = Owned()
    names = _tensor_names(state_dict, len(originals))
    for i, ((key, offset), t) in enumerate(zip(names, originals)):
        s = _convert_owned(key, t, place, out)
        if s is None or out.errors:
            continue
        out.entries.append(
            {
                "index": i,
                "key": key,
                "global_offset": None if offset is None else list(offset),
                "dtype": _dtype_name(s.dtype),
                "shape": list(s.shape),
                "nbytes": s.numel() * s.element_size(),
                "checksum": None,  # filled in while the bytes are on the wire
            }
        )
        out.stored.append(s)
        # A plain dense tensor already on the communication device is sent from its own memory
        # even when the stored copy went to another device (no copy back).
        plain_here = type(t) in _PLAIN_TYPES and t.device == device and t.is_contiguous()
        out.send_src.append(t if s is not t and plain_here else s)
    return out
