"""Per-expert ModelOpt quantizer state in Megatron distributed checkpoints (ModelOpt issue 2209).

The defect (nvidia-modelopt 0.47.0)
-----------------------------------
ModelOpt adds its quantizer buffers (``_amax``, ``_global_amax``, ``_pre_quant_scale``, real-quant
``_scale`` ...) to a Megatron linear's sharded state dict with
``make_sharded_tensors_for_checkpoint(...)`` *without* process groups, so Megatron falls back to the
**dense** tensor-parallel (TP) and data-parallel groups:

* ``_MegatronParallelLinear.sharded_state_dict`` (sequential experts: every expert is an MLP of
  column/row parallel linears),
* ``_QuantMegatronTEGroupedLinear.sharded_state_dict`` (TE grouped experts; per-expert
  ``weight_quantizer.{i}`` and shared ``input_quantizer`` buffers).

Expert weights are sharded over the **expert** tensor-parallel group (ETP) and replicated over the
**expert** data-parallel group (EDP). A quantizer tensor of an expert therefore gets
``replica_id[1]`` = dense TP rank and, when split by channel/block, offsets over dense TP. The main
replicas then no longer cover each global tensor exactly once and ``validate_sharding_integrity``
raises ``Invalid access pattern for ShardedTensor(key='...experts.experts.16.linear_fc1.
weight_quantizer._amax' ...)`` on save, and on load under another topology. Measured: ETP > TP ->
every cell written twice; TP > ETP with EP > 1 -> the experts of some EP ranks written by nobody;
channel/block-split amax with TP != ETP -> offsets over the wrong group. (TP > ETP with EP = 1 and
per-tensor amax happens to pass.)

What this fix does
------------------
1. Wraps both ``sharded_state_dict`` methods and rebuilds every quantizer ``ShardedTensor`` of an
   *expert* linear (key unchanged, it already carries the global expert index) with the expert
   groups: per-expert entries get ``replica_id = (0, etp_rank, edp_rank)``, or, when split along a
   channel/block axis (same axis rule as upstream's ``_get_shard_axis_dict``), offsets
   ``(axis, etp_rank, etp_size)`` and ``replica_id = (0, 0, edp_rank)``. Buffers shared by all
   local experts of a grouped linear (its ``input_quantizer``) are additionally replicated over EP:
   replica rank ``ep_rank * edp_size + edp_rank``. Quantizers of non-expert modules keep upstream's
   dense groups (untouched).
2. Wraps ``megatron.core.dist_checkpointing.load`` to map checkpoint quantizer layouts onto the
   model before loading:

   * a checkpoint written before per-expert weight quantizers existed (one quantizer shared by a
     grouped linear, key ``...experts.experts.linear_fc1.weight_quantizer._amax``) loads into a
     per-expert model (keys ``...experts.experts.{e}.linear_fc1.weight_quantizer._amax``): every
     expert takes the shared value, and a log line says so;
   * a layout that cannot be mapped (shape mismatch, per-expert checkpoint for a shared-quantizer
     model, missing experts) raises :class:`QuantizerLayoutError` naming the key and both layouts,
     on every rank (the ranks agree through one ``all_gather_object`` before upstream's load runs
     any collective), instead of a rank-local storage error and a hang.
3. Calls upstream's ``_modelopt_get_extra_state`` without its unconditional
   ``torch.cuda.synchronize()`` when CUDA is not available (CPU runs).
4. ModelOpt state in Megatron-LM checkpoints (megatron-core 0.19.2). Upstream's checkpoint code
   saves ``modelopt_state`` only when ``has_nvidia_modelopt``, which it sets from an import of
   ``megatron.post_training.utils``: 0.19.2 does not ship ``megatron.post_training``, so the flag is
   False and quantized models are checkpointed without their ModelOpt state. The fix

   * sets ``has_nvidia_modelopt`` with ModelOpt's own ``save_modelopt_state`` /
     ``save_sharded_modelopt_state`` and a one-line ``print_distributed_quant_summary``
     (:func:`print_quant_summary`): ``torch_dist`` checkpoints of a quantized model get
     ``<ckpt>/modelopt_state`` again (unquantized models: unchanged, ModelOpt returns early);
   * stores the ModelOpt state in **local** (non-persistent) checkpoints too, where upstream only
     warns "Local checkpointing does not support nvidia_modelopt": ``save_checkpoint`` marks a local
     save, ``generate_state_dict`` then adds ``modelopt_state`` (ModelOpt's ``save_modelopt_state``,
     full per-module state; a local checkpoint is per rank and loads only at the same topology);
     on load, ``_load_base_checkpoint``'s first pass (no sharded state dict yet) hands that state to
     the next ``generate_state_dict`` of the load, which re-applies it to the still unconverted
     model (``restore_from_modelopt_state``) before building the state dict to load, so the
     quantizer tensors are requested and loaded. A run recovered from a local checkpoint, or from
     its replica, resumes quantized, with no persistent checkpoint and no flag needed;
   * offers :func:`restore_modelopt_state_pre_wrap_hook` (``pretrain_gpt.py
     --restore-modelopt-state``): the restore step of Megatron-LM's ``megatron.post_training`` model
     builder, with ModelOpt's ``restore_sharded_modelopt_state``, plus
     :func:`request_checkpointed_amax` for quantizers whose state that restore drops (those of
     non-Megatron modules, e.g. ``torch.nn.LayerNorm`` of the local spec).

Stands aside if a probe (a simulated expert linear on ETP rank 1 of 2 with dense TP size 1) shows
that upstream already gives expert quantizer tensors an ETP-based ``replica_id``.

Limits
------
* Gated (SwiGLU) ``linear_fc1`` with a channel/block-split weight amax (per-channel INT8/FP8,
  static-block recipes): the amax rows are [w; v] per ETP rank like the weight, but upstream's
  ``_MegatronMLP`` never applies the SwiGLU sharded factory to them (its key regex cannot match a
  prefixed key). This fix gives them valid ETP offsets, so saving and loading at the same ETP is
  exact, but a load at another ETP interleaves w and v rows. Per-tensor recipes (FP8, the NVFP4
  ``_amax``/``_global_amax`` scalars) are unaffected. Not changed here: doing it right changes the
  checkpoint keys (``_amax_w``/``_amax_v``), and old checkpoints do not record their ETP.
* ModelOpt's ``SequentialMLP`` wrapper still rejects TP > 1 together with EP > 1 (upstream check,
  left as is); TE grouped experts accept it.
* The layout mapping reads ``torch_dist`` metadata; other formats pass through untouched.
* Part 4 rides on this fix's capability probe: if a future ModelOpt fixes the expert sharding,
  the whole fix stands aside, including part 4 (re-check then whether upstream saves
  ``modelopt_state``). Virtual pipeline parallelism is not supported by ModelOpt's sharded state.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from megatron.fixes.base import Fix, Patcher, PatchSpec

logger = logging.getLogger("megatron.fixes.modelopt_moe")

_PLUGIN = "modelopt.torch.quantization.plugins.megatron"
_OPT_PLUGIN = "modelopt.torch.opt.plugins.megatron"

# Sharded keys of expert quantizer tensors. Per-expert: ``<head>experts.<e>.<tail>``; shared by
# the experts of a grouped linear (and the pre-per-expert layout): ``<head>experts.<tail>``.
# ``head`` must end in a path component named exactly ``experts`` (not ``shared_experts``).
_HEAD = r"(?P<head>(?:.*\.)?experts\.)"
_TAIL = r"(?P<tail>[^.\d][^.]*\..*quantizer.*)"
_PER_EXPERT_KEY = re.compile(rf"^{_HEAD}(?P<e>\d+)\.{_TAIL}$")
_SHARED_EXPERT_KEY = re.compile(rf"^{_HEAD}{_TAIL}$")
# Local (module) names of quantizer buffers: ``weight_quantizer._amax``,
# ``weight_quantizer.3._amax``, ``input_quantizer._pre_quant_scale`` ...
_QUANTIZER_LOCAL = re.compile(r"^(?:weight|input|output)_quantizer\.")
_GROUPED_PER_EXPERT_LOCAL = re.compile(r"^weight_quantizer\.(?P<i>\d+)\.(?P<sub>.+)$")


try:
    from megatron.core.dist_checkpointing.core import CheckpointingException as _CkptError
except ImportError:  # pragma: no cover - megatron-core is a pinned dependency
    _CkptError = RuntimeError


class QuantizerLayoutError(_CkptError):
    """The quantizer layout of a checkpoint cannot be mapped onto the model being loaded.

    A subclass of Megatron's ``CheckpointingException``, so existing handlers catch it.
    """


# --------------------------------------------------------------------------------------------------
# Expert process-group coordinates
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertCoords:
    """This rank's position in the expert process groups.

    Attributes:
        etp_rank, etp_size: expert tensor-parallel group (ETP).
        ep_rank, ep_size: expert model-parallel group (EP).
        edp_rank, edp_size: expert data-parallel group (EDP).
    """

    etp_rank: int = 0
    etp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    edp_rank: int = 0
    edp_size: int = 1


def _rank_size(group: Any) -> tuple[int, int]:
    """(rank, size) of a torch ProcessGroup (or any object with ``rank()``/``size()``), of a
    ModelOpt ``DistributedProcessGroup``; (0, 1) for ``None``/-1 or when torch.distributed is not
    initialised (as ``megatron.core.utils.get_pg_rank``)."""
    if group is None or isinstance(group, int):
        return 0, 1
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    if not hasattr(group, "size") and hasattr(group, "world_size"):  # modelopt wrapper
        if not group.is_initialized():
            return 0, 1
        return int(group.rank()), int(group.world_size())
    return int(group.rank()), int(group.size())


def _module_expert_groups(module: torch.nn.Module) -> tuple[Any, Any, Any]:
    """(etp, ep, edp) process groups of an expert linear: its own ProcessGroupCollection / TP group
    first, Megatron's global expert groups otherwise."""
    from megatron.core import parallel_state as mcore_ps

    def first(*candidates):
        return next((c for c in candidates if c is not None), None)

    pgc = getattr(module, "_pg_collection", None)
    etp = first(getattr(module, "tp_group", None), getattr(module, "_tp_group", None),
                getattr(pgc, "expt_tp", None))
    if etp is None:
        etp = mcore_ps.get_expert_tensor_parallel_group(check_initialized=False)
    ep = getattr(pgc, "ep", None)
    if ep is None:
        ep = mcore_ps.get_expert_model_parallel_group(check_initialized=False)
    edp = getattr(pgc, "expt_dp", None)
    if edp is None:  # the group SequentialMLP / ProcessGroupCollection use for expert replicas
        edp = mcore_ps.get_expert_data_parallel_group(check_initialized=False, with_gtp_remat=False)
    return etp, ep, edp


def expert_coords_of(module: torch.nn.Module) -> ExpertCoords:
    """Expert coordinates of ``module`` (an expert linear) on this rank.

    Returns:
        :class:`ExpertCoords`; sizes are 1 for groups that are not initialised.
    """
    etp, ep, edp = _module_expert_groups(module)
    (etp_r, etp_s), (ep_r, ep_s), (edp_r, edp_s) = _rank_size(etp), _rank_size(ep), _rank_size(edp)
    return ExpertCoords(etp_r, etp_s, ep_r, ep_s, edp_r, edp_s)


def is_expert_linear(module: torch.nn.Module) -> bool:
    """True if ``module`` is a linear of an MoE expert (Megatron ``is_expert``, or ModelOpt's
    parallel state seeded with an expert-model-parallel group by the MoE quant wrappers)."""
    flag = getattr(module, "is_expert", None)
    if isinstance(flag, bool):
        return flag
    pstate = getattr(module, "_parallel_state", None) or getattr(module, "parallel_state", None)
    emp = getattr(pstate, "expert_model_parallel_group", None)
    return emp is not None and getattr(emp, "group", -1) != -1


# --------------------------------------------------------------------------------------------------
# Rebuilding one quantizer ShardedTensor with the expert groups
# --------------------------------------------------------------------------------------------------


def expert_quantizer_sharded_tensor(sh_ten, split_axis: int | None, tp_rank: int, tp_size: int,
                                    replica_rank: int):
    """Copy of a quantizer ``ShardedTensor`` sharded over the expert groups.

    The key, data (the live buffer or view upstream put there) and prepended axes (PP/EP offsets)
    of ``sh_ten`` are kept; the tensor-parallel part is rebuilt.

    Args:
        sh_ten: ``megatron.core.dist_checkpointing.ShardedTensor`` built by upstream ModelOpt
            (any shape, any dtype; ``flattened_range`` must be ``None``).
        split_axis: axis of the *local* tensor split over ETP (channel/block amax, pre-quant
            scale, real-quant scales), or ``None`` if the tensor is replicated over ETP.
        tp_rank, tp_size: this rank's ETP rank and size.
        replica_rank: this rank's index among the replicas outside ETP: the EDP rank for a
            per-expert tensor, ``ep_rank * edp_size + edp_rank`` for one shared by all experts.

    Returns:
        a new ``ShardedTensor``: ``replica_id = (0, tp_rank, replica_rank)`` if not split, else
        offsets ``(split_axis + prepend_axis_num, tp_rank, tp_size)`` and
        ``replica_id = (0, 0, replica_rank)``. ``sh_ten`` itself if it has a ``flattened_range``.

    Raises:
        megatron.core.dist_checkpointing.core.CheckpointingException: invalid offsets
            (``split_axis`` outside the tensor's dimensions).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if getattr(sh_ten, "flattened_range", None) is not None:
        return sh_ten
    p = sh_ten.prepend_axis_num
    offsets = [(i, sh_ten.global_offset[i], sh_ten.axis_fragmentations[i]) for i in range(p)
               if sh_ten.axis_fragmentations[i] > 1 or sh_ten.global_offset[i] > 0]
    if split_axis is not None:
        offsets.append((split_axis + p, tp_rank, tp_size))
        replica_id = (0, 0, replica_rank)
    else:
        replica_id = (0, tp_rank, replica_rank)
    return ShardedTensor.from_rank_offsets(
        sh_ten.key, sh_ten.data, *offsets, replica_id=replica_id, prepend_axis_num=p,
        allow_shape_mismatch=sh_ten.allow_shape_mismatch,
    )


def regroup_expert_linear_entries(sharded_state_dict: dict, prefix: str, axes: dict[str, int],
                                  coords: ExpertCoords, grouped: bool) -> list[str]:
    """Rebuild, in place, the quantizer entries that an expert linear's upstream
    ``sharded_state_dict`` produced.

    Args:
        sharded_state_dict: the linear's sharded state dict (dict keys ``prefix + local name``).
        prefix: the prefix the linear was called with.
        axes: local quantizer name -> split axis (names absent: not split), as computed by the
            linear's ``_get_shard_axis_dict``.
        coords: this rank's expert coordinates.
        grouped: True for a TE grouped linear: ``weight_quantizer.{i}.*`` are per-expert, the other
            quantizer buffers are shared by its local experts (replicated over EP too). False for a
            linear of one expert (sequential experts): everything is per-expert.

    Returns:
        the dict keys that were rebuilt.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    done = []
    for k in list(sharded_state_dict):
        if not k.startswith(prefix):
            continue
        local = k[len(prefix):]
        v = sharded_state_dict[k]
        if not _QUANTIZER_LOCAL.match(local) or type(v) is not ShardedTensor:
            continue
        shared = grouped and not _GROUPED_PER_EXPERT_LOCAL.match(local)
        replica_rank = coords.edp_rank
        if shared:
            replica_rank += coords.ep_rank * coords.edp_size
        sharded_state_dict[k] = expert_quantizer_sharded_tensor(
            v, axes.get(local), coords.etp_rank, coords.etp_size, replica_rank)
        done.append(k)
    return done


def _split_axes(module, sharded_state_dict: dict, prefix: str, grouped: bool) -> dict[str, int]:
    """Split axis per local quantizer name, by upstream's own rule (``_get_shard_axis_dict``).

    For a grouped linear every expert's name is asked as expert 0 (all experts share one quantizer
    config; upstream's row-parallel rule only recognises indices 0 and 1)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    query: dict[str, Any] = {}
    rename: dict[str, str] = {}
    for k, v in sharded_state_dict.items():
        if not k.startswith(prefix) or type(v) is not ShardedTensor:
            continue
        local = k[len(prefix):]
        if not _QUANTIZER_LOCAL.match(local):
            continue
        asked = local
        m = _GROUPED_PER_EXPERT_LOCAL.match(local) if grouped else None
        if m:
            asked = f"weight_quantizer.0.{m.group('sub')}"
        query[asked] = v.data
        rename.setdefault(asked, asked)
        rename[local] = asked
    answer = module._get_shard_axis_dict(query) if query else {}
    return {local: answer[asked] for local, asked in rename.items() if asked in answer}


# --------------------------------------------------------------------------------------------------
# Wrappers of the upstream sharded_state_dict methods
# --------------------------------------------------------------------------------------------------


def _wrap_linear_sharded_state_dict(original: Callable) -> Callable:
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """ModelOpt ``_MegatronParallelLinear.sharded_state_dict`` with the quantizer tensors of
        expert linears sharded over the expert groups (``megatron.fixes.modelopt_moe``)."""
        sd = original(self, prefix, sharded_offsets, metadata)
        if is_expert_linear(self):
            axes = _split_axes(self, sd, prefix, grouped=False)
            regroup_expert_linear_entries(sd, prefix, axes, expert_coords_of(self), grouped=False)
        return sd

    sharded_state_dict.__wrapped__ = original
    return sharded_state_dict


def _wrap_grouped_sharded_state_dict(original: Callable) -> Callable:
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """ModelOpt ``_QuantMegatronTEGroupedLinear.sharded_state_dict`` with the per-expert and
        shared quantizer tensors sharded over the expert groups
        (``megatron.fixes.modelopt_moe``)."""
        sd = original(self, prefix, sharded_offsets, metadata)
        axes = _split_axes(self, sd, prefix, grouped=True)
        regroup_expert_linear_entries(sd, prefix, axes, expert_coords_of(self), grouped=True)
        return sd

    sharded_state_dict.__wrapped__ = original
    return sharded_state_dict


# --------------------------------------------------------------------------------------------------
# Load: mapping checkpoint quantizer layouts onto the model
# --------------------------------------------------------------------------------------------------


def _walk(container: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, value) of every leaf of nested dicts/lists."""
    if isinstance(container, dict):
        for k, v in container.items():
            yield from _walk(v, path + (k,))
    elif isinstance(container, list):
        for i, v in enumerate(container):
            yield from _walk(v, path + (i,))
    else:
        yield path, container


def _get(container: Any, path: tuple) -> Any:
    for p in path:
        container = container[p]
    return container


def _set(container: Any, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        container = container[p]
    container[path[-1]] = value


def _describe(key: str, shape: tuple | None) -> str:
    if _PER_EXPERT_KEY.match(key):
        kind = "per-expert layout"
    elif _SHARED_EXPERT_KEY.match(key):
        kind = "one tensor shared by all experts of the linear"
    else:
        kind = "layout"
    return f"'{key}' ({kind}, global shape {tuple(shape) if shape is not None else '?'})"


@dataclass
class _Remap:
    """Per-expert entries on this rank that take their value from one shared checkpoint tensor."""

    ckpt_key: str
    ckpt_shape: tuple
    ckpt_dtype: torch.dtype
    entries: list[tuple[tuple, Any]] = field(default_factory=list)  # (path, ShardedTensor)


@dataclass
class LayoutPlan:
    """What :func:`plan_quantizer_layout` found for one rank.

    Attributes:
        errors: human-readable descriptions of quantizer tensors that cannot be mapped.
        remaps: checkpoint key -> per-expert entries to fill from it (pre-per-expert layout).
    """

    errors: list[str] = field(default_factory=list)
    remaps: dict[str, _Remap] = field(default_factory=dict)


def _checkpoint_tensors(checkpoint_dir: Any) -> dict[str, tuple[tuple, torch.dtype]] | None:
    """key -> (global shape, dtype) of the tensors in a ``torch_dist`` checkpoint, or ``None`` if
    its metadata cannot be read (another format)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = FileSystemReader(str(checkpoint_dir)).read_metadata()
    except Exception:  # noqa: BLE001 - not a DCP checkpoint: leave everything to upstream
        return None
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def plan_quantizer_layout(sharded_state_dict: Any, ckpt: dict[str, tuple[tuple, torch.dtype]],
                          checkpoint_dir: Any = "") -> LayoutPlan:
    """Compare the expert quantizer tensors a rank requests with what the checkpoint holds.

    Pure (no collectives). Requested keys that the checkpoint holds with the same global shape need
    nothing; requests whose quantizer is absent from the checkpoint in every layout are left to
    upstream's strictness handling.

    Args:
        sharded_state_dict: the (nested) sharded state dict passed to ``dist_checkpointing.load``.
        ckpt: key -> (global shape, dtype) of the checkpoint's tensors
            (see :func:`_checkpoint_tensors`).
        checkpoint_dir: for messages only.

    Returns:
        :class:`LayoutPlan` with the remaps (pre-per-expert shared layout -> per-expert model) and
        the errors (layouts that cannot be mapped).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    plan = LayoutPlan()
    per_expert_index: dict[tuple[str, str], list[int]] | None = None

    def ckpt_experts(head: str, tail: str) -> list[int]:
        nonlocal per_expert_index
        if per_expert_index is None:
            per_expert_index = {}
            for k in ckpt:
                m = _PER_EXPERT_KEY.match(k)
                if m:
                    per_expert_index.setdefault((m["head"], m["tail"]), []).append(int(m["e"]))
        return sorted(per_expert_index.get((head, tail), []))

    for path, st in _walk(sharded_state_dict):
        if type(st) is not ShardedTensor:
            continue
        key, want = st.key, tuple(st.global_shape)
        pe, sh = _PER_EXPERT_KEY.match(key), _SHARED_EXPERT_KEY.match(key)
        if not pe and not sh:
            continue
        if key in ckpt:
            have = ckpt[key][0]
            if have != want and not st.allow_shape_mismatch:
                plan.errors.append(
                    f"model expects {_describe(key, want)}, checkpoint {checkpoint_dir} holds "
                    f"{_describe(key, have)}")
            continue
        if pe:
            head, tail = pe["head"], pe["tail"]
            shared_key = head + tail
            if shared_key in ckpt:
                have, dtype = ckpt[shared_key]
                p = st.prepend_axis_num
                scalar = st.data is not None and st.data.numel() == 1 and _numel(have) == 1
                if have == want[p:] or scalar:
                    remap = plan.remaps.setdefault(shared_key, _Remap(shared_key, have, dtype))
                    remap.entries.append((path, st))
                else:
                    plan.errors.append(
                        f"model expects {_describe(key, want)}, checkpoint {checkpoint_dir} holds "
                        f"{_describe(shared_key, have)}")
                continue
            experts = ckpt_experts(head, tail)
            if experts:
                plan.errors.append(
                    f"model expects {_describe(key, want)}, checkpoint "
                    f"{checkpoint_dir} holds the per-expert layout for experts "
                    f"{_ranges(experts)} only ('{head}<e>.{tail}')")
        else:
            head, tail = sh["head"], sh["tail"]
            experts = ckpt_experts(head, tail)
            if experts:
                have = ckpt[f"{head}{experts[0]}.{tail}"][0]
                plan.errors.append(
                    f"model expects {_describe(key, want)}, checkpoint {checkpoint_dir} holds the "
                    f"per-expert layout ('{head}<e>.{tail}', experts {_ranges(experts)}, global "
                    f"shape {have} each); one value for all experts cannot be chosen")
    return plan


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


_SYNTHETIC = "__modelopt_moe_shared_quantizer_state__"


def _agree(plan: LayoutPlan, process_group: Any) -> tuple[list[str], int, dict[str, int]]:
    """Every rank's errors (at most 20 per rank, prefixed with the rank), their total number, and
    for each remapped checkpoint key the lowest rank (in ``process_group``) requesting it: that
    rank's request is the main replica. One ``all_gather_object`` on ``process_group`` (the group
    ``dist_checkpointing.load`` runs on)."""
    mine = (plan.errors[:20], len(plan.errors), sorted(plan.remaps))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered: list[Any] = [None] * torch.distributed.get_world_size(process_group)
        torch.distributed.all_gather_object(gathered, mine, group=process_group)
    else:
        gathered = [mine]
    errors, total, first_rank = [], 0, {}
    for rank, (errs, count, keys) in enumerate(gathered):
        errors.extend(f"rank {rank}: {e}" for e in errs)
        if count > len(errs):
            errors.append(f"rank {rank}: ... and {count - len(errs)} more")
        total += count
        for k in keys:
            first_rank.setdefault(k, rank)
    return errors, total, first_rank


def _wrap_load(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        """Megatron ``dist_checkpointing.load`` that first maps the checkpoint's ModelOpt expert
        quantizer layout onto the model (``megatron.fixes.modelopt_moe``). Arguments and return
        value as upstream.

        Raises:
            QuantizerLayoutError: on every rank of the load's process group, if any rank requests
                expert quantizer state whose checkpoint layout cannot be mapped.
        """
        ckpt = _checkpoint_tensors(checkpoint_dir)
        # Every rank reads the same checkpoint metadata, so every rank takes the same branch and
        # the collective in _agree is entered by all or by none.
        if not ckpt or not any("quantizer" in k for k in ckpt):
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        bound = signature.bind_partial(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        process_group = bound.arguments.get("process_group")
        plan = plan_quantizer_layout(sharded_state_dict, ckpt, checkpoint_dir)
        errors, total, first_rank = _agree(plan, process_group)
        if errors:
            raise QuantizerLayoutError(
                f"Cannot map the ModelOpt quantizer state of checkpoint {checkpoint_dir} onto this "
                f"model ({total} tensor request(s) on all ranks):\n  " + "\n  ".join(errors))
        if not plan.remaps:
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        rank = (torch.distributed.get_rank(process_group)
                if torch.distributed.is_available() and torch.distributed.is_initialized() else 0)
        return _load_with_remaps(original, plan, first_rank, rank, sharded_state_dict,
                                 checkpoint_dir, args, kwargs)

    load.__wrapped__ = original
    return load


def _load_with_remaps(original, plan: LayoutPlan, first_rank: dict[str, int], rank: int,
                      sharded_state_dict: dict, checkpoint_dir, args, kwargs):
    """Load with each group of per-expert entries replaced by one request of the shared checkpoint
    tensor (whole tensor, main replica on the lowest requesting rank), then give every expert its
    part of it, in place (``ShardedTensor.data``) and in the returned state dict."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if not isinstance(sharded_state_dict, dict) or _SYNTHETIC in sharded_state_dict:
        raise QuantizerLayoutError(
            f"cannot remap quantizer state of {checkpoint_dir} into a {type(sharded_state_dict)}")
    synthetic = {}
    for ckpt_key, remap in plan.remaps.items():
        buf = torch.empty(remap.ckpt_shape, dtype=remap.ckpt_dtype,
                          device=remap.entries[0][1].data.device)
        replica = 0 if first_rank.get(ckpt_key) == rank else 1
        synthetic[ckpt_key] = ShardedTensor.from_rank_offsets(ckpt_key, buf, replica_id=replica)
        for path, st in remap.entries:
            # Placeholder: keeps the structure; loading returns it unchanged.
            _set(sharded_state_dict, path, LocalNonpersistentObject(st.data))
    sharded_state_dict[_SYNTHETIC] = synthetic
    try:
        loaded = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
    finally:
        sharded_state_dict.pop(_SYNTHETIC, None)
        for remap in plan.remaps.values():
            for path, st in remap.entries:
                _set(sharded_state_dict, path, st)
    values = loaded.pop(_SYNTHETIC)
    n = 0
    for ckpt_key, remap in plan.remaps.items():
        full = values[ckpt_key]
        for path, st in remap.entries:
            if full.numel() == 1 and st.data.numel() == 1:
                part = full
            else:
                p = st.prepend_axis_num
                part = full[tuple(slice(o, o + s)
                                  for o, s in zip(st.global_offset[p:], st.local_shape))]
            with torch.no_grad():
                st.data.copy_(part.to(st.data.dtype).reshape(st.data.shape))
            _set(loaded, path, st.data)
            n += 1
    example = next(iter(plan.remaps.values()))
    logger.warning(
        "modelopt_moe: checkpoint %s holds %d expert quantizer tensor(s) as one tensor shared by "
        "all experts of a linear (the layout from before per-expert weight quantizers, e.g. '%s'); "
        "loaded into %d per-expert tensor(s) on this rank, each expert taking the shared value "
        "(e.g. '%s').", checkpoint_dir, len(plan.remaps), example.ckpt_key, n,
        example.entries[0][1].key)
    return loaded


# --------------------------------------------------------------------------------------------------
# CPU: _modelopt_get_extra_state without torch.cuda.synchronize
# --------------------------------------------------------------------------------------------------


class _CudaWithoutSync:
    """``torch.cuda`` as seen by one upstream function: ``synchronize`` is a no-op."""

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithoutCudaSync:
    """``torch`` as seen by one upstream function, with :class:`_CudaWithoutSync` as ``cuda``."""

    cuda = _CudaWithoutSync()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _wrap_get_extra_state(original: Callable) -> Callable:
    # The same code object with ``torch`` resolved to the proxy: upstream's logic, minus the
    # synchronize that needs a CUDA driver. Used only when CUDA is not available.
    cpu_variant = types.FunctionType(
        original.__code__, {**original.__globals__, "torch": _TorchWithoutCudaSync()},
        original.__name__, original.__defaults__, original.__closure__)

    def get_extra_state(self):
        """ModelOpt ``_modelopt_get_extra_state``; on a machine without CUDA, without its
        ``torch.cuda.synchronize()`` (``megatron.fixes.modelopt_moe``). Returns a uint8 tensor
        (pickled state) or ``None``, as upstream."""
        if torch.cuda.is_available():
            return original(self)
        return cpu_variant(self)

    get_extra_state.__wrapped__ = original
    return get_extra_state


# --------------------------------------------------------------------------------------------------
# ModelOpt state (modelopt_state) in Megatron-LM checkpoints
# --------------------------------------------------------------------------------------------------

_CKPT = "megatron.training.checkpointing"
_TRAINING = "megatron.training.training"
_MCORE_PLUGIN = "modelopt.torch.opt.plugins.mcore_dist_checkpointing"

#: True while ``save_checkpoint`` writes a local (non-persistent, per-rank) checkpoint.
_LOCAL_SAVE: contextvars.ContextVar[bool] = contextvars.ContextVar("modelopt_moe_local_save",
                                                                   default=False)
#: ModelOpt state read from a local checkpoint by the first (``rank0=True``) base load of
#: ``load_checkpoint``, waiting for the model that ``generate_state_dict`` gets next.
_PENDING_LOCAL_RESTORE: dict[str, Any] = {}


def _modelopt_state_keys(n_chunks: int) -> list[str]:
    """Keys under which ModelOpt's ``save_modelopt_state`` stores the state of ``n_chunks`` model
    chunks (virtual pipeline stages)."""
    return ["modelopt_state"] if n_chunks == 1 else [f"modelopt_state_{i}" for i in range(n_chunks)]


def is_modelopt_converted(model: Any) -> bool:
    """True if any chunk of ``model`` (a module or a list of modules, wrapped or not) carries
    ModelOpt state (was quantized, or restored from a quantized checkpoint)."""
    import modelopt.torch.opt as mto
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(model if isinstance(model, list) else [model])
    return any(mto.ModeloptStateManager.is_converted(m) for m in chunks)


def enabled_quantizers(model: Any) -> Iterator[tuple[str, Any]]:
    """(name, quantizer) of every enabled ModelOpt ``TensorQuantizer`` of ``model`` (a module or
    a list of chunks, wrapped or not) on this rank; names are prefixed ``<chunk>.`` for several
    chunks."""
    from modelopt.torch.quantization.nn import TensorQuantizer
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(model if isinstance(model, list) else [model])
    for i, chunk in enumerate(chunks):
        for name, m in chunk.named_modules():
            if isinstance(m, TensorQuantizer) and m.is_enabled:
                yield (f"{i}.{name}" if len(chunks) > 1 else name), m


def quantizer_summary(model: Any) -> dict[str, Any]:
    """ModelOpt quantizers of ``model`` on this rank.

    Returns:
        {'quantizers': number of ``TensorQuantizer`` modules, 'enabled': enabled ones, 'static':
        enabled ones with a fixed (calibrated) range, 'calibrated': static ones holding an
        ``_amax``, 'uncalibrated': names of the static ones without (at most 8)}.
    """
    from modelopt.torch.quantization.nn import TensorQuantizer
    from megatron.core.utils import unwrap_model

    total = sum(isinstance(m, TensorQuantizer)
                for chunk in unwrap_model(model if isinstance(model, list) else [model])
                for m in chunk.modules())
    enabled = list(enabled_quantizers(model))
    static = [(n, q) for n, q in enabled if _needs_amax(q)]
    missing = [n for n, q in static if getattr(q, "_amax", None) is None]
    return {"quantizers": total, "enabled": len(enabled), "static": len(static),
            "calibrated": len(static) - len(missing), "uncalibrated": missing[:8]}


def _needs_amax(quantizer: Any) -> bool:
    """True for a quantizer that calibration gives a fixed ``_amax`` (not dynamic, not MX)."""
    return not getattr(quantizer, "_dynamic", False) and not getattr(quantizer, "is_mx_format",
                                                                     False)


def print_quant_summary(model: Any, msg: str = "") -> None:
    """Stand-in for Megatron-LM's ``megatron.post_training.utils.print_distributed_quant_summary``
    (absent from megatron-core 0.19.2): one log line on rank 0 if ``model`` is ModelOpt-converted,
    nothing otherwise."""
    if not is_modelopt_converted(model):
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        logger.warning("ModelOpt%s: rank 0 holds %s", f" ({msg})" if msg else "",
                       quantizer_summary(model))


def latest_checkpoint_dir(load_dir: str | None) -> str | None:
    """The directory of the checkpoint that ``load_checkpoint`` reads from ``load_dir``
    (``iter_XXXXXXX`` named by ``latest_checkpointed_iteration.txt``, ``--ckpt-step``, or
    ``release``), or ``None`` if ``load_dir`` holds no tracker file. Reads the tracker with
    upstream's ``read_metadata`` (an all-reduce over the default group when initialised: call
    on every rank)."""
    from megatron.training import checkpointing as ckpt

    if not load_dir:
        return None
    tracker = ckpt.get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return None
    iteration, release = ckpt.read_metadata(tracker)
    step = getattr(ckpt.get_args(), "ckpt_step", None)  # as load_checkpoint reads it
    if step:
        iteration, release = step, False
    return ckpt.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)


def restore_modelopt_state_pre_wrap_hook(model: list) -> list:
    """``GPTModelConfig.pre_wrap_hooks`` entry behind ``pretrain_gpt.py --restore-modelopt-state``.

    megatron-core 0.19.2 keeps ``GPTModelConfig.restore_modelopt_state`` (it only selects the
    TE-based ModelOpt export spec) but not the step that restores the state: Megatron-LM does it in
    ``megatron.post_training``'s model builder, which 0.19.2 does not ship. This hook does that
    step, with ModelOpt's own ``restore_sharded_modelopt_state``: on the freshly built model chunk,
    before the mixed-precision/DDP wrappers and before the optimizer exists, it re-applies the
    ModelOpt modes of the checkpoint that ``--load`` (or ``--pretrained-checkpoint``) names and
    loads the quantizers' ``_extra_state``; ``load_checkpoint`` then loads the quantizer tensors
    (``_amax`` ...) with the weights, under the current TP/EP/ETP.

    Args:
        model: the list of built model chunks (one: virtual pipeline is not supported by ModelOpt's
            sharded state).

    Returns:
        ``model`` (chunks converted in place).

    Raises:
        ValueError: virtual pipeline parallelism, or a checkpoint format other than ``torch_dist``
            (both raised on every rank, before any collective).
    """
    from megatron.training import get_args

    args = get_args()
    if len(model) != 1:
        raise ValueError("--restore-modelopt-state: ModelOpt's sharded modelopt_state does not "
                         "support virtual pipeline parallelism (got %d model chunks)" % len(model))
    if args.ckpt_format != "torch_dist":
        raise ValueError("--restore-modelopt-state needs --ckpt-format torch_dist (got "
                         f"{args.ckpt_format}); ModelOpt keeps its state in <ckpt>/modelopt_state")
    ckpt_dir = latest_checkpoint_dir(args.load)
    if ckpt_dir is None and getattr(args, "pretrained_checkpoint", None):
        ckpt_dir = latest_checkpoint_dir(args.pretrained_checkpoint)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if ckpt_dir is None or not os.path.isdir(os.path.join(ckpt_dir, "modelopt_state")):
        if rank == 0:
            logger.warning(
                "--restore-modelopt-state: %s holds no ModelOpt state (no <ckpt>/modelopt_state); "
                "the model is built without it (a local checkpoint that holds ModelOpt state "
                "restores it when it is loaded)", ckpt_dir or args.load)
        return model
    plugin = __import__(_MCORE_PLUGIN, fromlist=["restore_sharded_modelopt_state"])
    plugin.restore_sharded_modelopt_state(model, ckpt_dir)
    request_checkpointed_amax(model, ckpt_dir)
    print_quant_summary(model, f"restored from {ckpt_dir}")
    return model


def request_checkpointed_amax(model: list, ckpt_dir: str) -> list[str]:
    """Give restored quantizers whose calibration ModelOpt's sharded restore dropped an ``_amax``
    placeholder, so that ``load_checkpoint`` loads the saved value into it.

    ModelOpt keeps per-quantizer state in the Megatron ``_extra_state`` of the quantized *Megatron
    linears* only, and ``restore_sharded_modelopt_state`` strips it from the global state. Quantizers
    of other modules (``torch.nn.LayerNorm`` input quantizers of the local spec: the input and
    pre-MLP layer norms, the final layer norm) come back enabled but without ``_amax``, so the model
    neither requests the saved value nor uses it: they would quantize with a per-batch dynamic
    amax instead of the calibrated one. For each enabled quantizer without ``_amax`` whose sharded
    key (as this model names it) the checkpoint holds, this registers a NaN placeholder of the
    checkpoint's shape (a load that misses it shows as NaN, not as a silent dynamic range).

    Args:
        model: the model chunks (one), already restored.
        ckpt_dir: the ``torch_dist`` checkpoint directory (``iter_XXXXXXX``).

    Returns:
        the sharded keys given a placeholder.
    """
    missing = [(n, q) for n, q in enabled_quantizers(model)
               if _needs_amax(q) and getattr(q, "_amax", None) is None]
    if not missing:
        return []
    ckpt = _checkpoint_tensors(ckpt_dir) or {}
    device = next((p.device for m in model for p in m.parameters()), torch.device("cpu"))
    by_ptr = {}
    for name, q in missing:
        q.amax = torch.full((), float("nan"), dtype=torch.float32, device=device)
        by_ptr[q._amax.data_ptr()] = (name, q)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    found: dict[int, Any] = {}
    for m in model:
        for _, st in _walk(m.sharded_state_dict()):
            if type(st) is ShardedTensor and st.data is not None and st.data.data_ptr() in by_ptr:
                found[st.data.data_ptr()] = st
    requested = []
    for ptr, (name, q) in by_ptr.items():
        st = found.get(ptr)
        have = ckpt.get(st.key) if st is not None else None
        if have is None:
            del q._amax  # not in the checkpoint: stays as ModelOpt restored it
            continue
        shape, dtype = have
        if tuple(shape) != tuple(st.global_shape):
            if tuple(st.local_shape) != tuple(st.global_shape):
                del q._amax
                logger.warning("modelopt_moe: %s: checkpoint %s holds '%s' with shape %s, the "
                               "model's placeholder is split %s of %s; not requested", name,
                               ckpt_dir, st.key, shape, st.local_shape, st.global_shape)
                continue
            del q._amax
            q.amax = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
        requested.append(st.key)
    if requested:
        logger.info("modelopt_moe: requested %d quantizer amax tensor(s) that ModelOpt's sharded "
                    "restore leaves out (e.g. '%s') from %s", len(requested), requested[0],
                    ckpt_dir)
    return requested


def _restore_from_local(model: list, states: dict[str, Any], checkpoint_name: Any) -> None:
    """Re-apply the ModelOpt state a local checkpoint holds to the (unwrapped) model chunks that
    are about to load it; chunks that already carry ModelOpt state are left as they are."""
    import modelopt.torch.opt as mto
    from megatron.core import parallel_state as mcore_ps

    keys = _modelopt_state_keys(len(model))
    restored = []
    for i, (chunk, key) in enumerate(zip(model, keys)):
        state = states.get(key)
        if state is None or mto.ModeloptStateManager.is_converted(chunk):
            continue
        if len(model) > 1:
            mcore_ps.set_virtual_pipeline_model_parallel_rank(i)
        out = mto.restore_from_modelopt_state(chunk, state)
        if out is not chunk:
            raise RuntimeError(
                f"ModelOpt replaced the root module of model chunk {i} while restoring the state "
                f"of local checkpoint {checkpoint_name}; the chunk is already wrapped (DDP), so "
                "the replacement cannot be installed")
        restored.append(i)
    if restored:
        logger.info("modelopt_moe: restored ModelOpt state of local checkpoint %s into model "
                    "chunk(s) %s", checkpoint_name, restored)
        print_quant_summary(model, f"restored from local checkpoint {checkpoint_name}")


def _wrap_save_checkpoint(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args, **kwargs):
        """Megatron ``save_checkpoint``; a local (non-persistent) checkpoint also stores the
        model's ModelOpt state (``megatron.fixes.modelopt_moe``). Arguments and return value as
        upstream; the configuration is read as upstream's function reads it
        (``megatron.training.checkpointing.get_args``, which callers and upstream's tests patch)."""
        bound = signature.bind_partial(*args, **kwargs)
        if not bound.arguments.get("non_persistent_ckpt", False):
            return original(*args, **kwargs)
        ckpt = sys.modules[_CKPT]
        if getattr(ckpt.get_args(), "non_persistent_ckpt_type", None) != "local":
            return original(*args, **kwargs)
        had = getattr(ckpt, "has_nvidia_modelopt", False)
        token = _LOCAL_SAVE.set(True)
        # Upstream's local branch only prints "Local checkpointing does not support
        # nvidia_modelopt" when this is set; the state is stored (generate_state_dict) instead.
        ckpt.has_nvidia_modelopt = False
        try:
            return original(*args, **kwargs)
        finally:
            ckpt.has_nvidia_modelopt = had
            _LOCAL_SAVE.reset(token)

    save_checkpoint.__wrapped__ = original
    return save_checkpoint


def _wrap_generate_state_dict(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_state_dict(*args, **kwargs):
        """Megatron ``generate_state_dict`` (``megatron.fixes.modelopt_moe``): for a local
        checkpoint save it adds the model's ModelOpt state (ModelOpt's ``save_modelopt_state``:
        key ``modelopt_state``, per rank); when a local checkpoint holding ModelOpt state is being
        loaded, it first restores that state into the model, so the sharded state dict it builds
        requests the quantizer tensors. Arguments and return value as upstream."""
        bound = signature.bind_partial(*args, **kwargs)
        model = bound.arguments["model"]
        loading = bool((bound.arguments.get("optim_sd_kwargs") or {}).get("is_loading"))
        pending = _PENDING_LOCAL_RESTORE.pop("state", None) if loading else None
        if pending is not None:
            _restore_from_local(model, *pending)
        state_dict = original(*args, **kwargs)
        if _LOCAL_SAVE.get():
            plugin = __import__(_MCORE_PLUGIN, fromlist=["save_modelopt_state"])
            plugin.save_modelopt_state(model, state_dict)  # no-op for unconverted models
        return state_dict

    generate_state_dict.__wrapped__ = original
    return generate_state_dict


def _wrap_load_base_checkpoint(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _load_base_checkpoint(*args, **kwargs):
        """Megatron ``_load_base_checkpoint`` (``megatron.fixes.modelopt_moe``): when the first
        base load of ``load_checkpoint`` (no sharded state dict yet) returns a local checkpoint that
        holds ModelOpt state, the state is kept for ``generate_state_dict`` to restore into the
        model before it builds the state dict to load. Arguments and return value as upstream."""
        bound = signature.bind_partial(*args, **kwargs)
        result = original(*args, **kwargs)
        if bound.arguments.get("sharded_state_dict") is not None:
            _PENDING_LOCAL_RESTORE.pop("state", None)  # the load proper: nothing may linger
            return result
        state_dict, checkpoint_name, _release, ckpt_type = result
        ckpt = sys.modules[_CKPT]
        if ckpt_type == ckpt.CheckpointType.LOCAL and isinstance(state_dict, dict):
            states = {k: v for k, v in state_dict.items()
                      if k == "modelopt_state" or k.startswith("modelopt_state_")}
            if states:
                _PENDING_LOCAL_RESTORE["state"] = (states, checkpoint_name)
        return result

    _load_base_checkpoint.__wrapped__ = original
    return _load_base_checkpoint


def _install_checkpoint_paths(patcher: Patcher) -> None:
    """Patches of ``megatron.training`` for ModelOpt state (see the module docstring, part 4)."""
    ckpt = importlib.import_module(_CKPT)
    training = importlib.import_module(_TRAINING)
    plugin = importlib.import_module(_MCORE_PLUGIN)

    if not getattr(ckpt, "has_nvidia_modelopt", False):
        patcher.replace(ckpt, "save_modelopt_state", plugin.save_modelopt_state)
        patcher.replace(ckpt, "save_sharded_modelopt_state", plugin.save_sharded_modelopt_state)
        patcher.replace(ckpt, "print_distributed_quant_summary", print_quant_summary)
        patcher.replace(ckpt, "has_nvidia_modelopt", True)

    original_save = ckpt.save_checkpoint
    wrapped_save = _wrap_save_checkpoint(original_save)
    patcher.replace(ckpt, "save_checkpoint", wrapped_save)
    if getattr(training, "save_checkpoint", None) is original_save:
        patcher.replace(training, "save_checkpoint", wrapped_save)
    patcher.replace(ckpt, "generate_state_dict", _wrap_generate_state_dict(ckpt.generate_state_dict))
    patcher.replace(ckpt, "_load_base_checkpoint",
                    _wrap_load_base_checkpoint(ckpt._load_base_checkpoint))


# --------------------------------------------------------------------------------------------------
# Capability probe
# --------------------------------------------------------------------------------------------------


class _FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@contextlib.contextmanager
def _some_process_group() -> Iterator[None]:
    """torch.distributed initialised (a private 1-rank gloo group if it was not).

    Leaves no trace of the private group: it is destroyed afterwards, and the ``sys.excepthook``
    that ``init_process_group`` installs (it prefixes every traceback line with ``[rank0]:``, the
    rank of the private group) is put back, so the job's real group prints ``[rank1]:``, not
    ``[rank1]: [rank0]:``.
    """
    if torch.distributed.is_initialized():
        yield
        return
    hook = sys.excepthook
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        sys.excepthook = hook


def probe_upstream_expert_replica_ids(linear_sharded_state_dict: Callable) -> tuple | None:
    """Run ModelOpt's ``_MegatronParallelLinear.sharded_state_dict`` for a simulated expert column
    linear on ETP rank 1 of 2 with dense TP rank 0 of 1 (EDP rank 0), and return the
    ``replica_id`` of its ``weight_quantizer._amax`` entry (``None`` if the probe cannot run).

    Upstream 0.47.0 returns ``(0, 0, 0)`` (dense TP rank); a fixed upstream ``(0, 1, 0)``.
    """
    from unittest import mock

    from megatron.core import parallel_state as mcore_ps

    plugin = __import__(_PLUGIN, fromlist=["_MegatronColumnParallelLinear"])
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dense_tp, dense_dp, etp, ep, edp = (_FakeGroup(0, 1), _FakeGroup(0, 1), _FakeGroup(1, 2),
                                        _FakeGroup(0, 1), _FakeGroup(0, 1))
    amax = torch.tensor([1.0])

    class _Base:
        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return {}

    namespace = {
        "is_expert": True, "tp_group": etp, "_tp_group": etp,
        "_pg_collection": types.SimpleNamespace(expt_tp=etp, ep=ep, expt_dp=edp),
        "config": types.SimpleNamespace(),
        "state_dict": lambda self, prefix="", keep_vars=False: {"weight_quantizer._amax": amax},
        "_get_shard_axis_dict": lambda self, sd: {},
        "_process_quantizer_amax": lambda self, k, v, out: out.__setitem__(k, v),
    }
    probe_cls = type("_ModeloptMoeProbeLinear", (plugin._MegatronColumnParallelLinear, _Base),
                     namespace)
    probe = object.__new__(probe_cls)
    patches = [
        mock.patch.object(mcore_ps, "get_tensor_model_parallel_group", lambda *a, **k: dense_tp),
        mock.patch.object(mcore_ps, "get_data_parallel_group", lambda *a, **k: dense_dp),
        mock.patch.object(mcore_ps, "get_expert_tensor_parallel_group", lambda *a, **k: etp),
        mock.patch.object(mcore_ps, "get_expert_model_parallel_group", lambda *a, **k: ep),
        mock.patch.object(mcore_ps, "get_expert_data_parallel_group", lambda *a, **k: edp),
    ]
    try:
        with _some_process_group(), contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            sd = linear_sharded_state_dict(probe, "probe.", (), {"dp_cp_group": dense_dp})
    except Exception as e:  # noqa: BLE001 - a probe that cannot run proves nothing
        logger.info("modelopt_moe probe could not run: %r", e)
        return None
    st = sd.get("probe.weight_quantizer._amax")
    return tuple(st.replica_id) if isinstance(st, ShardedTensor) else None


# --------------------------------------------------------------------------------------------------
# The fix
# --------------------------------------------------------------------------------------------------


class ModeloptMoeQuantizerShardingFix(Fix):
    """Expert quantizer tensors sharded over the expert groups; legacy layout mapping on load."""

    name = "modelopt_moe"
    title = "Per-expert ModelOpt quantizer state: expert-group sharding, layout mapping on load"
    upstream_refs = ("ModelOpt issue 2209",)
    package = "nvidia-modelopt"
    supported = "==0.47.0"
    patches = (
        PatchSpec(
            target=f"{_PLUGIN}._MegatronParallelLinear.sharded_state_dict",
            replacement="megatron.fixes.modelopt_moe._wrap_linear_sharded_state_dict(original)",
            why="quantizer tensors of expert linears (sequential experts) were sharded over the "
                "dense TP/DP groups instead of ETP/EDP: validation fails for ETP > TP, for "
                "TP > ETP with EP > 1, and for channel-split amax with TP != ETP",
        ),
        PatchSpec(
            target=f"{_PLUGIN}._QuantMegatronTEGroupedLinear.sharded_state_dict (with TE only)",
            replacement="megatron.fixes.modelopt_moe._wrap_grouped_sharded_state_dict(original)",
            why="same for TE grouped experts: per-expert weight_quantizer.{i} and shared "
                "input_quantizer tensors get dense-TP replica ids and offsets",
        ),
        PatchSpec(
            target="megatron.core.dist_checkpointing.serialization.load "
                   "(and its re-export megatron.core.dist_checkpointing.load)",
            replacement="megatron.fixes.modelopt_moe._wrap_load(original)",
            why="checkpoints from before per-expert weight quantizers could not be loaded into "
                "per-expert models, and unmappable quantizer layouts failed rank-locally (hang)",
        ),
        PatchSpec(
            target=f"{_OPT_PLUGIN}._modelopt_get_extra_state",
            replacement="megatron.fixes.modelopt_moe._wrap_get_extra_state(original)",
            why="calls torch.cuda.synchronize() unconditionally, so state_dict() of any quantized "
                "module fails on a machine without CUDA",
        ),
        PatchSpec(
            target=f"{_CKPT}.has_nvidia_modelopt (with save_modelopt_state, "
                   "save_sharded_modelopt_state, print_distributed_quant_summary)",
            replacement="True, ModelOpt's own save functions, "
                        "megatron.fixes.modelopt_moe.print_quant_summary",
            why="0.19.2 guards its ModelOpt checkpoint code behind an import of "
                "megatron.post_training.utils, which 0.19.2 does not ship: checkpoints of quantized "
                "models were written without modelopt_state, and resumed unquantized",
        ),
        PatchSpec(
            target=f"{_CKPT}.save_checkpoint (and its binding in {_TRAINING}), "
                   f"{_CKPT}.generate_state_dict, {_CKPT}._load_base_checkpoint",
            replacement="megatron.fixes.modelopt_moe._wrap_save_checkpoint / "
                        "_wrap_generate_state_dict / _wrap_load_base_checkpoint",
            why="local (non-persistent) checkpoints skipped the ModelOpt state ('Local "
                "checkpointing does not support nvidia_modelopt'), so a run recovered from a local "
                "checkpoint or its replica resumed unquantized",
        ),
    )

    def upstream_behaves(self) -> bool:
        """Capability probe (:func:`probe_upstream_expert_replica_ids`): upstream behaves if an
        expert linear's quantizer tensor on ETP rank 1 (dense TP rank 0) gets replica id
        ``(0, 1, 0)``."""
        try:
            plugin = __import__(_PLUGIN, fromlist=["_MegatronParallelLinear"])
        except ImportError:
            return False
        fn = plugin._MegatronParallelLinear.sharded_state_dict
        if getattr(fn, "__module__", None) == __name__:  # this fix is installed: probe upstream
            fn = fn.__wrapped__
        replica_id = probe_upstream_expert_replica_ids(fn)
        logger.info("modelopt_moe probe: expert quantizer replica_id on ETP rank 1 = %s",
                    replica_id)
        return replica_id is not None and len(replica_id) == 3 and replica_id[1] == 1

    def install(self, patcher: Patcher) -> None:
        import megatron.core.dist_checkpointing as dist_ckpt
        import megatron.core.dist_checkpointing.serialization as serialization

        plugin = __import__(_PLUGIN, fromlist=["_MegatronParallelLinear"])
        opt_plugin = __import__(_OPT_PLUGIN, fromlist=["_modelopt_get_extra_state"])

        linear = plugin._MegatronParallelLinear
        patcher.replace(linear, "sharded_state_dict",
                        _wrap_linear_sharded_state_dict(vars(linear)["sharded_state_dict"]))
        grouped = getattr(plugin, "_QuantMegatronTEGroupedLinear", None)
        if grouped is not None:
            patcher.replace(grouped, "sharded_state_dict",
                            _wrap_grouped_sharded_state_dict(vars(grouped)["sharded_state_dict"]))
        wrapped_load = _wrap_load(serialization.load)
        patcher.replace(serialization, "load", wrapped_load)
        if getattr(dist_ckpt, "load", None) is wrapped_load.__wrapped__:
            patcher.replace(dist_ckpt, "load", wrapped_load)
        patcher.replace(opt_plugin, "_modelopt_get_extra_state",
                        _wrap_get_extra_state(opt_plugin._modelopt_get_extra_state))
        _install_checkpoint_paths(patcher)


FIX = ModeloptMoeQuantizerShardingFix()
