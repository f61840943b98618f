"""Distributed bodies of ``test_fsdp_dtensor_dist.py``: one spawn per world size runs them all.

Each scenario saves through the (patched) ``preprocess_fsdp_dtensor_state_dict`` + DCP, loads
through upstream ``_load_base_checkpoint``'s ``fsdp_dtensor`` branch, and compares every rank's
local shards bit for bit with a model built from the checkpoint's values.
"""

from __future__ import annotations

import os

import torch
from fsdp_fake_model import Env, FakeModel, load, make_args, metadata_keys, mismatches, save

FUSED_KEY = "linear_qkv_down_proj"


def _expect_clean(keys: set[str]) -> None:
    assert not any(FUSED_KEY in k for k in keys), sorted(k for k in keys if FUSED_KEY in k)
    assert not any("mtp_model_layer" in k for k in keys)
    for layer in ("decoder.layers.0", "mtp.layers.0.transformer_layer"):
        for name in (
            "self_attention.linear_q_down_proj.weight",
            "self_attention.linear_kv_down_proj.weight",
            "input_layernorm.weight",
        ):
            assert f"model.module.{layer}.{name}" in keys, (layer, name, sorted(keys))
            assert f"optimizer.state.module.module.{layer}.{name}.exp_avg" in keys, (layer, name)


def _loaded(env, fused, shard, **kw) -> FakeModel:
    return FakeModel(env, fused=fused, fill="init", shard=shard, lr=0.1, step=0.0, **kw)


def _check(model: FakeModel, shard: str, **kw) -> None:
    reference = FakeModel(model.env, fused=model.fused, fill="truth", shard=shard, **kw)
    bad = mismatches(model, reference)
    assert not bad, f"rank {torch.distributed.get_rank()}: not bitwise equal: {bad}"


def scenario_views(env: Env) -> None:
    """Sections are views into the fused local shard (load writes straight back)."""
    from megatron.training import checkpointing

    model = FakeModel(env, fused=True, fill="truth", shard="straddle")
    sd = checkpointing.preprocess_fsdp_dtensor_state_dict(
        make_args(), model.full_state_dict(), model.wrapper
    )
    for layer in ("decoder.layers.0", "mtp.layers.0"):
        live = layer if layer.startswith("decoder") else "mtp.layers.0.mtp_model_layer"
        disk = layer if layer.startswith("decoder") else "mtp.layers.0.transformer_layer"
        fused = model.params[f"module.module.{live}.self_attention.linear_qkv_down_proj.weight"]
        storage = fused.to_local().untyped_storage().data_ptr()
        total = 0
        for sec in ("linear_q_down_proj", "linear_kv_down_proj"):
            part = sd["model"][f"module.{disk}.self_attention.{sec}.weight"]
            assert part.to_local().untyped_storage().data_ptr() == storage
            total += part.to_local().numel()
        assert total == fused.to_local().numel()
        ln = sd["model"][f"module.{disk}.input_layernorm.weight"]
        assert (
            ln.to_local().untyped_storage().data_ptr()
            == model.params[
                f"module.module.{live}.self_attention.linear_qkv_down_proj.layer_norm_weight"
            ]
            .to_local()
            .untyped_storage()
            .data_ptr()
        )


def scenario_unfused_to_fused(env: Env, root: str) -> None:
    save(FakeModel(env, fused=False, fill="truth", shard="even"), root)
    _expect_clean(metadata_keys(root))
    model = _loaded(env, True, "straddle")
    load(model, root)
    _check(model, "straddle")


def scenario_fused_to_fused(env: Env, root: str) -> None:
    save(FakeModel(env, fused=True, fill="truth", shard="exact"), root)
    _expect_clean(metadata_keys(root))
    # partial load with the default strictness: nothing is missing, so no error
    model = _loaded(env, True, "empty_first")
    load(model, root, make_args(strict_fsdp_dtensor_load=False))
    _check(model, "empty_first")
    # and into the unfused model
    unfused = _loaded(env, False, "even")
    load(unfused, root)
    _check(unfused, "even")


def scenario_legacy_to_fused(env: Env, root: str) -> None:
    from megatron.training import checkpointing

    from megatron.fixes.fsdp_dtensor import FIX
    from megatron.fixes.fsdp_dtensor.layout import _HANDLERS, defer_upstream_handler

    FIX.reset()  # write like unfixed 0.19.2
    # an upstream with its own layout handlers (main) would not write the legacy layout
    own = {n: getattr(checkpointing, n) for n in _HANDLERS if hasattr(checkpointing, n)}
    try:
        for n, handler in own.items():
            setattr(checkpointing, n, defer_upstream_handler(handler))
        save(FakeModel(env, fused=True, fill="truth", shard="exact"), root)
    finally:
        for n, handler in own.items():
            setattr(checkpointing, n, handler)
        FIX.apply()
    keys = metadata_keys(root)
    assert "model.module.decoder.layers.0.self_attention.linear_qkv_down_proj.weight" in keys
    assert any("mtp_model_layer" in k for k in keys)
    assert not any("linear_q_down_proj" in k or "transformer_layer" in k for k in keys)
    model = _loaded(env, True, "last_all")
    load(model, root)
    _check(model, "last_all")


def scenario_negative_control(env: Env, unfused_root: str) -> None:
    """MLA handling off: a no-strict load of the unfused checkpoint raises by default and, with
    ignore_all, silently keeps the fused weights at their initial values (the 0.19.2 defect)."""
    from unittest import mock

    from megatron.core.dist_checkpointing.core import CheckpointingException

    from megatron.fixes.fsdp_dtensor import FIX, layout

    def mla_not_handled(model, model_state_dict, optimizer_state_dict):
        return model_state_dict, optimizer_state_dict

    with mock.patch.object(layout, "handle_mla_down_proj_in_state_dict", mla_not_handled):
        model = _loaded(env, True, "straddle")
        try:
            load(model, unfused_root, make_args(strict_fsdp_dtensor_load=False))
        except CheckpointingException as e:
            assert "self_attention.linear_qkv_down_proj.weight" in str(e), str(e)
            assert "layer_norm_weight" in str(e), str(e)
        else:
            raise AssertionError("partial load with missing weights did not raise")
        model = _loaded(env, True, "straddle")
        initial = {n: p.to_local().clone() for n, p in model.params.items()}
        load(
            model,
            unfused_root,
            make_args(strict_fsdp_dtensor_load=False, dist_ckpt_strictness="ignore_all"),
        )
        reference = FakeModel(env, fused=True, fill="truth", shard="straddle")
        for name, p in model.params.items():
            if FUSED_KEY in name:
                assert torch.equal(p.to_local(), initial[name]), name  # silently not loaded
            else:
                assert torch.equal(p.to_local(), reference.params[name].to_local()), name
        # log mode loads too and reports the keys
        model = _loaded(env, True, "straddle")
        load(
            model,
            unfused_root,
            make_args(strict_fsdp_dtensor_load=False, dist_ckpt_strictness="return_all"),
        )
        assert any(FUSED_KEY in k for k in FIX.last_unexpected_keys), FIX.last_unexpected_keys


def scenario_shape_mismatch(env: Env, unfused_root: str) -> None:
    """Checkpoint q section [4, H], model q_lora_rank 6: a clear error on every rank."""
    model = _loaded(env, True, "even", q_lora=6)
    key = "model.module.decoder.layers.0.self_attention.linear_q_down_proj.weight"
    for args in (make_args(), make_args(strict_fsdp_dtensor_load=False)):
        try:
            load(model, unfused_root, args)
        except BaseException as e:  # noqa: BLE001 - strict: DCP's CheckpointException (a BaseException) wrapping
            # ours, raised on every rank; partial: ours, from the strictness hook
            msg = str(e)
            assert key in msg and "(4, 4)" in msg and "(6, 4)" in msg, msg
        else:
            raise AssertionError("shape mismatch did not raise")


def run_all(rank: int, world: int, tmp: str, tp: int, extra: bool) -> None:
    """Every scenario on one world size (``extra``: also the shape-mismatch case)."""
    from megatron.fixes.fsdp_dtensor import FIX

    assert FIX.apply().value == "active"
    try:
        env = Env(tp)
        scenario_views(env)
        unfused_root = os.path.join(tmp, "unfused")
        scenario_unfused_to_fused(env, unfused_root)
        scenario_fused_to_fused(env, os.path.join(tmp, "fused"))
        scenario_legacy_to_fused(env, os.path.join(tmp, "legacy"))
        scenario_negative_control(env, unfused_root)
        if extra:
            scenario_shape_mismatch(env, unfused_root)
    finally:
        FIX.reset()
