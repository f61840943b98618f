"""megatron.fixes.modelopt_moe, TE grouped experts, without Transformer Engine.

ModelOpt's ``_QuantMegatronTEGroupedLinear`` only exists when TE imports, so this test simulates
every rank of a topology in one process: for each simulated rank it builds the quantizer
ShardedTensors that upstream's grouped ``sharded_state_dict`` produces (same helpers, dense groups
as upstream uses them, per-expert keys ``...experts.experts.{e}.linear_fcN.weight_quantizer...``),
applies the function the fix's grouped wrapper applies (``regroup_expert_linear_entries``, split
axes from upstream's own ``_get_shard_axis_dict`` through the fix's ``_split_axes``), and then
checks the set with Megatron's ``validate_sharding_integrity`` and by value: the local data of every
entry, main replica or not, must be the slice of the true global tensor its offsets claim (which is
what a load under any topology reads). The real TE model is in ``test_modelopt_moe_te_cluster``.

Topology: (world, TP, EP, ETP, PP); rank coordinates from Megatron's ``RankGenerator`` exactly as
``initialize_model_parallel`` builds them (order tp-cp-ep-dp-pp).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

NUM_EXPERTS = 4
NUM_LAYERS = 2
HIDDEN, FFN, BLOCK = 8, 16, 4

TOPOLOGIES = [
    (1, 1, 1, 1, 1),
    (2, 1, 1, 2, 1),
    (2, 2, 1, 1, 1),
    (2, 1, 2, 1, 1),
    (2, 2, 1, 2, 1),
    (2, 1, 1, 1, 2),
    (4, 1, 2, 2, 1),
    (4, 2, 2, 1, 1),
    (4, 2, 2, 2, 1),
    (4, 1, 4, 1, 1),
    (4, 4, 1, 1, 1),
    (4, 2, 1, 4, 1),
    (4, 1, 1, 2, 2),
    (4, 2, 1, 1, 2),
    (4, 1, 2, 1, 2),
    (8, 2, 2, 2, 2),
    (8, 2, 4, 1, 1),
    (8, 4, 2, 2, 1),
    (8, 1, 2, 4, 1),
    (8, 2, 1, 4, 2),
]
RECIPES = ["fp8", "per_channel", "nvfp4", "static_block_awq"]


def _name(t):
    return "ws{}-TP{}-EP{}-ETP{}-PP{}".format(*t)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """``validate_sharding_integrity`` reports on rank 0 and ``get_pg_rank`` needs an initialised
    torch.distributed: a private 1-process gloo group."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Group:
    def __init__(self, rank, size):
        self._r, self._s = rank, size

    def rank(self):
        return self._r

    def size(self):
        return self._s


def rank_coords(world, tp, ep, etp, pp):
    """Per rank: dict of (rank, size) for dense tp/dp and expert etp/ep/edp, and pp rank."""
    from megatron.core.parallel_state import RankGenerator

    assert world % (tp * pp) == 0 and world % (etp * ep * pp) == 0, (world, tp, ep, etp, pp)
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(
        tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
    )

    def where(gen, token, r):
        for g in gen.get_ranks(token):
            if r in g:
                return g.index(r), len(g)
        raise AssertionError((token, r))

    return [
        {
            "tp": where(dense, "tp", r),
            "dp": where(dense, "dp", r),
            "pp": where(dense, "pp", r),
            "etp": where(expert, "tp", r),
            "ep": where(expert, "ep", r),
            "edp": where(expert, "dp", r),
        }
        for r in range(world)
    ]


# ---- true global values ------------------------------------------------------------------------


def true_global(key: str, shape) -> torch.Tensor:
    """Deterministic global value of a quantizer tensor: a function of the key and the position."""
    base = (sum(key.encode()) % 97) + 1.0
    return (
        base
        + torch.arange(
            int(torch.tensor(shape).prod().item()) if shape else 1, dtype=torch.float32
        ).reshape(shape)
        / 1000.0
    )


# ---- one grouped linear, as upstream builds it --------------------------------------------------


class _Quantizer(types.SimpleNamespace):
    pass


def _standin_linear(kind: str, recipe: str, num_gemms: int):
    """An object with upstream's ``_get_shard_axis_dict`` for a grouped column/row linear and the
    attributes that method reads (``get_submodule(..).axis``, ``weight_quantizer[i].axis``)."""
    from modelopt.torch.quantization.plugins import megatron as plugin

    weight_axis = {"fp8": None, "nvfp4": None, "per_channel": 0, "static_block_awq": (0, 2)}[recipe]
    quantizers = [_Quantizer(axis=weight_axis) for _ in range(num_gemms)]
    base = (
        plugin._MegatronColumnParallelLinear
        if kind == "column"
        else plugin._MegatronRowParallelLinear
    )
    cls = type("StandIn", (), {"_get_shard_axis_dict": base._get_shard_axis_dict})
    obj = cls()
    obj.weight_quantizer = quantizers
    obj.get_submodule = (
        lambda name: quantizers[int(name.split(".")[1])] if name.count(".") else quantizers[0]
    )
    return obj


def _local_quantizer_state(kind, recipe, num_gemms, c, global_expert, mlp_prefix, fc):
    """Local quantizer buffers of one grouped linear on one rank, as upstream's
    ``quantizer_state_dict`` (names -> local tensors), cut from the true global values."""
    etp_rank, etp_size = c["etp"]
    out_f, in_f = (FFN, HIDDEN) if kind == "column" else (HIDDEN, FFN)
    state, truth = {}, {}

    def add(local_name, global_key, global_shape, split_axis):
        g = true_global(global_key, global_shape)
        truth[global_key] = g
        if split_axis is None:
            local = g.clone()
        else:
            n = g.shape[split_axis] // etp_size
            local = g.narrow(split_axis, etp_rank * n, n).clone()
        state[local_name] = local

    experts_prefix = f"{mlp_prefix}experts."
    for i in range(num_gemms):
        e = global_expert(i)
        key = f"{experts_prefix}{e}.linear_fc{fc}.weight_quantizer."
        if recipe == "fp8":
            add(f"weight_quantizer.{i}._amax", key + "_amax", (), None)
        elif recipe == "nvfp4":
            add(f"weight_quantizer.{i}._amax", key + "_amax", (), None)
            add(f"weight_quantizer.{i}._global_amax", key + "_global_amax", (), None)
        elif recipe == "per_channel":
            add(
                f"weight_quantizer.{i}._amax",
                key + "_amax",
                (out_f, 1),
                0 if kind == "column" else None,
            )
        else:  # static block over the input dim: row linears split it over ETP
            add(
                f"weight_quantizer.{i}._amax",
                key + "_amax",
                (out_f, in_f // BLOCK),
                1 if kind == "row" else 0,
            )
    shared = f"{experts_prefix}linear_fc{fc}.input_quantizer."
    add("input_quantizer._amax", shared + "_amax", (1,), None)
    if recipe == "static_block_awq":
        add(
            "input_quantizer._pre_quant_scale",
            shared + "_pre_quant_scale",
            (in_f,),
            0 if kind == "row" else None,
        )
    return state, truth


def upstream_grouped_entries(kind, recipe, c, layer, fc):
    """Quantizer ShardedTensors of one grouped linear as ModelOpt 0.47.0 builds them
    (``_QuantMegatronTEGroupedLinear.sharded_state_dict`` + ``TEGroupedMLP`` key prefixing,
    singleton_local_shards), with the dense groups upstream falls back to."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    ep_rank, ep_size = c["ep"]
    num_gemms = NUM_EXPERTS // ep_size
    mlp_prefix = f"decoder.layers.{layer}.mlp.experts."
    linear = _standin_linear(kind, recipe, num_gemms)
    state, truth = _local_quantizer_state(
        kind, recipe, num_gemms, c, lambda i: ep_rank * num_gemms + i, mlp_prefix, fc
    )
    dense = dict(tp_group=_Group(*c["tp"]), dp_cp_group=_Group(*c["dp"]))
    prefix = f"linear_fc{fc}."
    axes = linear._get_shard_axis_dict(state)
    sd = {}
    shared = {k: v for k, v in state.items() if not k.startswith("weight_quantizer.")}
    sd.update(
        make_sharded_tensors_for_checkpoint(
            shared, prefix, {k: a for k, a in axes.items() if k in shared}, (), **dense
        )
    )
    for i in range(num_gemms):
        subs = {k: v for k, v in state.items() if k.startswith(f"weight_quantizer.{i}.")}
        e = ep_rank * num_gemms + i
        # upstream: key f"{i}.weight_quantizer.{sub}", axis from the per-key shard_axis_dict
        expert_state = {f"{i}.weight_quantizer.{k.split('.', 2)[2]}": v for k, v in subs.items()}
        expert_axis = {
            f"{i}.weight_quantizer.{k.split('.', 2)[2]}": axes[k] for k in subs if k in axes
        }
        sub_sd = make_sharded_tensors_for_checkpoint(expert_state, "", expert_axis, (), **dense)
        replace_prefix_for_sharding(sub_sd, f"{i}.", f"{e}.{prefix}")
        for k, st in sub_sd.items():
            st.replica_id = (*st.replica_id[:2], c["edp"][0])
            sd[f"{prefix}weight_quantizer.{i}.{k.split('.weight_quantizer.', 1)[1]}"] = st
    return sd, linear, prefix, mlp_prefix, truth


def rank_entries(t, recipe, r, c, fixed: bool):
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    from megatron.fixes.modelopt_moe.expert_sharding import (
        ExpertCoords,
        _split_axes,
        regroup_expert_linear_entries,
    )

    world, tp, ep, etp, pp = t
    pp_rank = c["pp"][0]
    per_stage = NUM_LAYERS // pp
    out, truth = [], {}
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        for fc, kind in ((1, "column"), (2, "row")):
            sd, linear, prefix, mlp_prefix, tr = upstream_grouped_entries(
                kind, recipe, c, layer, fc
            )
            truth.update(tr)
            if fixed:  # what the fix's grouped wrapper does after upstream returns
                coords = ExpertCoords(*c["etp"], *c["ep"], *c["edp"])
                axes = _split_axes(linear, sd, prefix, grouped=True)
                regroup_expert_linear_entries(sd, prefix, axes, coords, grouped=True)
            replace_prefix_for_sharding(sd, "", f"{mlp_prefix}experts.")  # TEGroupedMLP, singleton
            out.extend(sd.values())
    return out, truth


def check_topology(t, recipe, fixed: bool) -> list[str]:
    """Problems of the simulated topology: validation errors and value mismatches."""
    from megatron.core.dist_checkpointing.validation import validate_sharding_integrity

    coords = rank_coords(*t)
    per_rank, truth = [], {}
    for r, c in enumerate(coords):
        entries, tr = rank_entries(t, recipe, r, c, fixed)
        per_rank.append(entries)
        truth.update(tr)
    problems = []
    try:
        validate_sharding_integrity(per_rank)
    except Exception as e:  # noqa: BLE001 - CheckpointingException
        problems.append(f"validation: {str(e)[:300]}")
    for r, entries in enumerate(per_rank):
        for st in entries:
            g = truth[st.key]
            if tuple(st.global_shape[st.prepend_axis_num :]) != tuple(g.shape) and g.numel() > 1:
                problems.append(
                    f"rank {r} {st.key}: global shape {st.global_shape} != {tuple(g.shape)}"
                )
                continue
            sl = tuple(
                slice(o, o + s)
                for o, s in zip(st.global_offset[st.prepend_axis_num :], st.local_shape)
            )
            want = g.reshape(st.global_shape[st.prepend_axis_num :])[sl] if g.numel() > 1 else g
            if not torch.equal(want.reshape(st.data.shape), st.data):
                problems.append(f"rank {r} {st.key}{list(st.global_offset)}: wrong slice")
    keys = {st.key for entries in per_rank for st in entries}
    assert any(".experts.experts.0.linear_fc1.weight_quantizer._amax" in k for k in keys)
    return problems


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("t", TOPOLOGIES, ids=_name)
def test_modelopt_moe_grouped_sim_fixed_is_valid(t, recipe):
    problems = check_topology(t, recipe, fixed=True)
    assert problems == [], "\n".join(problems[:5])


def test_modelopt_moe_grouped_sim_guard_upstream_fails():
    """GUARD: the same simulation without the fix fails where the dense and expert groups differ
    in ways that matter (ETP > TP: every cell written twice; TP > ETP with EP > 1: experts of odd
    EP ranks written by nobody; TP != ETP with channel/block-split amax: wrong offsets), and passes
    where they coincide, so the simulation itself is sound."""
    failing = {(t, r) for t in TOPOLOGIES for r in RECIPES if check_topology(t, r, fixed=False)}
    must_fail = {
        (t, r)
        for t in TOPOLOGIES
        for r in RECIPES
        if t[3] > t[1]
        or (t[1] > t[3] and t[2] > 1)
        or (t[1] != t[3] and r in ("per_channel", "static_block_awq"))
    }
    assert must_fail and must_fail <= failing, sorted(must_fail - failing)[:5]
    for same in [(1, 1, 1, 1, 1), (2, 1, 2, 1, 1), (2, 2, 1, 2, 1), (4, 1, 4, 1, 1)]:
        for r in ("fp8", "nvfp4", "per_channel"):
            assert (same, r) not in failing, (same, r)
