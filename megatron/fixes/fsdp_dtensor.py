"""Fix: Megatron-FSDP ``fsdp_dtensor`` checkpoints of models with a fused MLA down projection or
multi-token-prediction (MTP) layers, and silent partial loads (answers Megatron-LM PR 6271, which
is on upstream main after megatron-core 0.19.2; 0.19.2 has none of it).

The defects in megatron-core 0.19.2 (``--use-megatron-fsdp --ckpt-format fsdp_dtensor``):

1. ``FusedMLASelfAttention`` (``--mla-down-proj-fusion``) holds one parameter
   ``linear_qkv_down_proj.weight`` of global shape ``[q_lora_rank + kv_lora_rank +
   qk_pos_emb_head_dim, hidden]`` whose rows are two sections, q (``q_lora_rank`` rows) and kv
   (``kv_lora_rank + qk_pos_emb_head_dim`` rows); with a column-parallel fused linear each tensor
   parallel (TP) rank holds ``[q/TP ; kv/TP]``. 0.19.2 saves it under the fused key, so a
   checkpoint of the unfused model (``linear_q_down_proj.weight``, ``linear_kv_down_proj.weight``,
   ``input_layernorm.*``) cannot be loaded into the fused model, and the fused tensor on disk is
   in a TP-dependent row order. The fused linear may also absorb the layer's input layernorm
   (``linear_qkv_down_proj.layer_norm_weight`` / ``layer_norm_bias``).
2. The MTP inner layer is ``mtp_model_layer`` in the model but ``transformer_layer`` in every
   other checkpoint format (``MultiTokenPredictionLayer.sharded_state_dict``); hybrid (Mamba) MTP
   layers, whose ``mtp_layer_pattern`` is set, keep ``mtp_model_layer``.
3. A partial load (``--no-strict-fsdp-dtensor-load``) leaves every model weight that the checkpoint
   lacks at its initial value without a word (only an INFO log of the key differences).
4. Not MLA/MTP specific, not CPU specific: a parameter whose local Megatron-FSDP shard is empty
   gets ``grad = None`` (``param_and_grad_buffer.py:3393-3394``), so torch Adam never creates its
   state on that rank, and the load-time dummy step skips it too (``distrib_optimizer.py:
   1428-1433``). ``sharded_param_state_fsdp_dtensor`` then packs different optimizer keys per rank
   and ``preprocess_state_dict_for_uneven_dtensor`` (one ``all_gather_object`` per DTensor) runs a
   different number of collectives per rank: the save hangs with an empty ``iter_*`` directory
   (or, with equal counts, gathers the shapes of different tensors).

What this fix does (patch points in ``megatron.training.checkpointing``, resolved through module
globals at call time):

* ``preprocess_fsdp_dtensor_state_dict`` (save and load) is wrapped: after upstream's own handling
  (fp8 extra state, SwiGLU, experts, uneven-DTensor metadata) the fused weight and its optimizer
  state (every DTensor entry of the fused weight's shape, e.g. ``exp_avg``, ``exp_avg_sq``; scalars
  such as ``step`` are shared) are replaced by the two sections ``linear_q_down_proj.weight`` /
  ``linear_kv_down_proj.weight`` (global ``[q_lora_rank, hidden]`` and ``[kv_lora_rank +
  qk_pos_emb_head_dim, hidden]``, same dtype). Each section is a DTensor whose local tensor is a
  *view* into the fused local shard (so a load writes straight into the fused parameter), for any
  uneven Megatron-FSDP shard: ranks that own nothing of a section get an empty ``[0, hidden]``
  view, a shard straddling the q/kv boundary contributes to both. Chunk offsets are computed
  locally from ``megatron_fsdp_slice`` (no collectives). The absorbed layernorm maps to the layer's
  ``input_layernorm.weight`` / ``.bias``. Then (last, because MLA resolves live module paths) the
  MTP inner layer is renamed ``mtp_model_layer`` -> ``transformer_layer``. Order overall: SwiGLU,
  MLA, experts, MTP (MLA keys are never expert keys, so running MLA after upstream's experts
  renaming is equivalent).
* ``default_planner`` (the load planner of ``_load_base_checkpoint``'s ``fsdp_dtensor`` branch) is
  replaced by a namespace whose ``DefaultLoadPlanner`` first reads the checkpoint's DCP metadata
  keys and, beyond upstream, re-renders the request in the layout that checkpoint was written in:
  checkpoints of the unfixed 0.17-0.19.2 code (fused ``linear_qkv_down_proj.*``,
  ``mtp_model_layer.*`` keys) still load. The layout is read from the metadata, never guessed from
  flags. A section whose shape differs from the checkpoint's raises ``ValueError`` naming the key
  and both shapes (on every rank: all ranks check the same global shapes).
* ``print_diff_in_state_dicts`` (called only in the partial-load branch) is wrapped so the partial
  load honours ``--dist-ckpt-strictness`` (see :func:`handle_unexpected_keys`).
* ``DistributedOptimizer.sharded_param_state_fsdp_dtensor`` is wrapped
  (:func:`fill_empty_shard_states`): empty-shard parameters get ``exp_avg`` / ``exp_avg_sq``
  placeholders (DTensors with empty local tensors: nothing written or read) and a ``step``
  equal to the common step of the others, *set again at every save*. Adding ``step`` only once is
  not enough: an empty-shard parameter never steps, its placeholder ``step`` goes stale, DCP
  writes a replicated plain tensor from one rank of its choice, and a later resume reads the stale
  step for the rank that does own the shard: Adam's bias correction is off and the run diverges at
  the second iteration after the load (measured: saves at 1 and 2, resume from 2 on 2 ranks:
  iteration 3 bitwise, 4 not; 5 parameters had ``step`` 1 on disk instead of 2).

Limitation kept from the legacy format: a legacy fused checkpoint written with TP > 1 stores the
rows in TP-interleaved order; it loads correctly only at the TP size it was written with.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from megatron.fixes.base import Fix, Patcher, PatchSpec

logger = logging.getLogger("megatron.fixes.fsdp_dtensor")

FUSED = "linear_qkv_down_proj"
Q_SECTION = "linear_q_down_proj"
KV_SECTION = "linear_kv_down_proj"
MTP_LIVE = "mtp_model_layer"
MTP_DISK = "transformer_layer"
# absorbed layernorm parameter of the fused linear -> parameter of the layer's input_layernorm
LAYERNORM_MAP = {"layer_norm_weight": "weight", "layer_norm_bias": "bias"}
_WRAPPER_NAMES = ("module", "model")

STRICTNESS_MODES = (
    "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
    "return_unexpected", "return_all", "ignore_all",
)
_RAISE_MODES = ("assume_ok_unexpected", "raise_unexpected", "raise_all")
_LOG_MODES = ("log_unexpected", "log_all")
_RETURN_MODES = ("return_unexpected", "return_all")
_KEY_LIMIT = 100  # keys named in one message


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------

def strip_wrappers(key: str) -> str:
    """``key`` without leading wrapper components (``module.``, ``model.``), as upstream's
    SwiGLU handler normalises state-dict keys and module paths."""
    parts = key.split(".")
    i = 0
    while i < len(parts) - 1 and parts[i] in _WRAPPER_NAMES:
        i += 1
    return ".".join(parts[i:])


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


def mla_section_sizes(q_lora_rank: int, kv_lora_rank: int, qk_pos_emb_head_dim: int,
                      fused_rows: int, tp_parts: int = 1, where: str = FUSED) -> MlaSectionSizes:
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
            f"({q}) + kv_lora_rank + qk_pos_emb_head_dim ({kv}) = {q + kv}")
    if q % tp_parts or kv % tp_parts:
        raise ValueError(
            f"{where}: q section ({q} rows) and kv section ({kv} rows) must both divide by the "
            f"tensor-parallel size {tp_parts}")
    return MlaSectionSizes(q, kv, tp_parts)


def section_view(local: torch.Tensor, fsdp_slice: slice, section: slice,
                 row_shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
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
            f"spans {fsdp_slice.stop - fsdp_slice.start}")
    flat = local.view(-1)
    inter = intersect(fsdp_slice, section)
    lo, hi = inter.start - fsdp_slice.start, inter.stop - fsdp_slice.start
    if hi == lo:
        return flat[0:0].view(0, *row_shape), 0
    if (hi - lo) % row_numel or (inter.start - section.start) % row_numel:
        raise ValueError(
            f"FSDP shard {fsdp_slice} does not hold whole rows ({row_numel} elements) of section "
            f"{section}")
    return flat[lo:hi].view(-1, *row_shape), (inter.start - section.start) // row_numel


# --------------------------------------------------------------------------------------------
# What the live model holds
# --------------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class ModelLayout:
    """Fused MLA modules and renamed MTP layers of a model (normalised paths)."""

    mla: Mapping[str, MlaModule] = field(default_factory=dict)
    mtp: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.mla) or bool(self.mtp)


@dataclass(frozen=True)
class Choice:
    """On-disk layout to address: MLA modules kept fused and MTP layers kept under
    ``mtp_model_layer`` (both empty: the fixed layout, which is what a save writes)."""

    fused_legacy: frozenset = frozenset()
    mtp_legacy: frozenset = frozenset()


NEW_LAYOUT = Choice()


def find_model_layout(model: Any, *, mla: bool = True, mtp: bool = True) -> ModelLayout:
    """Scan a (wrapped) model for fused MLA down projections and non-hybrid MTP layers.

    A fused MLA module is any module with a child ``linear_qkv_down_proj`` and a ``config`` whose
    ``q_lora_rank`` is set (``FusedMLASelfAttention``, also inside MTP and hybrid stacks). An MTP
    layer is any module with a child ``mtp_model_layer``; it is renamed unless its
    ``mtp_layer_pattern`` is set (hybrid MTP keeps its native name).
    """
    if isinstance(model, (list, tuple)):
        model = model[0]
    found_mla: dict[str, MlaModule] = {}
    found_mtp: list[str] = []
    for name, module in model.named_modules():
        path = strip_wrappers(name) if name else ""
        if path in _WRAPPER_NAMES:
            path = ""
        fused = getattr(module, FUSED, None)
        config = getattr(module, "config", None)
        if (mla and isinstance(fused, torch.nn.Module) and config is not None
                and getattr(config, "q_lora_rank", None)):
            weight = getattr(fused, "weight", None)
            if weight is not None:
                found_mla[path] = MlaModule(
                    path=path,
                    parent=path.rpartition(".")[0],
                    q_rows=int(config.q_lora_rank),
                    kv_rows=int(config.kv_lora_rank) + int(config.qk_pos_emb_head_dim),
                    weight=weight,
                )
        inner = getattr(module, MTP_LIVE, None)
        if mtp and isinstance(inner, torch.nn.Module) and getattr(module, "mtp_layer_pattern", None) is None:
            found_mtp.append(path)
    return ModelLayout(found_mla, tuple(found_mtp))


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def mla_hit(norm_key: str, layout: ModelLayout) -> tuple[MlaModule, str] | None:
    """``(module, leaf)`` if the normalised key is ``<mla path>.linear_qkv_down_proj.<leaf>`` with
    leaf ``weight``, ``layer_norm_weight`` or ``layer_norm_bias`` of a fused module, else None."""
    marker = f"{FUSED}."
    if norm_key.startswith(marker):
        path, leaf = "", norm_key[len(marker):]
    else:
        idx = norm_key.rfind(f".{marker}")
        if idx < 0:
            return None
        path, leaf = norm_key[:idx], norm_key[idx + len(marker) + 1:]
    module = layout.mla.get(path)
    if module is None or (leaf != "weight" and leaf not in LAYERNORM_MAP):
        return None
    return module, leaf


def _mtp_rename(norm_key: str, layout: ModelLayout, choice: Choice) -> str:
    for path in layout.mtp:
        if path in choice.mtp_legacy:
            continue
        head = _join(path, MTP_LIVE) + "."
        if norm_key.startswith(head):
            return _join(path, MTP_DISK) + "." + norm_key[len(head):]
    return norm_key


def map_key(key: str, layout: ModelLayout, choice: Choice = NEW_LAYOUT) -> list[tuple[str, str | None]]:
    """The on-disk key(s) of one live state-dict key.

    Returns:
        ``[(disk_key, part)]`` where ``part`` is ``'q'`` / ``'kv'`` for a fused weight's sections,
        else None (the whole value). The key's wrapper prefix (``module.``...) is kept.
    """
    norm = strip_wrappers(key)
    prefix = key[: len(key) - len(norm)]
    out: list[tuple[str, str | None]] = [(norm, None)]
    hit = mla_hit(norm, layout)
    if hit is not None and hit[0].path not in choice.fused_legacy:
        module, leaf = hit
        if leaf == "weight":
            out = [(_join(module.path, Q_SECTION, "weight"), "q"),
                   (_join(module.path, KV_SECTION, "weight"), "kv")]
        else:
            out = [(_join(module.parent, "input_layernorm", LAYERNORM_MAP[leaf]), None)]
    return [(prefix + _mtp_rename(k, layout, choice), part) for k, part in out]


# --------------------------------------------------------------------------------------------
# Section DTensors
# --------------------------------------------------------------------------------------------

def _copy_tp_attributes(dst: torch.Tensor, src: torch.Tensor) -> None:
    from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes

    copy_tensor_model_parallel_attributes(dst, src)
    if hasattr(src, "_tensor_parallel_mode"):
        dst._tensor_parallel_mode = src._tensor_parallel_mode


def _attach_chunk(dtensor, offsets: tuple[int, ...]) -> None:
    """Give a DTensor with an uneven local shard its DCP chunk metadata (computed locally)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, MetadataIndex, TensorProperties)
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
        return [WriteItem(
            type=WriteItemType.SHARD,
            index=MetadataIndex(fqn, chunk.offsets),
            tensor_data=TensorWriteData(chunk=chunk,
                                        properties=TensorProperties.create_from_tensor(data),
                                        size=tensor.size()),
        )]

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
    from torch.distributed.tensor import DTensor

    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        make_fsdp_dtensor)
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import (
        get_mcore_tensor_parallel_partition_dim)

    where = key or _join(module.path, FUSED, "weight")
    param = module.weight
    if not isinstance(value, DTensor):
        raise TypeError(f"{where}: expected a Megatron-FSDP DTensor, got {type(value).__name__}")
    fsdp_slice = getattr(param, "megatron_fsdp_slice", None)
    dist_index = getattr(param, "megatron_fsdp_dist_index", None)
    if fsdp_slice is None or dist_index is None:
        raise TypeError(f"{where}: the live fused weight carries no megatron_fsdp_slice / "
                        "megatron_fsdp_dist_index (is the model wrapped by Megatron-FSDP?)")
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{where}: shape {tuple(value.shape)} differs from the fused weight's "
                         f"{tuple(param.shape)}")
    tp_mesh = dist_index.get_submesh(dist_index.tp_dim) if dist_index.tp_dim else None
    tp_size = tp_mesh.mesh.numel() if tp_mesh is not None else 1
    tp_dim = get_mcore_tensor_parallel_partition_dim(param)
    if tp_dim not in (None, 0):
        raise ValueError(f"{where}: tensor-parallel partition dim {tp_dim} is not supported "
                         "(the fused down projection is column parallel)")
    tp_parts = tp_size if (tp_dim == 0 and tp_size > 1) else 1
    tp_rank = tp_mesh.get_local_rank() if tp_parts > 1 else 0
    # module.kv_rows already counts qk_pos_emb_head_dim
    sizes = mla_section_sizes(module.q_rows, module.kv_rows, 0, value.shape[0], tp_parts, where)
    row_shape = tuple(value.shape[1:])
    ranges = sizes.element_ranges(math.prod(row_shape))
    out = {}
    for part, section, rows_local in (("q", ranges[0], sizes.q_rows_local),
                                      ("kv", ranges[1], sizes.kv_rows_local)):
        view, first_row = section_view(value.to_local(), fsdp_slice, section, row_shape)
        meta = torch.empty((rows_local, *row_shape), device="meta")
        _copy_tp_attributes(meta, param)
        dt = make_fsdp_dtensor(view, meta, dist_index=dist_index, is_sharded_param=True,
                               is_expert_param=False, run_check=False,
                               update_uneven_dtensor_chunk_meta=False)
        first = tp_rank * rows_local + min(first_row, rows_local)
        _attach_chunk(dt, (first,) + (0,) * len(row_shape))
        out[part] = dt
    return out


# --------------------------------------------------------------------------------------------
# Prepared state dict: render, resolve against a checkpoint, write back
# --------------------------------------------------------------------------------------------

_CONTAINERS = (("model",), ("optimizer", "state"), ("optimizer", "param_to_group_meta"))


@dataclass
class _Preparation:
    args: Any
    layout: ModelLayout
    originals: dict  # container path -> dict as upstream prepared it (live keys)
    sections: dict  # (container path, live key[, sub]) -> {'q': DTensor, 'kv': DTensor}
    choice: Choice = NEW_LAYOUT
    writeback: dict = field(default_factory=dict)  # DCP object path -> (dict, key)
    installed: dict = field(default_factory=dict)  # container path -> rendered dict in place


class PreparedStateDict(dict):
    """The top-level ``fsdp_dtensor`` state dict after this fix, carrying (``fsdp_fix``) what is
    needed to address an older on-disk layout. Copies and pickles are plain dicts."""

    fsdp_fix: _Preparation

    def __reduce_ex__(self, protocol):
        return (dict, (dict(self),))


def _get_container(state_dict: dict, path: tuple[str, ...]):
    node = state_dict
    for name in path:
        if not isinstance(node, dict) or name not in node:
            return None
        node = node[name]
    return node if isinstance(node, dict) else None


def _render(prep: _Preparation, path: tuple[str, ...], choice: Choice) -> dict:
    orig = prep.originals[path]
    new: dict = {}
    for key, value in orig.items():
        for new_key, part in map_key(key, prep.layout, choice):
            if part is None:
                v = value
            elif path == ("model",):
                v = prep.sections[(path, key)][part]
            elif path == ("optimizer", "state"):
                v = dict(value)
                for sub in value:
                    split = prep.sections.get((path, key, sub))
                    if split is not None:
                        v[sub] = split[part]
            else:
                v = value
            if new_key in new:
                raise ValueError(f"fsdp_dtensor fix: two entries map to checkpoint key '{new_key}'")
            new[new_key] = v
            # DCP sets loaded non-tensor leaves into the dicts it was given; where those are our
            # copies under renamed keys, the planner writes them back to the live-key dicts that
            # Megatron restores after the load (tensors load in place, nested dicts are shared).
            if new_key != key and path != ("model",):
                if path == ("optimizer", "state") and isinstance(value, dict):
                    for sub, item in value.items():
                        if (path, key, sub) not in prep.sections and not isinstance(
                                item, (dict, torch.Tensor)):
                            prep.writeback[path + (new_key, sub)] = (value, sub)
                elif not isinstance(value, (dict, torch.Tensor)):
                    prep.writeback[path + (new_key,)] = (orig, key)
    return new


def _install(state_dict: dict, prep: _Preparation, choice: Choice) -> None:
    prep.writeback = {}
    for path in prep.originals:
        parent = state_dict if len(path) == 1 else _get_container(state_dict, path[:-1])
        if parent is None:
            continue
        if path in prep.installed and parent.get(path[-1]) is not prep.installed[path]:
            continue  # replaced by upstream after preparation (e.g. GPT-compat retargeting)
        parent[path[-1]] = prep.installed[path] = _render(prep, path, choice)
    prep.choice = choice


def prepare_state_dict(state_dict: dict, model: Any, args: Any = None, *, mla: bool = True,
                       mtp: bool = True) -> dict:
    """Put an upstream-preprocessed ``fsdp_dtensor`` state dict into the fixed on-disk layout.

    Args:
        state_dict: result of upstream ``preprocess_fsdp_dtensor_state_dict``: ``{'model': {key:
            DTensor}, 'optimizer': {'state': {key: {'exp_avg': DTensor, ..., 'step': tensor}},
            'param_to_group_meta': {key: dict}}, ...}``; not modified (containers are replaced in
            a shallow copy).
        model: the (Megatron-FSDP wrapped) model chunk the keys belong to.
        args: Megatron args, kept for the partial-load check.
        mla / mtp: handle fused MLA down projections / MTP renaming.

    Returns:
        ``state_dict`` itself if the model has nothing to handle, else a :class:`PreparedStateDict`.
    """
    layout = find_model_layout(model, mla=mla, mtp=mtp)
    if not layout:
        return state_dict
    out = PreparedStateDict(state_dict)
    if isinstance(out.get("optimizer"), dict):
        out["optimizer"] = dict(out["optimizer"])
    originals = {p: c for p in _CONTAINERS if (c := _get_container(out, p)) is not None}
    sections: dict = {}
    for path in (("model",), ("optimizer", "state")):
        container = originals.get(path)
        for key, value in (container or {}).items():
            hit = mla_hit(strip_wrappers(key), layout)
            if hit is None or hit[1] != "weight":
                continue
            module = hit[0]
            if path == ("model",):
                sections[(path, key)] = split_fused(value, module, key)
            elif isinstance(value, dict):
                for sub, item in value.items():
                    if hasattr(item, "shape") and tuple(item.shape) == tuple(module.weight.shape) \
                            and item.dim() > 0:
                        sections[(path, key, sub)] = split_fused(item, module, f"{key}.{sub}")
    prep = _Preparation(args=args, layout=layout, originals=originals, sections=sections)
    out.fsdp_fix = prep
    _install(out, prep, NEW_LAYOUT)
    return out


def _metadata_keys(metadata) -> Mapping:
    return getattr(metadata, "state_dict_metadata", metadata)


def detect_choice(prep: _Preparation, md_keys: Mapping | Iterable[str]) -> Choice:
    """The on-disk layout of a checkpoint, from its DCP metadata keys (``model.<key>`` ...).

    Per MTP layer: legacy (``mtp_model_layer``) if the checkpoint holds some of its weights under
    that name and none under ``transformer_layer``. Per fused MLA module: legacy (fused) if the
    checkpoint lacks a section key but holds the fused key. Otherwise the fixed layout.
    """
    md = md_keys if isinstance(md_keys, (set, frozenset, dict)) else set(md_keys)
    layout = prep.layout
    model = prep.originals.get(("model",), {})
    mtp_legacy = set()
    for path in layout.mtp:
        head = _join(path, MTP_LIVE) + "."
        new_hits = old_hits = 0
        for key in model:
            if not strip_wrappers(key).startswith(head):
                continue
            new_hits += sum(f"model.{k}" in md for k, _ in map_key(key, layout, NEW_LAYOUT))
            old_hits += sum(f"model.{k}" in md
                            for k, _ in map_key(key, layout, Choice(mtp_legacy=frozenset([path]))))
        if new_hits == 0 and old_hits > 0:
            mtp_legacy.add(path)
    base = Choice(mtp_legacy=frozenset(mtp_legacy))
    fused_legacy = set()
    for key in model:
        hit = mla_hit(strip_wrappers(key), layout)
        if hit is None or hit[1] != "weight":
            continue
        split_keys = [f"model.{k}" for k, _ in map_key(key, layout, base)]
        fused_keys = [f"model.{k}" for k, _ in map_key(
            key, layout, Choice(frozenset([hit[0].path]), base.mtp_legacy))]
        if not all(k in md for k in split_keys) and all(k in md for k in fused_keys):
            fused_legacy.add(hit[0].path)
    return Choice(frozenset(fused_legacy), base.mtp_legacy)


def _check_shapes(state_dict: dict, prep: _Preparation, md: Mapping) -> None:
    """Raise ValueError if a requested MLA-related entry has another shape in the checkpoint."""
    related: dict[str, tuple[MlaModule, str | None]] = {}
    for key in prep.originals.get(("model",), {}):
        hit = mla_hit(strip_wrappers(key), prep.layout)
        if hit is not None:
            for disk_key, part in map_key(key, prep.layout, prep.choice):
                related[strip_wrappers(disk_key)] = (hit[0], part)
    problems: dict[str, list[str]] = {"model": [], "optimizer": []}
    for path in (("model",), ("optimizer", "state")):
        prefix = ".".join(path)
        for key, value in (_get_container(state_dict, path) or {}).items():
            info = related.get(strip_wrappers(key))
            if info is None:
                continue
            if path == ("model",):
                entries = {f"{prefix}.{key}": value}
            elif isinstance(value, dict):
                entries = {f"{prefix}.{key}.{sub}": item for sub, item in value.items()}
            else:
                continue
            module, part = info
            for flat, item in entries.items():
                size = getattr(md.get(flat), "size", None)
                if size is None or not hasattr(item, "shape") or tuple(size) == tuple(item.shape):
                    continue
                what = {"q": f"q section ({Q_SECTION}, q_lora_rank={module.q_rows})",
                        "kv": f"kv section ({KV_SECTION}, kv_lora_rank + qk_pos_emb_head_dim="
                              f"{module.kv_rows})"}.get(part, "entry")
                problems[path[0]].append(
                    f"checkpoint key '{flat}' has shape {tuple(size)} but the model's {what} of "
                    f"'{_join(module.path, FUSED)}' has shape {tuple(item.shape)}")
    named = problems["model"] or problems["optimizer"]
    if named:
        extra = len(problems["optimizer"]) if problems["model"] else 0
        raise ValueError(
            "fsdp_dtensor checkpoint does not match the model's fused MLA down projection "
            "(written with another q_lora_rank / kv_lora_rank / qk_pos_emb_head_dim or hidden "
            "size?): " + "; ".join(sorted(named))
            + (f"; and {extra} optimizer-state entries of these sections" if extra else ""))


def resolve_layout(state_dict: dict, metadata) -> Choice | None:
    """Address the layout the checkpoint was written in (legacy fused / ``mtp_model_layer`` keys)
    and check MLA section shapes. No-op (None) for a state dict this fix did not prepare.

    Args:
        metadata: DCP ``Metadata`` or its ``state_dict_metadata`` mapping.

    Raises:
        ValueError: an MLA section's shape differs from the checkpoint's (names key and shapes).
    """
    prep = getattr(state_dict, "fsdp_fix", None)
    if prep is None:
        return None
    md = _metadata_keys(metadata)
    choice = detect_choice(prep, md)
    if choice != prep.choice:
        _install(state_dict, prep, choice)
        if choice.fused_legacy or choice.mtp_legacy:
            logger.warning(
                "fsdp_dtensor checkpoint written by megatron-core <= 0.19.2 without the fix: "
                "loading fused MLA down projections of %s and MTP layers %s under their legacy "
                "names", sorted(choice.fused_legacy) or "none", sorted(choice.mtp_legacy) or "none")
    _check_shapes(state_dict, prep, md)
    return choice


# --------------------------------------------------------------------------------------------
# Partial loads and --dist-ckpt-strictness
# --------------------------------------------------------------------------------------------

def flatten_keys(obj: Any, prefix: str) -> list[str]:
    """DCP's flattened keys of a nested dict/list (components joined with '.')."""
    if isinstance(obj, dict):
        out = []
        for k, v in obj.items():
            out += flatten_keys(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(obj, list):
        out = []
        for i, v in enumerate(obj):
            out += flatten_keys(v, f"{prefix}.{i}" if prefix else str(i))
        return out
    return [prefix]


def unexpected_model_keys(state_dict: Mapping, metadata) -> set[str]:
    """Model entries this rank requests that the checkpoint lacks (Megatron's 'unexpected' keys;
    keys the checkpoint holds but this rank does not request are normal under PP/TP/EP)."""
    md = _metadata_keys(metadata)
    return {k for k in flatten_keys(state_dict.get("model", {}), "model") if k not in md}


def _describe(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_KEY_LIMIT])
    return shown + (f", ... and {len(keys) - _KEY_LIMIT} more" if len(keys) > _KEY_LIMIT else "")


def _ranks_with_unexpected(count: int) -> list[int]:
    """Ranks (of the default group) whose count is non-zero; every rank gets the same answer, so
    every rank raises together instead of some ranks entering the load collectives alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [0] if count else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dist.get_rank(), count))
    return sorted(r for r, n in gathered if n)


def handle_unexpected_keys(unexpected: Iterable[str], strictness: str = "assume_ok_unexpected",
                           finetune: bool = False, *, sync: bool = True) -> set[str]:
    """Apply ``--dist-ckpt-strictness`` to a partial ``fsdp_dtensor`` load.

    Only 'unexpected' keys exist here (requested model weights the checkpoint lacks), so the
    ``*_all`` modes act like ``*_unexpected``.

    * ``raise_*`` and the default ``assume_ok_unexpected``: raise on every rank if any rank has
      such keys (``sync`` gathers the counts over the default process group);
    * ``log_*``: warning naming the keys, returns them;
    * ``return_*``: returns them (``FIX.last_unexpected_keys`` keeps them after a load);
    * ``ignore_all``: returns an empty set (the old, silent behaviour);
    * ``finetune``: no check.

    Raises:
        megatron.core.dist_checkpointing.core.CheckpointingException: in a raising mode, naming
            this rank's keys (up to 100) and the ranks affected.
        ValueError: unknown strictness value.
    """
    mode = getattr(strictness, "value", strictness) or "assume_ok_unexpected"
    if mode not in STRICTNESS_MODES:
        raise ValueError(f"unknown --dist-ckpt-strictness {strictness!r}; one of {STRICTNESS_MODES}")
    unexpected = set(unexpected)
    if finetune or mode == "ignore_all":
        return set()
    if mode in _RAISE_MODES:
        ranks = _ranks_with_unexpected(len(unexpected)) if sync else ([0] if unexpected else [])
        if ranks:
            from megatron.core.dist_checkpointing.core import CheckpointingException

            here = (f"{len(unexpected)} model weight(s) requested here are not in the checkpoint "
                    f"and would keep their initial values: {_describe(unexpected)}"
                    if unexpected else "no weights are missing on this rank")
            raise CheckpointingException(
                f"fsdp_dtensor partial load (--no-strict-fsdp-dtensor-load): {here}. Ranks with "
                f"missing weights: {ranks}. --dist-ckpt-strictness={mode}; use log_unexpected, "
                "return_unexpected or ignore_all to load anyway, or --finetune.")
        return set()
    if mode in _LOG_MODES and unexpected:
        logger.warning(
            "fsdp_dtensor partial load: %d model weight(s) are not in the checkpoint and keep "
            "their initial values: %s", len(unexpected), _describe(unexpected))
    return unexpected


# --------------------------------------------------------------------------------------------
# Optimizer state of parameters whose local FSDP shard is empty
# --------------------------------------------------------------------------------------------

#: torch optimizers that keep ``step`` per parameter (in ``state[param]['step']``).
_PER_PARAM_STEP = (torch.optim.Adam, torch.optim.AdamW)


def _scalar_dtype() -> torch.dtype:
    """dtype torch Adam gives a new ``step`` (float64 only under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _local_tensor(param: torch.Tensor) -> torch.Tensor:
    return getattr(param, "_local_tensor", param)


def _shard_groups(param: torch.Tensor) -> list:
    """Process groups of the mesh dimensions a DTensor parameter is sharded over (mesh order)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if not isinstance(param, DTensor):
        return []
    return [param.device_mesh.get_group(i) for i, p in enumerate(param.placements)
            if isinstance(p, (Shard, _StridedShard))]


@dataclass(frozen=True)
class StepAgreement:
    """What the ranks sharing a parameter's FSDP shard groups hold in optimizer state.

    Attributes:
        any_state: some rank of the groups has per-parameter state for a non-empty shard.
        step: the per-parameter ``step`` all those states share (None: no rank keeps ``step``).
    """

    any_state: bool
    step: float | None


def agree_on_step(optimizer: torch.optim.Optimizer, groups: Iterable) -> StepAgreement:
    """Min/max of ``state[p]['step']`` over the non-empty local shards of every rank in
    ``groups`` (one ``all_reduce`` of 3 float64 values per group; call it on every rank of the
    groups, as upstream calls ``sharded_param_state_fsdp_dtensor``).

    Raises:
        ValueError: on every rank of the groups, if the ranks' parameters are at different steps
            (all ranks see the same reduced values, so all raise together, none hangs).
    """
    import torch.distributed as dist

    steps, present = [], 0
    device = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            device = device or _local_tensor(p).device
            if _local_tensor(p).numel() == 0:
                continue
            state = optimizer.state.get(p)
            if state:
                present = 1
                if "step" in state:
                    steps.append(float(state["step"]))
    ninf = float("-inf")
    vec = torch.tensor([max(steps, default=ninf), -min(steps, default=float("inf")), present],
                       dtype=torch.float64, device=device or "cpu")
    for g in groups:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=g)
    hi, lo, any_state = float(vec[0]), -float(vec[1]), bool(vec[2])
    if hi == ninf:
        return StepAgreement(any_state, None)
    if hi != lo:
        raise ValueError(
            f"fsdp_dtensor checkpoint: optimizer parameters are at different steps ({lo:g} .. "
            f"{hi:g}) across the ranks sharing them; cannot give parameters with an empty local "
            "shard a consistent 'step'")
    return StepAgreement(any_state, hi)


def fill_empty_shard_states(dist_optimizer) -> list[str]:
    """Give parameters whose local Megatron-FSDP shard is empty the optimizer state their
    non-empty peers have, so every rank exposes the same ``fsdp_dtensor`` optimizer keys.

    Upstream (0.19.2) sets ``param.grad = None`` for an empty local shard
    (``param_and_grad_buffer.py:3393-3394``, ``update_main_grads``); torch Adam creates state only
    for parameters with a gradient, and the load-time ``_init_optimizer_states_with_dummy_values``
    (``distrib_optimizer.py:1428-1433``) skips empty parameters too. So
    ``sharded_param_state_fsdp_dtensor`` packs different keys per rank, and
    ``preprocess_state_dict_for_uneven_dtensor`` (``uneven_dtensor.py:244-252``), which runs one
    ``all_gather_object`` per DTensor, issues a different number of collectives per rank: the save
    (and load) hangs, leaving an empty ``iter_*`` directory.

    For every parameter ``p`` of the inner optimizer with an empty local shard: each tensor key of
    ``dist_optimizer.optimizer_state_keys`` (``exp_avg``, ``exp_avg_sq``; plus ``max_exp_avg_sq``
    for amsgrad groups) missing from its state becomes ``zeros_like(p)`` (a DTensor of ``p``'s
    global shape and dtype, empty local tensor: nothing is written or read for it), and for torch
    Adam/AdamW ``step`` becomes a new scalar tensor (float32, as torch Adam's; one per parameter)
    equal to the common step of the non-empty parameters, refreshed on every call (empty
    parameters never step: a stored ``step`` would go stale and, written by DCP from this rank,
    reach the rank that owns the shard on resume). The common step is agreed with
    :func:`agree_on_step` over the parameters' shard groups (one tiny ``all_reduce`` per call, on
    every rank). Nothing is filled while no rank has any state (fresh optimizer:
    all ranks already agree on empty state).

    Args:
        dist_optimizer: a Megatron ``DistributedOptimizer`` under Megatron-FSDP (its
            ``optimizer`` holds the DTensor parameters).

    Returns:
        Names (``_param_name``) of the parameters whose state was filled or refreshed here.

    Raises:
        ValueError: on every rank sharing the parameters, if they are at different steps.
    """
    inner = dist_optimizer.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    if not params:
        return []
    agreement = agree_on_step(inner, _shard_groups(params[0]))
    if not agreement.any_state:
        return []
    tensor_keys = tuple(dist_optimizer.optimizer_state_keys)
    per_param_step = isinstance(inner, _PER_PARAM_STEP) and agreement.step is not None
    filled = []
    for group in inner.param_groups:
        keys = tensor_keys + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
        for p in group["params"]:
            if _local_tensor(p).numel() != 0:
                continue
            state = inner.state[p]
            for key in keys:
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if per_param_step:
                state["step"] = torch.tensor(agreement.step, dtype=_scalar_dtype())
            filled.append(dist_optimizer._param_name(p))
    return filled


# --------------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------------

def _make_load_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class FsdpDTensorLoadPlanner(DefaultLoadPlanner):
        """``DefaultLoadPlanner`` that first addresses the checkpoint's on-disk layout
        (:func:`resolve_layout`) and writes loaded non-tensor entries of renamed optimizer keys
        back to the live-key dicts Megatron restores after the load."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            if metadata is not None:
                resolve_layout(state_dict, metadata)
            super().set_up_planner(state_dict, metadata, is_coordinator)

        def load_bytes(self, read_item, value):
            super().load_bytes(read_item, value)
            prep = getattr(self.original_state_dict, "fsdp_fix", None)
            if prep is None or not self.flatten_state_dict:
                return
            path = tuple(self.mappings.get(read_item.dest_index.fqn, ()))
            target = prep.writeback.get(path)
            if target is None:
                return
            node = self.original_state_dict
            for name in path:
                node = node[name]
            target[0][target[1]] = node

    return FsdpDTensorLoadPlanner


class _PlannerNamespace:
    """Stands in for ``torch.distributed.checkpoint.default_planner`` inside
    ``megatron.training.checkpointing``: same attributes, fixed ``DefaultLoadPlanner``."""

    def __init__(self, module, planner_cls):
        self._module = module
        self.DefaultLoadPlanner = planner_cls

    def __getattr__(self, name):
        return getattr(self._module, name)


_DISTOPT = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
_FSDP_BUFFER = ("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer."
                "ParamAndGradBuffer")


class FsdpDTensorFix(Fix):
    name = "fsdp_dtensor"
    title = ("Megatron-FSDP fsdp_dtensor checkpoints: fused MLA down projection and MTP saved in "
             "the unfused layout, legacy layouts still load, partial loads honour strictness, "
             "empty FSDP shards no longer hang the save/load")
    upstream_refs = ("Megatron-LM PR 6271",
                     "megatron-core 0.19.2 param_and_grad_buffer.py:3393 (empty shard: no "
                     "optimizer state, ranks issue different collectives)")
    package = "megatron-core"
    supported = "==0.19.2"
    patches = (
        PatchSpec(
            target="megatron.training.checkpointing.preprocess_fsdp_dtensor_state_dict",
            replacement="megatron.fixes.fsdp_dtensor.prepare_state_dict after the original",
            why="saves/loads linear_qkv_down_proj as linear_q_down_proj / linear_kv_down_proj "
                "views (+ input_layernorm) and mtp_model_layer as transformer_layer, with their "
                "optimizer state"),
        PatchSpec(
            target="megatron.training.checkpointing.default_planner",
            replacement="namespace whose DefaultLoadPlanner resolves the on-disk layout first",
            why="checkpoints written by the unfixed 0.17-0.19.2 code (fused / mtp_model_layer "
                "keys) still load; MLA section shape mismatches are named"),
        PatchSpec(
            target="megatron.training.checkpointing.print_diff_in_state_dicts",
            replacement="the original plus megatron.fixes.fsdp_dtensor.handle_unexpected_keys",
            why="a partial load (--no-strict-fsdp-dtensor-load) no longer silently keeps model "
                "weights missing from the checkpoint at their initial values"),
        PatchSpec(
            target=f"{_DISTOPT}.sharded_param_state_fsdp_dtensor",
            replacement="(on load) upstream's dummy state init, then "
                        "megatron.fixes.fsdp_dtensor.fill_empty_shard_states, then the original",
            why="parameters with an empty local FSDP shard had no optimizer state, so ranks "
                "packed different keys and the per-DTensor collectives of the fsdp_dtensor "
                "save/load hung (empty iter_* directory)"),
    )

    def __init__(self) -> None:
        super().__init__()
        self.handle_mla = True  # switches for diagnostics and negative-control tests
        self.handle_mtp = True
        self.last_unexpected_keys: frozenset = frozenset()

    @staticmethod
    def layout_upstream_fixed() -> bool:
        """Upstream handles the fused MLA projection / MTP rename in the fsdp_dtensor path."""
        import megatron.core.transformer.fsdp_dtensor_checkpoint as handlers
        from megatron.training import checkpointing

        original = getattr(checkpointing.preprocess_fsdp_dtensor_state_dict, "__wrapped__",
                           checkpointing.preprocess_fsdp_dtensor_state_dict)
        try:
            source = inspect.getsource(handlers) + inspect.getsource(original)
        except (OSError, TypeError):  # no source shipped: rely on the version pin
            return False
        return FUSED in source or MTP_LIVE in source

    @staticmethod
    def empty_shards_upstream_fixed() -> bool:
        """Upstream gives empty-shard parameters optimizer state (or keeps their gradient)."""
        from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
            ParamAndGradBuffer)
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        packer = DistributedOptimizer.sharded_param_state_fsdp_dtensor
        packer = getattr(packer, "__wrapped__", packer)
        try:
            grads = inspect.getsource(ParamAndGradBuffer.update_main_grads)
            packs = inspect.getsource(packer)
        except (OSError, TypeError):
            return False
        drops_grad = "numel() == 0" in grads and "grad = None" in grads
        return not drops_grad or "numel()" in packs

    def upstream_behaves(self) -> bool:
        return self.layout_upstream_fixed() and self.empty_shards_upstream_fixed()

    def install(self, patcher: Patcher) -> None:
        if not self.empty_shards_upstream_fixed():
            self._install_empty_shards(patcher)
        if not self.layout_upstream_fixed():
            self._install_layout(patcher)

    def _install_empty_shards(self, patcher: Patcher) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        original = DistributedOptimizer.sharded_param_state_fsdp_dtensor

        @functools.wraps(original)
        def sharded_param_state_fsdp_dtensor(self, is_loading: bool = False):
            if is_loading:
                # upstream's own first step on load (placeholder state of the right shapes,
                # later overwritten in place by the checkpoint); done here so that the empty
                # shards' placeholders take the step it leaves, and not twice
                self._init_optimizer_states_with_dummy_values()
            fill_empty_shard_states(self)
            return original(self, is_loading=False)

        patcher.replace(DistributedOptimizer, "sharded_param_state_fsdp_dtensor",
                        sharded_param_state_fsdp_dtensor)

    def _install_layout(self, patcher: Patcher) -> None:
        from torch.distributed.checkpoint import default_planner

        from megatron.training import checkpointing

        fix = self
        original_preprocess = checkpointing.preprocess_fsdp_dtensor_state_dict

        @functools.wraps(original_preprocess)
        def preprocess_fsdp_dtensor_state_dict(args, raw_state_dict, model):
            state_dict = original_preprocess(args, raw_state_dict, model)
            return prepare_state_dict(state_dict, model, args, mla=fix.handle_mla,
                                      mtp=fix.handle_mtp)

        patcher.replace(checkpointing, "preprocess_fsdp_dtensor_state_dict",
                        preprocess_fsdp_dtensor_state_dict)
        patcher.replace(checkpointing, "default_planner",
                        _PlannerNamespace(default_planner, _make_load_planner_class()))

        original_diff = getattr(checkpointing, "print_diff_in_state_dicts", None)
        if original_diff is None:  # upstream without Megatron-FSDP: no fsdp_dtensor loads at all
            return

        @functools.wraps(original_diff)
        def print_diff_in_state_dicts(state_dict_metadata, load_state_dict, *a, **kw):
            resolve_layout(load_state_dict, state_dict_metadata)
            original_diff(state_dict_metadata, load_state_dict, *a, **kw)
            prep = getattr(load_state_dict, "fsdp_fix", None)
            args = prep.args if prep is not None else None
            if args is None:
                try:
                    from megatron.training.global_vars import get_args

                    args = get_args()
                except Exception:
                    args = None
            strictness = getattr(args, "dist_ckpt_strictness", None) or "assume_ok_unexpected"
            finetune = bool(getattr(args, "finetune", False))
            fix.last_unexpected_keys = frozenset(handle_unexpected_keys(
                unexpected_model_keys(load_state_dict, state_dict_metadata), strictness, finetune))

        patcher.replace(checkpointing, "print_diff_in_state_dicts", print_diff_in_state_dicts)


FIX = FsdpDTensorFix()
