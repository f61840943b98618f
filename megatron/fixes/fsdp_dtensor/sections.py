"""The q and kv sections of a fused MLA down projection, as DTensor views into its FSDP shard.

``FusedMLASelfAttention.linear_qkv_down_proj.weight`` has global shape ``[q_lora_rank +
kv_lora_rank + qk_pos_emb_head_dim, *row]``; with a column-parallel fused linear each TP rank holds
``[q/TP ; kv/TP]`` rows. :func:`split_fused` returns the sections ``[q_lora_rank, *row]`` and
``[kv_lora_rank + qk_pos_emb_head_dim, *row]`` (same dtype) as Megatron-FSDP DTensors whose local
tensors are views into the fused local shard, for any uneven shard (empty ``[0, *row]`` views
where a rank owns nothing of a section), with DCP chunk metadata computed locally from
``megatron_fsdp_slice`` (no collectives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

FUSED = "linear_qkv_down_proj"
Q_SECTION = "linear_q_down_proj"
KV_SECTION = "linear_kv_down_proj"


def join_key(*parts: str) -> str:
    """``parts`` joined with ``.``, empty parts left out."""
    return ".".join(p for p in parts if p)


def intersect(a: slice, b: slice) -> slice:
    """Intersection of two step-1 half-open ranges; an empty result has ``start == stop``
    (``start`` is ``max(a.start, b.start)``, which may lie past either range)."""
    start = max(a.start, b.start)
    stop = min(a.stop, b.stop)
    return slice(start, max(start, stop))


@dataclass(frozen=True)
class MlaSectionSizes:
    """Row counts of the fused MLA down projection's sections.

    Attributes:
        q_rows: rows of the q section in the checkpoint (``q_lora_rank``).
        kv_rows: rows of the kv section in the checkpoint (``kv_lora_rank + qk_pos_emb_head_dim``).
        tp_parts: how many TP ranks split the fused weight along dim 0 (1 when it is
            TP-duplicated, e.g. ``TELinear(parallel_mode='duplicated')``, or TP = 1).
    """

    q_rows: int
    kv_rows: int
    tp_parts: int = 1

    @property
    def q_rows_local(self) -> int:
        """q rows held by one TP rank."""
        return self.q_rows // self.tp_parts

    @property
    def kv_rows_local(self) -> int:
        """kv rows held by one TP rank."""
        return self.kv_rows // self.tp_parts

    def element_ranges(self, row_numel: int) -> tuple[slice, slice]:
        """Element ranges of the q and kv sections in one TP rank's flattened fused weight (the
        coordinates of ``megatron_fsdp_slice``)."""
        q = self.q_rows_local * row_numel
        return slice(0, q), slice(q, q + self.kv_rows_local * row_numel)


def mla_section_sizes(
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_pos_emb_head_dim: int,
    fused_rows: int,
    tp_parts: int = 1,
    where: str = FUSED,
) -> MlaSectionSizes:
    """Section sizes of a fused down projection, checked against its weight.

    Args:
        fused_rows: dim 0 of the fused weight's *global* shape (sum over TP ranks).
        tp_parts: TP ranks the weight is split over along dim 0 (1: not split).
        where: name used in error messages.

    Raises:
        ValueError: ``fused_rows`` is not ``q_lora_rank + kv_lora_rank + qk_pos_emb_head_dim``, or
            a section does not divide by ``tp_parts``.
    """
    q, kv = int(q_lora_rank), int(kv_lora_rank) + int(qk_pos_emb_head_dim)
    if fused_rows != q + kv:
        raise ValueError(
            f"{where}: fused MLA down projection has {fused_rows} rows, expected q_lora_rank "
            f"({q}) + kv_lora_rank + qk_pos_emb_head_dim ({kv}) = {q + kv}"
        )
    if q % tp_parts or kv % tp_parts:
        raise ValueError(
            f"{where}: q section ({q} rows) and kv section ({kv} rows) must both divide by the "
            f"tensor-parallel size {tp_parts}"
        )
    return MlaSectionSizes(q, kv, tp_parts)


def section_view(
    local: torch.Tensor, fsdp_slice: slice, section: slice, row_shape: tuple[int, ...]
) -> tuple[torch.Tensor, int]:
    """This rank's part of one section, as a view into its FSDP shard.

    Args:
        local: this rank's shard of one TP rank's weight, any shape, contiguous, holding the
            elements ``fsdp_slice`` of that weight flattened (``megatron_fsdp_slice``).
        section: element range of the section in the same flattened weight.
        row_shape: shape of one row (``weight.shape[1:]``).

    Returns:
        ``(view, first_row)``: ``view`` has shape ``[rows, *row_shape]`` (``rows`` may be 0) and
        shares storage with ``local``; ``first_row`` is the section row where it starts.

    Raises:
        ValueError: the shard does not cover whole rows of the section, or ``local`` does not hold
            ``fsdp_slice``.
    """
    row_numel = math.prod(row_shape)
    if local.numel() != fsdp_slice.stop - fsdp_slice.start:
        raise ValueError(
            f"local shard has {local.numel()} elements but megatron_fsdp_slice {fsdp_slice} "
            f"spans {fsdp_slice.stop - fsdp_slice.start}"
        )
    flat = local.view(-1)
    inter = intersect(fsdp_slice, section)
    lo, hi = inter.start - fsdp_slice.start, inter.stop - fsdp_slice.start
    if hi == lo:
        return flat[0:0].view(0, *row_shape), 0
    if (hi - lo) % row_numel or (inter.start - section.start) % row_numel:
        raise ValueError(
            f"FSDP shard {fsdp_slice} does not hold whole rows ({row_numel} elements) of section "
            f"{section}"
        )
    return flat[lo:hi].view(-1, *row_shape), (inter.start - section.start) // row_numel


@dataclass(frozen=True)
class MlaModule:
    """One attention module with a fused down projection.

    Attributes:
        path: normalised module path, e.g. ``decoder.layers.0.self_attention``.
        parent: normalised path of the layer owning ``input_layernorm`` (``''`` at the root).
        q_rows / kv_rows: global section rows (``q_lora_rank`` / ``kv_lora_rank +
            qk_pos_emb_head_dim``).
        weight: the live fused weight (under Megatron-FSDP a DTensor parameter carrying
            ``megatron_fsdp_slice`` and ``megatron_fsdp_dist_index``).
    """

    path: str
    parent: str
    q_rows: int
    kv_rows: int
    weight: Any = field(compare=False, repr=False)


def _copy_tp_attributes(dst: torch.Tensor, src: torch.Tensor) -> None:
    from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes

    copy_tensor_model_parallel_attributes(dst, src)
    if hasattr(src, "_tensor_parallel_mode"):
        dst._tensor_parallel_mode = src._tensor_parallel_mode


def _attach_chunk(dtensor, offsets: tuple[int, ...]) -> None:
    """Give a DTensor with an uneven local shard its DCP chunk metadata (computed locally)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    local = dtensor._local_tensor
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape)
    for dim, (off, size) in enumerate(zip(offsets, local.shape)):
        if off < 0 or off + size > dtensor.shape[dim]:
            raise ValueError(f"chunk {offsets}+{tuple(local.shape)} outside {tuple(dtensor.shape)}")

    def create_chunk_list():
        return [chunk]

    def create_write_items(fqn, tensor):
        data = tensor.to_local()
        if data.numel() == 0:
            return []
        return [
            WriteItem(
                type=WriteItemType.SHARD,
                index=MetadataIndex(fqn, chunk.offsets),
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(data),
                    size=tensor.size(),
                ),
            )
        ]

    local.__create_chunk_list__ = create_chunk_list
    local.__create_write_items__ = create_write_items


def split_fused(value, module: MlaModule, key: str = "") -> dict[str, Any]:
    """Split one fused DTensor (the weight or an optimizer state of its shape) into its sections.

    Args:
        value: DTensor of global shape ``[q_rows + kv_rows, *row]`` laid out like
            ``module.weight`` (same Megatron-FSDP shard, any dtype).
        module: the fused module; ``module.weight`` carries ``megatron_fsdp_slice`` and
            ``megatron_fsdp_dist_index``.

    Returns:
        ``{'q': DTensor [q_rows, *row], 'kv': DTensor [kv_rows, *row]}``, local tensors are views
        into ``value``'s local tensor; chunk metadata for uneven shards is attached.

    Raises:
        TypeError: ``value`` is not a DTensor or the weight carries no Megatron-FSDP shard info.
        ValueError: shapes inconsistent with the MLA config, TP split along dim != 0, shard not
            row aligned.
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        make_fsdp_dtensor,
    )
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import (
        get_mcore_tensor_parallel_partition_dim,
    )
    from torch.distributed.tensor import DTensor

    where = key or join_key(module.path, FUSED, "weight")
    param = module.weight
    if not isinstance(value, DTensor):
        raise TypeError(f"{where}: expected a Megatron-FSDP DTensor, got {type(value).__name__}")
    fsdp_slice = getattr(param, "megatron_fsdp_slice", None)
    dist_index = getattr(param, "megatron_fsdp_dist_index", None)
    if fsdp_slice is None or dist_index is None:
        raise TypeError(
            f"{where}: the live fused weight carries no megatron_fsdp_slice / "
            "megatron_fsdp_dist_index (is the model wrapped by Megatron-FSDP?)"
        )
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"{where}: shape {tuple(value.shape)} differs from the fused weight's "
            f"{tuple(param.shape)}"
        )
    tp_mesh = dist_index.get_submesh(dist_index.tp_dim) if dist_index.tp_dim else None
    tp_size = tp_mesh.mesh.numel() if tp_mesh is not None else 1
    tp_dim = get_mcore_tensor_parallel_partition_dim(param)
    if tp_dim not in (None, 0):
        raise ValueError(
            f"{where}: tensor-parallel partition dim {tp_dim} is not supported "
            "(the fused down projection is column parallel)"
        )
    tp_parts = tp_size if (tp_dim == 0 and tp_size > 1) else 1
    tp_rank = tp_mesh.get_local_rank() if tp_parts > 1 else 0
    # module.kv_rows already counts qk_pos_emb_head_dim
    sizes = mla_section_sizes(module.q_rows, module.kv_rows, 0, value.shape[0], tp_parts, where)
    row_shape = tuple(value.shape[1:])
    ranges = sizes.element_ranges(math.prod(row_shape))
    out = {}
    for part, section, rows_local in (
        ("q", ranges[0], sizes.q_rows_local),
        ("kv", ranges[1], sizes.kv_rows_local),
    ):
        view, first_row = section_view(value.to_local(), fsdp_slice, section, row_shape)
        meta = torch.empty((rows_local, *row_shape), device="meta")
        _copy_tp_attributes(meta, param)
        dt = make_fsdp_dtensor(
            view,
            meta,
            dist_index=dist_index,
            is_sharded_param=True,
            is_expert_param=False,
            run_check=False,
            update_uneven_dtensor_chunk_meta=False,
        )
        first = tp_rank * rows_local + min(first_row, rows_local)
        _attach_chunk(dt, (first,) + (0,) * len(row_shape))
        out[part] = dt
    return out
