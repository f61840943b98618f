"""Spawned bodies of ``test_fsdp_dtensor_empty_shards.py``: a real ``DistributedOptimizer`` (its
upstream methods, with only the attributes its fsdp_dtensor path reads) over torch AdamW on
Megatron-FSDP DTensor parameters with uneven shards, some empty on one rank, on 2 gloo ranks.

Parameters (global shape, FSDP row cuts ``[0, rank-1 start, end]``):
``a`` [4, 3] all rows on rank 0, ``b`` [6, 2] split 3/3, ``c`` [5] all on rank 1, ``e`` [2] all on
rank 0. So rank 0 has state for a, b, e and rank 1 for b, c: different keys and a different
number of DTensors (6 vs 4).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from fsdp_fake_model import Env, _dtensor, truth

SPECS = {
    "a": ((4, 3), [0, 4, 4]),
    "b": ((6, 2), [0, 3, 6]),
    "c": ((5,), [0, 0, 5]),
    "e": ((2,), [0, 2, 2]),
}


def make_optimizer(env: Env, salt: str = ""):
    """(DistributedOptimizer, {name: DTensor parameter}) with values ``truth(name, salt)``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = {}
    for name, (shape, cuts) in SPECS.items():
        dt, _ = _dtensor(env, truth(name, shape, "param", salt), False, cuts)
        params[name] = torch.nn.Parameter(dt)
    inner = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)
    opt = object.__new__(DistributedOptimizer)
    opt.optimizer = inner
    opt.ddp_config = types.SimpleNamespace(use_megatron_fsdp=True)
    opt.config = types.SimpleNamespace(optimizer="adam")
    opt.param_to_name = {p: n for n, p in params.items()}  # what _param_name builds lazily
    return opt, params


def train_step(params: dict, iteration: int, optimizer) -> None:
    """One step; an empty local shard gets ``grad = None`` as upstream's ``update_main_grads``."""
    for name, p in params.items():
        local = p._local_tensor
        if local.numel() == 0:
            p.grad = None
            continue
        g = torch.zeros_like(p)
        g._local_tensor.copy_(truth(name, local.shape, "grad", f"{iteration}"))
        p.grad = g
    optimizer.optimizer.step()


def _dtensors(sd) -> list:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        filter_unflattened_state_dict,
    )
    from torch.distributed.tensor import DTensor

    # exactly the walk upstream's preprocess_state_dict_for_uneven_dtensor does, one
    # all_gather_object per entry
    return sorted(
        ".".join(k)
        for k in filter_unflattened_state_dict(sd, visit_condition=lambda x: isinstance(x, DTensor))
    )


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _flat_keys(sd) -> list[str]:
    from megatron.fixes.fsdp_dtensor import flatten_keys

    return sorted(flatten_keys(sd["state"], "state"))


def upstream_keys_differ(rank: int, world: int) -> None:
    """Guard: without the fix, ranks pack different optimizer keys and DTensor counts."""
    from megatron.fixes import fsdp_dtensor as fx

    assert fx.FIX.status.value == "not applied"
    env = Env(1)
    opt, params = make_optimizer(env)
    train_step(params, 1, opt)
    sd = opt.sharded_param_state_fsdp_dtensor()
    keys = _gather(_flat_keys(sd))
    dts = _gather(_dtensors(sd))
    assert keys[0] != keys[1], keys
    assert (len(dts[0]), len(dts[1])) == (6, 4), dts  # 6 vs 4 all_gather_object calls: a hang
    owned = {0: {"a", "b", "e"}, 1: {"b", "c"}}[rank]
    assert set(sd["state"]) == owned


def _save(root: str, params: dict, optimizer_sd: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    sd = {"model": dict(params), "optimizer": optimizer_sd}
    preprocess_state_dict_for_uneven_dtensor(sd)
    dcp.save(sd, checkpoint_id=root)


def _local_state(opt, params) -> dict:
    """{name: {key: local tensor clone}} of this rank."""
    out = {}
    for name, p in params.items():
        st = opt.optimizer.state.get(p, {})
        out[name] = {
            k: (v._local_tensor if hasattr(v, "_local_tensor") else v).clone()
            for k, v in st.items()
        }
    return out


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN and -0.0 aware)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def fixed_roundtrip(rank: int, world: int, root: str) -> None:
    """With the fix: same keys on every rank, save completes, ``step`` of empty-shard
    placeholders is refreshed at every save, load + one more step is bitwise equal to continuing
    the original, and disagreeing steps raise on every rank."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from torch.distributed.tensor import DTensor

    from megatron.fixes import fsdp_dtensor as fx

    fx.FIX.apply()
    env = Env(1)
    opt, params = make_optimizer(env)
    train_step(params, 1, opt)
    sd = opt.sharded_param_state_fsdp_dtensor()
    keys = _gather(_flat_keys(sd))
    assert keys[0] == keys[1] and len(keys[0]) == 12, keys
    assert len(_gather(_dtensors(sd))[1]) == 8
    empty = {0: ["c"], 1: ["a", "e"]}[rank]
    for name in empty:
        st = opt.optimizer.state[params[name]]
        for k in ("exp_avg", "exp_avg_sq"):
            assert isinstance(st[k], DTensor) and st[k].shape == params[name].shape
            assert st[k]._local_tensor.numel() == 0 and st[k].dtype == params[name].dtype
        assert st["step"].item() == 1.0 and st["step"].dtype == torch.float32
    steps = [s["step"] for s in opt.optimizer.state.values()]
    assert len({id(s) for s in steps}) == len(steps), "step tensors must not be shared"
    _save(f"{root}/it1", params, sd)

    train_step(params, 2, opt)
    stale = [opt.optimizer.state[params[n]]["step"].item() for n in empty]
    assert stale == [1.0] * len(empty), stale  # empty shards never step
    sd = opt.sharded_param_state_fsdp_dtensor()
    assert [opt.optimizer.state[params[n]]["step"].item() for n in empty] == [2.0] * len(empty)
    _save(f"{root}/it2", params, sd)
    dist.barrier()
    if rank == 0:  # every step on disk is the real one, whichever rank DCP let write it
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(f"{root}/it2", f"{root}/it2.pt")
        disk = torch.load(f"{root}/it2.pt", weights_only=False)
        assert {n: float(v["step"]) for n, v in disk["optimizer"]["state"].items()} == {
            n: 2.0 for n in SPECS
        }
    dist.barrier()

    # load into an optimizer with other values and no state
    opt2, params2 = make_optimizer(env, salt="other")
    sd2 = opt2.sharded_param_state_fsdp_dtensor(is_loading=True)
    assert {float(s["step"]) for s in opt2.optimizer.state.values()} == {1.0}  # one dummy step
    full = {"model": dict(params2), "optimizer": sd2}
    preprocess_state_dict_for_uneven_dtensor(full)
    dcp.load(full, checkpoint_id=f"{root}/it2")
    opt2.load_state_dict(full["optimizer"])
    for n in SPECS:
        assert _bitwise(params2[n]._local_tensor, params[n]._local_tensor), n
    want, got = _local_state(opt, params), _local_state(opt2, params2)
    assert want.keys() == got.keys()
    for n in want:
        assert want[n].keys() == got[n].keys(), (n, want[n].keys(), got[n].keys())
        for k in want[n]:
            assert _bitwise(want[n][k], got[n][k]), (n, k)
    for o, p in ((opt, params), (opt2, params2)):
        train_step(p, 3, o)
    for n in SPECS:
        assert _bitwise(params2[n]._local_tensor, params[n]._local_tensor), n

    # ranks disagreeing on the step: a clear error on every rank, no hang
    if rank == 0:
        opt.optimizer.state[params["b"]]["step"] = torch.tensor(9.0)
    try:
        opt.sharded_param_state_fsdp_dtensor()
    except ValueError as e:
        assert "different steps (3 .. 9)" in str(e), e
    else:
        raise AssertionError("disagreeing steps were accepted")
