"""Unit tests of the fsdp_dtensor fix (single process): key mapping, section sizes, slice
intersection and section views, layout detection, strictness modes, fix registration."""

import logging
import types

import pytest
import torch

from megatron.fixes import fsdp_dtensor as fx

ATTN = "decoder.layers.0.self_attention"
MTP_ATTN = "mtp.layers.0.mtp_model_layer.self_attention"


class Box(torch.nn.Module):
    pass


def _mla_config(q=4, kv=4, pos=2):
    return types.SimpleNamespace(q_lora_rank=q, kv_lora_rank=kv, qk_pos_emb_head_dim=pos)


def _model(hybrid_mtp=False):
    """adapter.module.module.{decoder.layers.0, mtp.layers.0.mtp_model_layer} with fused MLA."""
    gpt = Box()
    gpt.decoder = Box()
    gpt.decoder.layers = torch.nn.ModuleList([Box()])
    gpt.mtp = Box()
    gpt.mtp.layers = torch.nn.ModuleList([Box()])
    gpt.mtp.layers[0].mtp_layer_pattern = "*" if hybrid_mtp else None
    gpt.mtp.layers[0].mtp_model_layer = Box()
    for layer in (gpt.decoder.layers[0], gpt.mtp.layers[0].mtp_model_layer):
        layer.self_attention = Box()
        layer.self_attention.config = _mla_config()
        layer.self_attention.linear_qkv_down_proj = torch.nn.Linear(8, 10, bias=False)
        layer.self_attention.unfused_here = Box()
    inner, outer = Box(), Box()
    inner.module = gpt
    outer.module = inner
    return outer


# ---- key matching ---------------------------------------------------------------------------


def test_strip_wrappers():
    assert fx.strip_wrappers("module.module.decoder.x") == "decoder.x"
    assert fx.strip_wrappers("model.module.decoder.x") == "decoder.x"
    assert fx.strip_wrappers("decoder.module.x") == "decoder.module.x"
    assert fx.strip_wrappers("module.weight") == "weight"


def test_find_model_layout_fused_mla_and_mtp():
    layout = fx.find_model_layout(_model())
    assert set(layout.mla) == {ATTN, MTP_ATTN}
    assert layout.mla[ATTN].parent == "decoder.layers.0"
    assert (layout.mla[ATTN].q_rows, layout.mla[ATTN].kv_rows) == (4, 6)
    assert layout.mtp == ("mtp.layers.0",)
    assert fx.find_model_layout(_model(hybrid_mtp=True)).mtp == ()
    assert not fx.find_model_layout(_model(), mla=False, mtp=False)


def test_map_key_fused_weight_layernorm_and_mtp():
    layout = fx.find_model_layout(_model())
    m = lambda k, c=fx.NEW_LAYOUT: fx.map_key(k, layout, c)
    assert m(f"module.{ATTN}.linear_qkv_down_proj.weight") == [
        (f"module.{ATTN}.linear_q_down_proj.weight", "q"),
        (f"module.{ATTN}.linear_kv_down_proj.weight", "kv"),
    ]
    assert m(f"module.{ATTN}.linear_qkv_down_proj.layer_norm_weight") == [
        ("module.decoder.layers.0.input_layernorm.weight", None)
    ]
    assert m(f"module.module.{ATTN}.linear_qkv_down_proj.layer_norm_bias") == [
        ("module.module.decoder.layers.0.input_layernorm.bias", None)
    ]
    # MLA inside MTP: split, then renamed
    assert m(f"module.{MTP_ATTN}.linear_qkv_down_proj.weight") == [
        ("module.mtp.layers.0.transformer_layer.self_attention.linear_q_down_proj.weight", "q"),
        ("module.mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight", "kv"),
    ]
    assert m(f"module.{MTP_ATTN}.linear_qkv_down_proj.layer_norm_weight") == [
        ("module.mtp.layers.0.transformer_layer.input_layernorm.weight", None)
    ]
    assert m("module.mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight_w") == [
        ("module.mtp.layers.0.transformer_layer.mlp.linear_fc1.weight_w", None)
    ]
    # untouched keys
    for key in (
        "module.decoder.layers.0.mlp.linear_fc2.weight",
        "module.mtp.layers.0.enorm.weight",
        f"module.{ATTN}.linear_q_up_proj.weight",
        f"module.{ATTN}.linear_qkv_down_proj.bias",
    ):
        assert m(key) == [(key, None)]
    # legacy layouts: fused kept, mtp_model_layer kept
    legacy = fx.Choice(frozenset([MTP_ATTN]), frozenset(["mtp.layers.0"]))
    key = f"module.{MTP_ATTN}.linear_qkv_down_proj.weight"
    assert m(key, legacy) == [(key, None)]


def test_map_key_hybrid_mtp_not_renamed():
    layout = fx.find_model_layout(_model(hybrid_mtp=True))
    assert fx.map_key(f"module.{MTP_ATTN}.linear_qkv_down_proj.weight", layout) == [
        (f"module.{MTP_ATTN}.linear_q_down_proj.weight", "q"),
        (f"module.{MTP_ATTN}.linear_kv_down_proj.weight", "kv"),
    ]


# ---- section sizes ---------------------------------------------------------------------------


def test_section_sizes_asymmetric_and_tp():
    s = fx.mla_section_sizes(4, 4, 2, fused_rows=10)
    assert (s.q_rows, s.kv_rows, s.q_rows_local, s.kv_rows_local) == (4, 6, 4, 6)
    assert s.element_ranges(8) == (slice(0, 32), slice(32, 80))
    s2 = fx.mla_section_sizes(4, 4, 2, fused_rows=10, tp_parts=2)
    assert (s2.q_rows_local, s2.kv_rows_local) == (2, 3)
    assert s2.element_ranges(8) == (slice(0, 16), slice(16, 40))


def test_section_sizes_errors():
    with pytest.raises(ValueError, match="expected q_lora_rank"):
        fx.mla_section_sizes(4, 4, 2, fused_rows=11)
    with pytest.raises(ValueError, match="divide by the tensor-parallel size 4"):
        fx.mla_section_sizes(4, 4, 2, fused_rows=10, tp_parts=4)


# ---- slice intersection and section views ----------------------------------------------------


@pytest.mark.parametrize(
    "a,b,want",
    [
        (slice(0, 4), slice(4, 8), slice(4, 4)),  # touching: empty
        (slice(6, 9), slice(0, 4), slice(6, 6)),  # disjoint, after: empty
        (slice(0, 0), slice(0, 4), slice(0, 0)),  # rank owning nothing
        (slice(2, 7), slice(0, 4), slice(2, 4)),  # straddling the boundary
        (slice(2, 7), slice(4, 10), slice(4, 7)),
        (slice(0, 4), slice(0, 4), slice(0, 4)),  # exact
        (slice(1, 3), slice(0, 10), slice(1, 3)),  # contained
    ],
)
def test_intersect(a, b, want):
    assert fx.intersect(a, b) == want


def test_section_view_straddling_exact_and_empty():
    row = (3,)
    weight = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)  # q rows 0-3, kv rows 4-9
    q, kv = slice(0, 12), slice(12, 30)
    local = weight[2:7].clone()  # straddles
    fsdp = slice(6, 21)
    vq, fq = fx.section_view(local, fsdp, q, row)
    vkv, fkv = fx.section_view(local, fsdp, kv, row)
    assert (fq, fkv) == (2, 0)
    assert torch.equal(vq, weight[2:4]) and torch.equal(vkv, weight[4:7])
    assert vq.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
    vkv.fill_(-1)  # a load writes through
    assert torch.equal(local[2:], torch.full((3, 3), -1.0))
    exact = weight[0:4].clone()
    v, f = fx.section_view(exact, slice(0, 12), q, row)
    assert torch.equal(v, weight[0:4]) and f == 0
    v, f = fx.section_view(exact, slice(0, 12), kv, row)
    assert v.shape == (0, 3)
    empty = weight[0:0].clone()
    v, _ = fx.section_view(empty, slice(0, 0), q, row)
    assert v.shape == (0, 3)


def test_section_view_errors():
    with pytest.raises(ValueError, match="whole rows"):
        fx.section_view(torch.zeros(4), slice(2, 6), slice(0, 6), (3,))
    with pytest.raises(ValueError, match="megatron_fsdp_slice"):
        fx.section_view(torch.zeros(2, 3), slice(0, 3), slice(0, 6), (3,))


def test_split_fused_rejects_plain_tensor():
    layout = fx.find_model_layout(_model())
    with pytest.raises(TypeError, match="DTensor"):
        fx.split_fused(torch.zeros(10, 8), layout.mla[ATTN])


# ---- layout detection from checkpoint metadata keys ------------------------------------------


def _prep():
    layout = fx.find_model_layout(_model())
    model = {
        f"module.{p}": torch.zeros(1)
        for p in (
            f"{ATTN}.linear_qkv_down_proj.weight",
            f"{ATTN}.linear_qkv_down_proj.layer_norm_weight",
            "decoder.layers.0.mlp.linear_fc2.weight",
            f"{MTP_ATTN}.linear_qkv_down_proj.weight",
            "mtp.layers.0.mtp_model_layer.mlp.linear_fc2.weight",
            "mtp.layers.0.enorm.weight",
        )
    }
    return fx.Preparation(args=None, layout=layout, originals={("model",): model}, sections={})


def _md(choice):
    prep = _prep()
    return {
        f"model.{k}"
        for key in prep.originals[("model",)]
        for k, _ in fx.map_key(key, prep.layout, choice)
    }


def test_detect_choice_fixed_legacy_and_mixed():
    prep = _prep()
    assert fx.detect_choice(prep, _md(fx.NEW_LAYOUT)) == fx.NEW_LAYOUT
    legacy = fx.Choice(frozenset([ATTN, MTP_ATTN]), frozenset(["mtp.layers.0"]))
    assert fx.detect_choice(prep, _md(legacy)) == legacy
    # unfused model written by unfixed code: sections present, MTP under mtp_model_layer
    old_mtp = fx.Choice(frozenset(), frozenset(["mtp.layers.0"]))
    assert fx.detect_choice(prep, _md(old_mtp)) == old_mtp
    # neither layout: stay with the fixed one (the load then reports the missing keys)
    assert fx.detect_choice(prep, {"model.module.other"}) == fx.NEW_LAYOUT


# ---- strictness ------------------------------------------------------------------------------

KEYS = {"model.module.decoder.layers.0.self_attention.linear_qkv_down_proj.weight"}


@pytest.mark.parametrize("mode", ["assume_ok_unexpected", "raise_unexpected", "raise_all"])
def test_strictness_raising_modes(mode):
    from megatron.core.dist_checkpointing.core import CheckpointingException

    with pytest.raises(CheckpointingException, match="linear_qkv_down_proj.weight"):
        fx.handle_unexpected_keys(KEYS, mode, sync=False)
    assert fx.handle_unexpected_keys(set(), mode, sync=False) == set()


@pytest.mark.parametrize("mode", ["log_unexpected", "log_all"])
def test_strictness_log_modes(mode, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.fixes.fsdp_dtensor"):
        assert fx.handle_unexpected_keys(KEYS, mode, sync=False) == KEYS
    assert "linear_qkv_down_proj.weight" in caplog.text


@pytest.mark.parametrize("mode", ["return_unexpected", "return_all"])
def test_strictness_return_modes(mode, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.fixes.fsdp_dtensor"):
        assert fx.handle_unexpected_keys(KEYS, mode, sync=False) == KEYS
    assert caplog.text == ""


def test_strictness_ignore_finetune_and_bad_value():
    assert fx.handle_unexpected_keys(KEYS, "ignore_all", sync=False) == set()
    assert fx.handle_unexpected_keys(KEYS, "raise_all", finetune=True, sync=False) == set()
    with pytest.raises(ValueError, match="unknown --dist-ckpt-strictness"):
        fx.handle_unexpected_keys(KEYS, "raise_sometimes", sync=False)


def test_unexpected_model_keys_only_model_requests():
    sd = {"model": {"a": 1, "b": {"c": 2}}, "optimizer": {"state": {"x": 1}}}
    md = {"model.a": None, "model.extra_in_ckpt": None}
    assert fx.unexpected_model_keys(sd, md) == {"model.b.c"}


# ---- registration ------------------------------------------------------------------------------


def test_fix_declaration_and_install_reset():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training import checkpointing

    fix = fx.FIX
    assert (fix.package, fix.supported, fix.upstream_refs[0]) == (
        "megatron-core",
        "==0.19.2",
        "Megatron-LM PR 6271",
    )
    assert {p.target.rsplit(".", 1)[1] for p in fix.patches} == {
        "preprocess_fsdp_dtensor_state_dict",
        "default_planner",
        "print_diff_in_state_dicts",
        "sharded_param_state_fsdp_dtensor",
    }
    # 0.19.2 has both defects
    assert not fix.upstream_behaves()
    assert not fix.layout_upstream_fixed() and not fix.empty_shards_upstream_fixed()
    originals = (
        checkpointing.preprocess_fsdp_dtensor_state_dict,
        checkpointing.default_planner,
        checkpointing.print_diff_in_state_dicts,
        DistributedOptimizer.sharded_param_state_fsdp_dtensor,
    )
    try:
        assert fix.apply().value == "active"
        assert checkpointing.preprocess_fsdp_dtensor_state_dict is not originals[0]
        assert checkpointing.default_planner.DefaultLoadPlanner.__name__ == "FsdpDTensorLoadPlanner"
        assert (
            checkpointing.default_planner.create_default_local_load_plan
            is originals[1].create_default_local_load_plan
        )
        assert DistributedOptimizer.sharded_param_state_fsdp_dtensor.__wrapped__ is originals[3]
        assert fix.apply().value == "active"  # idempotent
        assert not fix.empty_shards_upstream_fixed()  # sees through its own wrapper
    finally:
        fix.reset()
    assert (
        checkpointing.preprocess_fsdp_dtensor_state_dict,
        checkpointing.default_planner,
        checkpointing.print_diff_in_state_dicts,
        DistributedOptimizer.sharded_param_state_fsdp_dtensor,
    ) == originals


def test_install_only_what_upstream_still_lacks(monkeypatch):
    """A later upstream that fixed one of the two defects keeps its own code for that one."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training import checkpointing

    fix = fx.FsdpDTensorFix()
    before = (
        checkpointing.preprocess_fsdp_dtensor_state_dict,
        DistributedOptimizer.sharded_param_state_fsdp_dtensor,
    )
    layout_parts = (fx.MlaMtpLayoutFix, fx.LegacyPlannerFix, fx.StrictnessFix)
    for layout_ok, empty_ok in ((True, False), (False, True)):
        for part in layout_parts:  # each part probes upstream on its own
            monkeypatch.setattr(part, "upstream_behaves", lambda self, ok=layout_ok: ok)
        monkeypatch.setattr(fx.EmptyShardsFix, "upstream_behaves", lambda self, ok=empty_ok: ok)
        try:
            assert fix.apply().value == "active"
            assert (checkpointing.preprocess_fsdp_dtensor_state_dict is before[0]) == layout_ok
            assert (DistributedOptimizer.sharded_param_state_fsdp_dtensor is before[1]) == empty_ok
        finally:
            fix.reset()
    for part in layout_parts:
        monkeypatch.setattr(part, "upstream_behaves", lambda self: True)
    assert fix.apply().value == "stands aside: upstream already behaves"
    fix.reset()


def test_prepared_state_dict_copies_are_plain():
    import copy
    import pickle

    d = fx.PreparedStateDict({"a": 1})
    d.fsdp_fix = object()
    assert type(copy.deepcopy(d)) is dict and type(pickle.loads(pickle.dumps(d))) is dict


# ---- behavioural probes: each part its own verdict ----------------------------------------------


def _probes():
    from megatron.fixes.fsdp_dtensor import empty_shards, layout, legacy_planner, strictness

    return {
        "layout": layout.upstream_round_trips_layout,
        "legacy_planner": legacy_planner.upstream_loads_legacy_layout,
        "strictness": strictness.upstream_validates_partial_loads,
        "empty_shards": empty_shards.upstream_keeps_empty_shard_state,
    }


def _verdicts():
    return {name: probe() for name, probe in _probes().items()}


def _live_state():
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        ParamAndGradBuffer,
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training import checkpointing

    names = (
        "preprocess_fsdp_dtensor_state_dict",
        "default_planner",
        "print_diff_in_state_dicts",
        "validate_fsdp_dtensor_model_load",
        "handle_mla_down_proj_in_state_dict",
        "handle_mtp_in_state_dict",
    )
    state = {n: getattr(checkpointing, n, None) for n in names}
    state.update({f"dist.{n}": getattr(dist, n) for n in ("is_initialized", "all_gather_object")})
    state["packer"] = DistributedOptimizer.sharded_param_state_fsdp_dtensor
    state["update_main_grads"] = ParamAndGradBuffer.update_main_grads
    try:
        from megatron.core.transformer import fsdp_dtensor_checkpoint as fdc

        state["make_fsdp_dtensor"] = getattr(fdc, "make_fsdp_dtensor", None)
    except ImportError:
        pass
    return state


def test_every_probe_shows_the_defect_and_leaves_no_state():
    """0.19.2 has every defect; upstream main (Megatron-LM PR 6271) too: its fused MLA split
    raises without a Float16Module, its planner cannot load the legacy layout, its partial-load
    check raises on the failing rank only, and empty shards still get no state."""
    before = _live_state()
    assert _verdicts() == {
        "layout": False,
        "legacy_planner": False,
        "strictness": False,
        "empty_shards": False,
    }
    assert _live_state() == before


def test_probes_see_through_the_fix_once_applied():
    fix = fx.FsdpDTensorFix()
    try:
        assert fix.apply().value == "active"
        assert not any(_verdicts().values())
    finally:
        fix.reset()


def test_probes_not_fooled_by_reformatted_upstream(monkeypatch):
    """Upstream's functions replaced by trivial wrappers (other source, same behaviour): every
    probe still shows the defect."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        ParamAndGradBuffer,
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training import checkpointing

    def rewrapped(fn):
        def renamed_copy(*positional, **named):
            result = fn(*positional, **named)
            return result

        return renamed_copy

    for name in (
        "preprocess_fsdp_dtensor_state_dict",
        "print_diff_in_state_dicts",
        "validate_fsdp_dtensor_model_load",
        "handle_mla_down_proj_in_state_dict",
        "handle_mtp_in_state_dict",
    ):
        if hasattr(checkpointing, name):
            monkeypatch.setattr(checkpointing, name, rewrapped(getattr(checkpointing, name)))

    class ReformattedPlanner(checkpointing.default_planner.DefaultLoadPlanner):
        pass

    monkeypatch.setattr(
        checkpointing,
        "default_planner",
        types.SimpleNamespace(DefaultLoadPlanner=ReformattedPlanner),
    )
    for cls, name in (
        (DistributedOptimizer, "sharded_param_state_fsdp_dtensor"),
        (DistributedOptimizer, "_init_optimizer_states_with_dummy_values"),
        (ParamAndGradBuffer, "update_main_grads"),
    ):
        monkeypatch.setattr(cls, name, rewrapped(getattr(cls, name)))
    assert not any(_verdicts().values()), _verdicts()


def _fixed_preprocess(args, raw_state_dict, model):
    """A stand-in upstream whose preprocessing does put fused MLA / MTP in the unfused layout."""
    out = dict(raw_state_dict)
    msd = {}
    for key, value in raw_state_dict["model"].items():
        if key.endswith("linear_qkv_down_proj.weight"):
            local = value.to_local()
            head = key[: -len("linear_qkv_down_proj.weight")]
            msd[head + "linear_q_down_proj.weight"] = local[:2]
            msd[head + "linear_kv_down_proj.weight"] = local[2:]
        elif key.endswith("linear_qkv_down_proj.layer_norm_weight"):
            msd[
                key.replace("self_attention.linear_qkv_down_proj.layer_norm_", "input_layernorm.")
            ] = value
        else:
            msd[key.replace("mtp_model_layer", "transformer_layer")] = value
    out["model"] = msd
    return out


def _legacy_planner_cls():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class LegacyAwarePlanner(DefaultLoadPlanner):
        """A stand-in upstream planner that reads the fused / mtp_model_layer keys of an older
        checkpoint into the unfused request (the q / kv entries share the fused storage)."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            md = metadata.state_dict_metadata
            model = state_dict["model"]
            for key in [k for k in model if k.endswith("linear_q_down_proj.weight")]:
                head = key[: -len("linear_q_down_proj.weight")]
                fused_key = head + "linear_qkv_down_proj.weight"
                if f"model.{key}" not in md and f"model.{fused_key}" in md:
                    q = model.pop(key)
                    kv = model.pop(head + "linear_kv_down_proj.weight")
                    rows = q.shape[0] + kv.shape[0]
                    model[fused_key] = torch.empty(0).set_(
                        q.untyped_storage(), q.storage_offset(), (rows, *q.shape[1:])
                    )
            for key in [k for k in model if ".transformer_layer." in k]:
                old = key.replace(".transformer_layer.", ".mtp_model_layer.")
                if f"model.{key}" not in md and f"model.{old}" in md:
                    model[old] = model.pop(key)
            super().set_up_planner(state_dict, metadata, is_coordinator)

    return LegacyAwarePlanner


def test_layout_and_legacy_planner_probes_are_independent(monkeypatch):
    """An upstream that fixed the layout but not legacy loads (and the converse): each part's
    probe gives its own verdict."""
    from megatron.training import checkpointing

    with monkeypatch.context() as m:
        m.setattr(checkpointing, "preprocess_fsdp_dtensor_state_dict", _fixed_preprocess)
        v = _verdicts()
        assert v["layout"] is True and v["legacy_planner"] is False, v
        assert (
            fx.MlaMtpLayoutFix().decide()[0].value,
            fx.LegacyPlannerFix().decide()[0].value,
        ) == (
            "stands aside: upstream already behaves",
            "active",
        )
    with monkeypatch.context() as m:
        m.setattr(
            checkpointing,
            "default_planner",
            types.SimpleNamespace(DefaultLoadPlanner=_legacy_planner_cls()),
        )
        v = _verdicts()
        assert v["layout"] is False and v["legacy_planner"] is True, v


def test_layout_probe_needs_both_precisions(monkeypatch):
    """Upstream main's split works under a Float16Module (bf16) but raises without one (fp32):
    a stand-in upstream that only handles the bf16 tree is still a defect."""
    from megatron.training import checkpointing

    def bf16_only(args, raw_state_dict, model):
        model.get_submodule("module.module")  # no Float16Module: AttributeError, like main
        return _fixed_preprocess(args, raw_state_dict, model)

    monkeypatch.setattr(checkpointing, "preprocess_fsdp_dtensor_state_dict", bf16_only)
    from megatron.fixes.fsdp_dtensor import layout

    assert layout.upstream_round_trips_layout() is False


def test_strictness_probe_wants_every_rank_to_agree(monkeypatch):
    """An upstream check that raises on the failing rank only is a defect; one that agrees over
    the ranks first (this fix's backport) behaves."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.training import checkpointing

    from megatron.fixes.fsdp_dtensor import strictness

    def raises_here_only(md, sd, path, strict="assume_ok_unexpected"):
        if fx.unexpected_model_keys(sd, md):
            raise CheckpointingException("missing")
        return set()

    def agrees(md, sd, path, strict="assume_ok_unexpected"):
        return fx.validate_fsdp_dtensor_model_load(md, sd, path, strict)

    monkeypatch.setattr(
        checkpointing, "validate_fsdp_dtensor_model_load", raises_here_only, raising=False
    )
    assert strictness.upstream_validates_partial_loads() is False
    monkeypatch.setattr(checkpointing, "validate_fsdp_dtensor_model_load", agrees, raising=False)
    assert strictness.upstream_validates_partial_loads() is True


def test_empty_shards_probe_can_see_a_fixed_upstream(monkeypatch):
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        ParamAndGradBuffer,
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron.fixes.fsdp_dtensor import empty_shards

    def dummy_init_all(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def keeps_grads(self):
        for _, param in self.optimizer_named_parameters:
            param.grad = torch.zeros(0)

    monkeypatch.setattr(
        DistributedOptimizer, "_init_optimizer_states_with_dummy_values", dummy_init_all
    )
    assert empty_shards.upstream_keeps_empty_shard_state() is False  # save still drops the grad
    monkeypatch.setattr(ParamAndGradBuffer, "update_main_grads", keeps_grads)
    assert empty_shards.upstream_keeps_empty_shard_state() is True


def test_layout_defers_upstreams_own_handlers_where_it_has_them():
    """Upstream main calls its own layout handlers inside preprocess_fsdp_dtensor_state_dict;
    the active layout part makes them pass-through (it renders the layout itself, in every
    precision); 0.19.2 has none and gets none added."""
    from megatron.training import checkpointing

    names = ("handle_mla_down_proj_in_state_dict", "handle_mtp_in_state_dict")
    had = {n: getattr(checkpointing, n, None) for n in names}
    part = fx.MlaMtpLayoutFix()
    try:
        assert part.apply().value == "active"
        for n in names:
            if had[n] is None:
                assert not hasattr(checkpointing, n)
            else:
                deferred = getattr(checkpointing, n)
                assert deferred is not had[n] and deferred.__wrapped__ is had[n]
                msd, osd = {"k": 1}, {"state": {}}
                assert deferred(object(), msd, osd) == (msd, osd)
    finally:
        part.reset()
    assert {n: getattr(checkpointing, n, None) for n in names} == had
