"""Core attention for Multi-Latent Attention (MLA) on CPU, and the layer-spec swap that uses it.

Upstream's local spec (``get_gpt_layer_local_spec(multi_latent_attention=True)``) cannot build MLA:
``MultiLatentAttention`` builds its core attention with ``k_channels`` / ``v_channels`` (the
query/key head size ``qk_head_dim + qk_pos_emb_head_dim`` differs from the value head size
``v_head_dim``), which only ``TEDotProductAttention`` accepts; the local ``DotProductAttention``
raises ``TypeError: ... unexpected keyword argument 'k_channels'`` and assumes one head size
(``kv_channels``) for its output. :class:`CpuMLACoreAttention` takes MLA's signature and
computes attention with ``torch.nn.functional.scaled_dot_product_attention``, which allows a value
head size different from the query/key one.

:func:`cpu_mla_layer_spec` swaps it into a layer / block / MTP spec; with ``fuse_down_proj`` it also
turns ``MLASelfAttention`` into ``FusedMLASelfAttention`` (one ``linear_qkv_down_proj``,
``--mla-down-proj-fusion``), which the local spec cannot express either.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

# Same value upstream's local softmax writes into masked scores (attention_mask_func): a fully
# masked row then stays finite instead of NaN.
_MASKED_SCORE = -10000.0


class CpuMLACoreAttention(MegatronModule):
    """Scaled dot-product core attention with separate query/key and value head sizes.

    Shapes (``s``: sequence, ``b``: batch, ``n``: attention heads of this tensor-parallel rank):
        query ``[sq, b, n, dk]``, key ``[sk, b, g, dk]``, value ``[sk, b, g, dv]`` with ``g``
        dividing ``n`` (MLA: ``g == n``); returns ``[sq, b, n * dv]`` in the query's dtype.

    Masking as upstream's local ``DotProductAttention``: a given boolean ``attention_mask``
    (``True`` = masked, broadcastable to ``[b, n, sq, sk]``) is used as is; without one, causal
    attention masks future keys (bottom-right aligned when ``sq != sk``). Masked scores get
    ``-10000`` added. Dropout (``config.attention_dropout`` unless ``attention_dropout`` is given)
    applies in training, drawn inside the model-parallel RNG tracker like upstream (and, under the
    CPU backend, from its "CUDA" generator).

    Raises:
        NotImplementedError: context parallelism, packed (THD) sequences, attention bias, sliding
            windows, softmax types other than ``vanilla``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        **unused: Any,
    ):
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) != 1:
            raise NotImplementedError("CpuMLACoreAttention: context parallelism is not supported")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"CpuMLACoreAttention: softmax_type {config.softmax_type}")
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("CpuMLACoreAttention: sliding-window attention")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.k_channels**-0.5
        self.dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.pg_collection = pg_collection

    def _dropout_context(self):
        from megatron.core import tensor_parallel

        stack = contextlib.ExitStack()
        if not self.config.sequence_parallel:
            stack.enter_context(tensor_parallel.get_cuda_rng_tracker().fork())
        try:
            from megatron.cpu import runtime
        except ImportError:  # pragma: no cover - runtime is part of this package
            runtime = None
        if runtime is not None and runtime.is_active():
            stack.enter_context(runtime.cuda_generator_as_default())
        return stack

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
        **unused: Any,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("CpuMLACoreAttention: packed (THD) sequences")
        if attention_bias is not None:
            raise NotImplementedError("CpuMLACoreAttention: attention bias")
        sq, b, n, _ = query.shape
        sk, groups = key.size(0), key.size(2)
        if groups != n:
            key = key.repeat_interleave(n // groups, dim=2)
            value = value.repeat_interleave(n // groups, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, n, sq, dk]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)  # [b, n, sk, dv]

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        masked = attention_mask
        if masked is None and mask_type == AttnMaskType.causal and sq > 1:
            masked = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu_(1 + sk - sq)
        bias = None
        if masked is not None:
            if masked.dtype == torch.bool:
                bias = torch.zeros(masked.shape, dtype=q.dtype, device=q.device)
                bias.masked_fill_(masked, _MASKED_SCORE)
            else:
                bias = masked.to(q.dtype)

        dropout = self.dropout_p if self.training else 0.0
        context = contextlib.nullcontext() if dropout == 0.0 else self._dropout_context()
        with context:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=dropout, scale=self.softmax_scale
            )
        # [b, n, sq, dv] -> [sq, b, n * dv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, n * out.size(-1))


def _is_mla(module: Any) -> bool:
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return isinstance(module, type) and issubclass(module, MultiLatentAttention)


def _swap(node: Any, fuse_down_proj: bool, seen: dict) -> Any:
    from megatron.core.transformer.spec_utils import ModuleSpec

    if id(node) in seen:
        return seen[id(node)]
    if isinstance(node, ModuleSpec):
        seen[id(node)] = node
        if _is_mla(node.module) and node.submodules is not None:
            subs = node.submodules
            if hasattr(subs, "core_attention"):
                subs.core_attention = CpuMLACoreAttention
            if fuse_down_proj:
                from megatron.core.tensor_parallel.layers import ColumnParallelLinear
                from megatron.core.transformer.multi_latent_attention import (
                    FusedMLASelfAttention,
                    MLASelfAttention,
                )

                if node.module is MLASelfAttention:
                    node.module = FusedMLASelfAttention
                    subs.linear_qkv_down_proj = ColumnParallelLinear
                    subs.linear_q_down_proj = None
                    subs.linear_kv_down_proj = None
        if node.submodules is not None:
            node.submodules = _swap(node.submodules, fuse_down_proj, seen)
        return node
    if isinstance(node, (list, tuple)):
        out = type(node)(_swap(x, fuse_down_proj, seen) for x in node)
        seen[id(node)] = out
        return out
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        seen[id(node)] = node
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if isinstance(value, (ModuleSpec, list, tuple)) or (
                dataclasses.is_dataclass(value) and not isinstance(value, type)
            ):
                setattr(node, f.name, _swap(value, fuse_down_proj, seen))
        return node
    return node


def cpu_mla_layer_spec(spec: Any, *, fuse_down_proj: bool = False) -> Any:
    """A copy of ``spec`` in which every MLA attention uses :class:`CpuMLACoreAttention`.

    Args:
        spec: a layer ``ModuleSpec`` (e.g.
            ``get_gpt_layer_local_spec(multi_latent_attention=True)``),
            ``TransformerLayerSubmodules``, a block spec with ``layer_specs``, or an MTP block
            spec; walked recursively through ``ModuleSpec.submodules``, dataclass fields and lists.
        fuse_down_proj: also replace ``MLASelfAttention`` by ``FusedMLASelfAttention`` with a
            ``ColumnParallelLinear`` ``linear_qkv_down_proj`` (``--mla-down-proj-fusion``; the input
            layernorm stays a separate module on CPU, as upstream without Transformer Engine).

    Returns:
        The modified deep copy (``spec`` itself is left unchanged; module classes are shared).
        Specs without MLA come back equal to the input.
    """
    return _swap(copy.deepcopy(spec), fuse_down_proj, {})
