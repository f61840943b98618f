"""Tensor kinds the checkpoint paths treat specially."""

from __future__ import annotations

import torch

__all__ = ["is_quantized"]


def is_quantized(t: torch.Tensor) -> bool:
    """True for a quantized tensor subclass (Transformer Engine ``Float8Tensor``, ``MXFP8Tensor``,
    ...): its type defines its own ``dequantize``. Every tensor has ``Tensor.dequantize``, so
    ``hasattr`` is no test (the NaN replicas of TE quantized weights, NVIDIA/Megatron-LM local
    checkpoint replication, came from copying such tensors' raw storage)."""
    return type(t).dequantize is not torch.Tensor.dequantize
