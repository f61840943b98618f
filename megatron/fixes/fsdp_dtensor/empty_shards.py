"""Optimizer state of parameters whose local Megatron-FSDP shard is empty.

megatron-core 0.19.2 ``ParamAndGradBuffer.update_main_grads`` sets ``grad = None`` for a
parameter whose local shard is empty, so torch Adam never creates its state on that rank, and
``DistributedOptimizer._init_optimizer_states_with_dummy_values`` (the load-time dummy step) skips
it too. ``DistributedOptimizer.sharded_param_state_fsdp_dtensor`` then packs different optimizer
keys per rank and ``preprocess_state_dict_for_uneven_dtensor`` (one ``all_gather_object`` per
DTensor) runs a different number of collectives per rank: the ``fsdp_dtensor`` save (and load)
hangs with an empty ``iter_*`` directory. Not MLA/MTP specific. :class:`EmptyShardsFix` wraps the
packer to run :func:`fill_empty_shard_states` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable

import torch

from megatron.fixes.fsdp_dtensor.probes import upstream_of
from megatron.fixes.standins import new_optimizer
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

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
    return [
        param.device_mesh.get_group(i)
        for i, p in enumerate(param.placements)
        if isinstance(p, (Shard, _StridedShard))
    ]


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
    vec = torch.tensor(
        [max(steps, default=ninf), -min(steps, default=float("inf")), present],
        dtype=torch.float64,
        device=device or "cpu",
    )
    for g in groups:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=g)
    hi, lo, any_state = float(vec[0]), -float(vec[1]), bool(vec[2])
    if hi == ninf:
        return StepAgreement(any_state, None)
    if hi != lo:
        raise ValueError(
            f"fsdp_dtensor checkpoint: optimizer parameters are at different steps ({lo:g} .. "
            f"{hi:g}) across the ranks sharing them; cannot give parameters with an empty local "
            "shard a consistent 'step'"
        )
    return StepAgreement(any_state, hi)


def fill_empty_shard_states(dist_optimizer) -> list[str]:
    """Give parameters whose local Megatron-FSDP shard is empty the optimizer state their
    non-empty peers have, so every rank exposes the same ``fsdp_dtensor`` optimizer keys.

    For every parameter ``p`` of the inner optimizer with an empty local shard: each tensor key of
    ``dist_optimizer.optimizer_state_keys`` (``exp_avg``, ``exp_avg_sq``; plus ``max_exp_avg_sq``
    for amsgrad groups) missing from its state becomes ``zeros_like(p)`` (a DTensor of ``p``'s
    global shape and dtype, empty local tensor: nothing is written or read for it), and for torch
    Adam/AdamW ``step`` becomes a new scalar tensor (float32, as torch Adam's; one per parameter)
    equal to the common step of the non-empty parameters (:func:`agree_on_step` over the shard
    groups), refreshed on every call: empty parameters never step, so a stored ``step`` would go
    stale. Nothing is filled while no rank has any state (fresh optimizer). A collective: call it
    on every rank sharing the parameters.

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


def wrap_sharded_param_state_fsdp_dtensor(upstream):
    """Factory of the replacement of ``DistributedOptimizer.sharded_param_state_fsdp_dtensor``:
    :func:`fill_empty_shard_states` before upstream's packing."""

    @wraps_upstream(upstream)
    def sharded_param_state_fsdp_dtensor(self, is_loading: bool = False):
        """Upstream's packing after :func:`fill_empty_shard_states`. On load, upstream's
        dummy-state init runs first, here and only once, so the placeholders take its step."""
        if is_loading:
            self._init_optimizer_states_with_dummy_values()
        fill_empty_shard_states(self)
        return upstream(self, is_loading=False)

    return sharded_param_state_fsdp_dtensor


class _ProbeOptimizer:
    """Stand-in ``self`` of upstream's ``DistributedOptimizer`` methods: a Megatron-FSDP
    distributed optimizer of one rank over a torch Adam with two float32 parameters, ``full``
    (local shard ``[2]``) and ``empty`` (local shard ``[0]``: another rank owns it all)."""

    def __init__(self) -> None:
        self.full = torch.nn.Parameter(torch.ones(2))
        self.empty = torch.nn.Parameter(torch.ones(0))
        self.optimizer = new_optimizer(torch.optim.Adam, [self.full, self.empty], lr=0.1)
        self.ddp_config = SimpleNamespace(use_megatron_fsdp=True)
        self.param_to_name = {self.full: "full", self.empty: "empty"}
        self.optimizer_state_keys = ("exp_avg", "exp_avg_sq")

    @property
    def state(self):
        return self.optimizer.state

    def _param_name(self, param) -> str:
        return self.param_to_name[param]


def _load_packs_same_keys(packer, dummy_init, groups_meta) -> bool:
    """Upstream's load-time packing (``is_loading=True``: dummy-state init, then packing) of
    :class:`_ProbeOptimizer`: do both parameters get the same optimizer-state keys?"""
    opt = _ProbeOptimizer()
    opt._init_optimizer_states_with_dummy_values = lambda: dummy_init(opt)
    opt._param_groups_to_param2group_meta = lambda groups: groups_meta(opt, groups)
    packed = packer(opt, is_loading=True)["state"]
    full, empty = packed.get("full"), packed.get("empty")
    return bool(full) and empty is not None and set(empty) == set(full)


def _save_keeps_empty_grad(buffer_cls) -> bool:
    """Upstream's ``ParamAndGradBuffer.update_main_grads`` on a stand-in buffer of one parameter
    whose local gradient shard is empty: does the parameter keep a gradient (so that torch Adam
    gives it state at the next step, as its peers get)?"""
    local = torch.zeros(0)
    orig = torch.nn.Parameter(torch.zeros(2))
    param = SimpleNamespace(orig_param=orig, grad="unset", decoupled_grad="unset")
    gbuf = SimpleNamespace(param_idx={orig: 0}, get_item=lambda item_id, only_shard=True: local)
    group = SimpleNamespace(main_grad_buffer=gbuf, main_weight_buffer=None, is_expert_param=False)
    buffer = SimpleNamespace(
        optimizer_named_parameters=[("w", param)],
        parameter_groups=[group],
        param_to_param_group={orig: 0},
        bucketing_policy=SimpleNamespace(data_parallel_sharding_strategy="optim_grads_params"),
        use_decoupled_grad=False,
        dist_main_grad={"w": SimpleNamespace(_local_tensor=None)},
        dist_index=None,
    )
    buffer_cls.update_main_grads(buffer)
    return param.grad is not None and not isinstance(param.grad, str)


def upstream_keeps_empty_shard_state() -> bool:
    """Behavioural probe: does upstream give a parameter with an empty local Megatron-FSDP shard
    the optimizer state its peers have, so every rank packs the same ``fsdp_dtensor`` keys?

    1. Load: upstream's ``DistributedOptimizer.sharded_param_state_fsdp_dtensor(is_loading=True)``
       (its dummy-state init, then its packing; this fix's wrapper peeled off) on a one-rank
       stand-in optimizer with a parameter of local shard ``[2]`` and one of local shard ``[0]``:
       the empty one must be packed with the same keys. megatron-core 0.19.2 and upstream main
       skip it in the dummy init and pack it without state (False).
    2. Save (only if 1 holds): upstream's ``ParamAndGradBuffer.update_main_grads`` on a stand-in
       buffer must keep a gradient for an empty shard (0.19.2 sets ``grad = None``).

    A stand-in that upstream's code no longer fits raises (the probe cannot tell).
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        ParamAndGradBuffer,
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    packer = upstream_of(DistributedOptimizer.sharded_param_state_fsdp_dtensor)
    if not _load_packs_same_keys(
        packer,
        upstream_of(DistributedOptimizer._init_optimizer_states_with_dummy_values),
        upstream_of(DistributedOptimizer._param_groups_to_param2group_meta),
    ):
        return False
    return _save_keeps_empty_grad(ParamAndGradBuffer)


class EmptyShardsFix(Fix):
    """Part of ``fsdp_dtensor``: wraps ``DistributedOptimizer.sharded_param_state_fsdp_dtensor``."""

    name = "fsdp_dtensor.empty_shards"
    title = (
        "fsdp_dtensor: parameters with an empty local FSDP shard get optimizer state, so "
        "the save/load no longer hangs"
    )
    upstream_refs = (
        "megatron-core 0.19.2 ParamAndGradBuffer.update_main_grads (empty shard: no "
        "optimizer state, ranks issue different collectives)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
            ".sharded_param_state_fsdp_dtensor",
            wrap_sharded_param_state_fsdp_dtensor,
            "parameters with an empty local FSDP shard had no optimizer state, so ranks packed "
            "different keys and the per-DTensor collectives of the fsdp_dtensor save/load hung "
            "(empty iter_* directory)",
            params=("self", "is_loading"),
        ),
    )

    def upstream_behaves(self) -> bool:
        return upstream_keeps_empty_shard_state()
