"""Quantizer tensors of MoE expert linears sharded over the expert groups (ModelOpt issue 2209).

nvidia-modelopt 0.47.0 ``_MegatronParallelLinear.sharded_state_dict`` and
``_QuantMegatronTEGroupedLinear.sharded_state_dict`` build the ``ShardedTensor`` s of quantizer
buffers (``_amax``, ``_global_amax``, ``_pre_quant_scale``, real-quant ``_scale`` ...) over the
*dense* TP/DP groups, also for expert linears, whose weights live on the expert groups (ETP, EP,
EDP). ``validate_sharding_integrity`` then raises ``Invalid access pattern for
ShardedTensor(key='...experts.experts.16.linear_fc1.weight_quantizer._amax' ...)`` on save, and on
load under another TP/EP/ETP. Both methods are wrapped: the expert entries are rebuilt with
:func:`expert_quantizer_sharded_tensor` (keys unchanged); non-expert quantizers keep upstream's
dense groups. Probe: :func:`probe_upstream_expert_replica_ids`. Design notes and limits (gated
``linear_fc1`` with channel-split amax across ETP sizes): ``docs/fixes/modelopt_moe.md``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron.fixes.modelopt_moe._probe_group import some_process_group
from megatron.overlay import Fix, Patch, wraps_upstream

logger = logging.getLogger(__name__)

_PLUGIN = "modelopt.torch.quantization.plugins.megatron"
_LINEAR_SSD = f"{_PLUGIN}._MegatronParallelLinear.sharded_state_dict"
#: Defined by the plugin only when Transformer Engine is installed.
_GROUPED_SSD = f"{_PLUGIN}._QuantMegatronTEGroupedLinear.sharded_state_dict"

# Local (module) names of quantizer buffers: ``weight_quantizer._amax``,
# ``weight_quantizer.3._amax``, ``input_quantizer._pre_quant_scale`` ...
_QUANTIZER_LOCAL = re.compile(r"^(?:weight|input|output)_quantizer\.")
_GROUPED_PER_EXPERT_LOCAL = re.compile(r"^weight_quantizer\.(?P<i>\d+)\.(?P<sub>.+)$")


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
    etp = first(
        getattr(module, "tp_group", None),
        getattr(module, "_tp_group", None),
        getattr(pgc, "expt_tp", None),
    )
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
    """Expert coordinates of ``module`` (an expert linear) on this rank; sizes are 1 for groups
    that are not initialised."""
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


def expert_quantizer_sharded_tensor(
    sh_ten, split_axis: int | None, tp_rank: int, tp_size: int, replica_rank: int
):
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
    offsets = [
        (i, sh_ten.global_offset[i], sh_ten.axis_fragmentations[i])
        for i in range(p)
        if sh_ten.axis_fragmentations[i] > 1 or sh_ten.global_offset[i] > 0
    ]
    if split_axis is not None:
        offsets.append((split_axis + p, tp_rank, tp_size))
        replica_id = (0, 0, replica_rank)
    else:
        replica_id = (0, tp_rank, replica_rank)
    return ShardedTensor.from_rank_offsets(
        sh_ten.key,
        sh_ten.data,
        *offsets,
        replica_id=replica_id,
        prepend_axis_num=p,
        allow_shape_mismatch=sh_ten.allow_shape_mismatch,
    )


def regroup_expert_linear_entries(
    sharded_state_dict: dict, prefix: str, axes: dict[str, int], coords: ExpertCoords, grouped: bool
) -> list[str]:
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
        local = k[len(prefix) :]
        v = sharded_state_dict[k]
        if not _QUANTIZER_LOCAL.match(local) or type(v) is not ShardedTensor:
            continue
        shared = grouped and not _GROUPED_PER_EXPERT_LOCAL.match(local)
        replica_rank = coords.edp_rank
        if shared:
            replica_rank += coords.ep_rank * coords.edp_size
        sharded_state_dict[k] = expert_quantizer_sharded_tensor(
            v, axes.get(local), coords.etp_rank, coords.etp_size, replica_rank
        )
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
        local = k[len(prefix) :]
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


def _wrap_linear_sharded_state_dict(original: Callable) -> Callable:
    """Factory of the replacement of ModelOpt's ``_MegatronParallelLinear.sharded_state_dict``
    (``original``): expert linears' quantizer entries regrouped over the expert groups."""

    @wraps_upstream(original)
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """ModelOpt's linear ``sharded_state_dict``; an expert linear's quantizer tensors are
        sharded over the expert groups (ETP/EDP) instead of the dense TP/DP groups."""
        sd = original(self, prefix, sharded_offsets, metadata)
        if is_expert_linear(self):
            axes = _split_axes(self, sd, prefix, grouped=False)
            regroup_expert_linear_entries(sd, prefix, axes, expert_coords_of(self), grouped=False)
        return sd

    return sharded_state_dict


def _wrap_grouped_sharded_state_dict(original: Callable) -> Callable:
    """Factory of the replacement of ModelOpt's ``_QuantMegatronTEGroupedLinear.sharded_state_dict``
    (``original``): per-expert and shared quantizer entries regrouped over the expert groups."""

    @wraps_upstream(original)
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """ModelOpt's TE grouped linear ``sharded_state_dict``; per-expert and shared quantizer
        tensors are sharded over the expert groups (shared ones also replicated over EP)."""
        sd = original(self, prefix, sharded_offsets, metadata)
        axes = _split_axes(self, sd, prefix, grouped=True)
        regroup_expert_linear_entries(sd, prefix, axes, expert_coords_of(self), grouped=True)
        return sd

    return sharded_state_dict


class _FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def probe_upstream_expert_replica_ids(linear_sharded_state_dict: Callable) -> tuple | None:
    """Run ModelOpt's ``_MegatronParallelLinear.sharded_state_dict`` for a simulated expert column
    linear on ETP rank 1 of 2 with dense TP rank 0 of 1 (EDP rank 0), and return the
    ``replica_id`` of its ``weight_quantizer._amax`` entry (``None`` if the probe cannot run).

    Upstream 0.47.0 returns ``(0, 0, 0)`` (dense TP rank); a fixed upstream ``(0, 1, 0)``. Runs no
    collective (a private 1-rank gloo group if ``torch.distributed`` is not initialised).
    """
    from unittest import mock

    from megatron.core import parallel_state as mcore_ps

    plugin = __import__(_PLUGIN, fromlist=["_MegatronColumnParallelLinear"])
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dense_tp, dense_dp, etp, ep, edp = (
        _FakeGroup(0, 1),
        _FakeGroup(0, 1),
        _FakeGroup(1, 2),
        _FakeGroup(0, 1),
        _FakeGroup(0, 1),
    )
    amax = torch.tensor([1.0])

    class _Base:
        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return {}

    namespace = {
        "is_expert": True,
        "tp_group": etp,
        "_tp_group": etp,
        "_pg_collection": types.SimpleNamespace(expt_tp=etp, ep=ep, expt_dp=edp),
        "config": types.SimpleNamespace(),
        "state_dict": lambda self, prefix="", keep_vars=False: {"weight_quantizer._amax": amax},
        "_get_shard_axis_dict": lambda self, sd: {},
        "_process_quantizer_amax": lambda self, k, v, out: out.__setitem__(k, v),
    }
    probe_cls = type(
        "_ModeloptMoeProbeLinear", (plugin._MegatronColumnParallelLinear, _Base), namespace
    )
    probe = object.__new__(probe_cls)
    patches = [
        mock.patch.object(mcore_ps, "get_tensor_model_parallel_group", lambda *a, **k: dense_tp),
        mock.patch.object(mcore_ps, "get_data_parallel_group", lambda *a, **k: dense_dp),
        mock.patch.object(mcore_ps, "get_expert_tensor_parallel_group", lambda *a, **k: etp),
        mock.patch.object(mcore_ps, "get_expert_model_parallel_group", lambda *a, **k: ep),
        mock.patch.object(mcore_ps, "get_expert_data_parallel_group", lambda *a, **k: edp),
    ]
    try:
        with some_process_group(), contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            sd = linear_sharded_state_dict(probe, "probe.", (), {"dp_cp_group": dense_dp})
    except Exception as e:  # noqa: BLE001 - a probe that cannot run proves nothing
        logger.info("expert sharding probe could not run: %r", e)
        return None
    st = sd.get("probe.weight_quantizer._amax")
    return tuple(st.replica_id) if isinstance(st, ShardedTensor) else None


class ExpertQuantizerShardingFix(Fix):
    """Quantizer tensors of expert linears sharded over ETP/EP/EDP instead of dense TP/DP."""

    name = "modelopt_moe.expert_sharding"
    title = "Quantizer tensors of MoE expert linears sharded over the expert groups"
    upstream_refs = ("ModelOpt issue 2209",)
    package = "nvidia-modelopt"
    patches = (
        Patch(
            _LINEAR_SSD,
            _wrap_linear_sharded_state_dict,
            "quantizer tensors of expert linears (sequential experts) were sharded over the "
            "dense TP/DP groups instead of ETP/EDP, so sharding validation failed for "
            "ETP > TP, for TP > ETP with EP > 1, and for channel-split amax with TP != ETP",
            params=("prefix", "sharded_offsets", "metadata"),
        ),
        Patch(
            _GROUPED_SSD,
            _wrap_grouped_sharded_state_dict,
            "TE grouped experts' per-expert weight_quantizer.{i} and shared "
            "input_quantizer tensors got dense-TP replica ids and offsets, so sharding "
            "validation failed as for sequential experts",
            params=("prefix", "sharded_offsets", "metadata"),
            optional=True,  # ModelOpt defines the class only with Transformer Engine
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """True if an expert linear's quantizer tensor on ETP rank 1 (dense TP rank 0) gets
        replica id ``(0, 1, 0)`` from upstream's own method, False if it gets a dense-TP one (or
        the plugin does not import), None if the probe cannot run
        (:func:`probe_upstream_expert_replica_ids`)."""
        try:
            plugin = __import__(_PLUGIN, fromlist=["_MegatronParallelLinear"])
        except ImportError:
            return False
        # upstream's own method, without overlay wrappers (each carries __wrapped__)
        fn = inspect.unwrap(plugin._MegatronParallelLinear.sharded_state_dict)
        replica_id = probe_upstream_expert_replica_ids(fn)
        logger.info(
            "expert sharding probe: expert quantizer replica_id on ETP rank 1 = %s", replica_id
        )
        if replica_id is None:
            return None
        return len(replica_id) == 3 and replica_id[1] == 1


FIX = ExpertQuantizerShardingFix()
