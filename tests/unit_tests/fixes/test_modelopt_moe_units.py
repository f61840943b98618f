"""megatron.fixes.modelopt_moe: in-process checks (no process launch).

Capability probe, install/reset, the CPU variant of ``_modelopt_get_extra_state`` and the layout
planner that runs before ``dist_checkpointing.load``.
"""

from __future__ import annotations

import pytest
import torch

import megatron.fixes.modelopt_moe as mm
from megatron.fixes import modelopt_state
from megatron.fixes.modelopt_moe import expert_sharding


@pytest.fixture
def fix():
    mm.FIX.reset()
    yield mm.FIX
    mm.FIX.reset()


def _plugin():
    from modelopt.torch.quantization.plugins import megatron as plugin

    return plugin


def test_modelopt_moe_probe_sees_dense_replica_ids_upstream(fix):
    """0.47.0: an expert linear on ETP rank 1 (dense TP rank 0) gets replica_id[1] == 0."""
    assert not torch.distributed.is_initialized()
    rid = mm.probe_upstream_expert_replica_ids(_plugin()._MegatronParallelLinear.sharded_state_dict)
    assert rid == (0, 0, 0)
    assert fix.upstream_behaves() is False
    assert not torch.distributed.is_initialized(), "probe leaked its private process group"


def test_modelopt_moe_probe_accepts_a_fixed_upstream(fix):
    """The probe recognises correct behaviour: run against the fixed method it reports ETP rank 1,
    so a fixed upstream would make the fix stand aside."""
    original = _plugin()._MegatronParallelLinear.sharded_state_dict
    fixed = expert_sharding._wrap_linear_sharded_state_dict(original)
    rid = mm.probe_upstream_expert_replica_ids(fixed)
    assert rid == (0, 1, 0)


def test_modelopt_moe_install_and_reset(fix):
    import megatron.core.dist_checkpointing as dc
    import megatron.core.dist_checkpointing.serialization as ser
    from modelopt.torch.opt.plugins import megatron as opt_plugin

    plugin = _plugin()
    originals = (
        plugin._MegatronParallelLinear.sharded_state_dict,
        ser.load,
        dc.load,
        opt_plugin._modelopt_get_extra_state,
    )
    assert fix.apply().value == "active"
    assert fix.apply().value == "active"  # idempotent
    assert plugin._MegatronParallelLinear.sharded_state_dict.__wrapped__ is originals[0]
    assert ser.load.__wrapped__ is originals[1] and dc.load is ser.load
    assert opt_plugin._modelopt_get_extra_state.__wrapped__ is originals[3]
    fix.reset()
    assert (
        plugin._MegatronParallelLinear.sharded_state_dict,
        ser.load,
        dc.load,
        opt_plugin._modelopt_get_extra_state,
    ) == originals


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without CUDA")
def test_modelopt_moe_extra_state_without_cuda(fix):
    """Upstream's ``_modelopt_get_extra_state`` calls ``torch.cuda.synchronize()`` and fails on a
    machine without CUDA (GUARD); with the fix the same state is serialised."""
    from modelopt.torch.opt.plugins import megatron as opt_plugin
    from modelopt.torch.utils import safe_load

    def callback(module):
        return {
            "modelopt_quantizer_state": {"weight_quantizer": {"num_bits": (4, 3), "axis": None}}
        }

    upstream_module = torch.nn.Linear(2, 2)
    opt_plugin.register_modelopt_extra_state_callbacks(upstream_module, callback, lambda m, s: None)
    with pytest.raises(RuntimeError):
        upstream_module.get_extra_state()

    fix.apply()
    module = torch.nn.Linear(2, 2)
    opt_plugin.register_modelopt_extra_state_callbacks(module, callback, lambda m, s: None)
    state = module.get_extra_state()
    assert state.dtype == torch.uint8
    assert safe_load(state.numpy().tobytes()) == callback(module)


# ---- layout planner (pure) -----------------------------------------------------------------------


def _st(key, shape, replica_id=0):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, torch.zeros(shape), replica_id=replica_id)


P = "decoder.layers.3.mlp.experts.experts."


def test_modelopt_moe_plan_maps_legacy_shared_layout():
    sd = {
        "model": {f"a{e}": _st(f"{P}{e}.linear_fc1.weight_quantizer._amax", (1,)) for e in (4, 5)}
    }
    sd["model"]["w"] = _st(f"{P}4.linear_fc1.weight", (8, 4))
    ckpt = {
        f"{P}linear_fc1.weight_quantizer._amax": ((1,), torch.float32),
        f"{P}4.linear_fc1.weight": ((8, 4), torch.float32),
    }
    plan = mm.plan_quantizer_layout(sd, ckpt)
    assert plan.errors == []
    assert list(plan.remaps) == [f"{P}linear_fc1.weight_quantizer._amax"]
    assert [path for path, _ in plan.remaps[f"{P}linear_fc1.weight_quantizer._amax"].entries] == [
        ("model", "a4"),
        ("model", "a5"),
    ]


def test_modelopt_moe_plan_leaves_matching_and_absent_state_alone():
    sd = {
        "x": _st(f"{P}0.linear_fc1.weight_quantizer._amax", (1,)),
        "y": _st(f"{P}1.linear_fc1.input_quantizer._amax", (1,)),  # absent in every layout
        "z": _st("decoder.layers.3.mlp.shared_experts.linear_fc1.weight_quantizer._amax", (1,)),
    }
    ckpt = {f"{P}0.linear_fc1.weight_quantizer._amax": ((1,), torch.float32)}
    plan = mm.plan_quantizer_layout(sd, ckpt)
    assert plan.errors == [] and plan.remaps == {}


def test_modelopt_moe_plan_errors_name_key_and_both_layouts():
    sd = {
        "a": _st(f"{P}2.linear_fc2.weight_quantizer._amax", (16, 1)),
        "b": _st(f"{P}linear_fc1.input_quantizer._amax", (1,)),
    }
    ckpt = {
        f"{P}linear_fc2.weight_quantizer._amax": ((1, 4), torch.float32),
        f"{P}0.linear_fc1.input_quantizer._amax": ((1,), torch.float32),
        f"{P}1.linear_fc1.input_quantizer._amax": ((1,), torch.float32),
    }
    plan = mm.plan_quantizer_layout(sd, ckpt, "/ckpt")
    assert len(plan.errors) == 2
    assert (
        f"model expects '{P}2.linear_fc2.weight_quantizer._amax' (per-expert layout, global "
        f"shape (16, 1)), checkpoint /ckpt holds '{P}linear_fc2.weight_quantizer._amax' (one "
        f"tensor shared by all experts of the linear, global shape (1, 4))"
    ) == plan.errors[0]
    assert f"model expects '{P}linear_fc1.input_quantizer._amax'" in plan.errors[1]
    assert "per-expert layout" in plan.errors[1] and "experts 0-1" in plan.errors[1]


def test_modelopt_moe_expert_quantizer_sharded_tensor():
    st = _st(f"{P}0.linear_fc1.weight_quantizer._amax", (4, 1), replica_id=(0, 0, 0))
    split = mm.expert_quantizer_sharded_tensor(st, 0, tp_rank=1, tp_size=2, replica_rank=3)
    assert (split.global_shape, split.global_offset, split.replica_id) == (
        (8, 1),
        (4, 0),
        (0, 0, 3),
    )
    assert split.data is st.data and split.key == st.key
    rep = mm.expert_quantizer_sharded_tensor(st, None, tp_rank=1, tp_size=2, replica_rank=0)
    assert (rep.global_shape, rep.global_offset, rep.replica_id) == ((4, 1), (0, 0), (0, 1, 0))


def test_save_checkpoint_wrapper_reads_args_as_upstream_does(monkeypatch):
    """A caller that works with upstream's ``save_checkpoint`` (``checkpointing.get_args`` patched,
    no global args: upstream's own dist_checkpointing tests) works with the fork's wrapper; the
    global ``megatron.training.get_args`` it used to call raises there."""
    import types

    from megatron.training import checkpointing, global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    with pytest.raises(AssertionError, match="args is not initialized"):
        global_vars.get_args()  # what the wrapper called before: every non-persistent save failed
    seen = []

    def upstream(
        iteration,
        model,
        optimizer,
        opt_param_scheduler,
        num_floating_point_operations_so_far,
        checkpointing_context=None,
        pipeline_rank=None,
        expert_rank=None,
        tensor_rank=None,
        pipeline_parallel=None,
        expert_parallel=None,
        non_persistent_ckpt=False,
        train_data_iterator=None,
        preprocess_common_state_dict_fn=None,
        release=False,
    ):
        seen.append((iteration, non_persistent_ckpt, checkpointing.has_nvidia_modelopt))

    wrapped = modelopt_state._wrap_save_checkpoint(upstream)
    had = getattr(checkpointing, "has_nvidia_modelopt", False)
    for kind in ("global", "local"):
        monkeypatch.setattr(
            checkpointing,
            "get_args",
            lambda kind=kind: types.SimpleNamespace(non_persistent_ckpt_type=kind),
        )
        wrapped(3, None, None, None, 0, non_persistent_ckpt=True)
    wrapped(4, None, None, None, 0)  # persistent: args not even read
    assert seen == [(3, True, had), (3, True, False), (4, False, had)]
    assert checkpointing.has_nvidia_modelopt == had


# ---- the probes of the other parts of the modelopt_moe group -----------------------------------


def test_modelopt_moe_every_part_probes_its_defect_on_the_pins(fix):
    """Each part of the group has its own probe, and each sees its defect on the pinned upstream."""
    assert [p.name for p in fix.parts] == [
        "modelopt_moe.expert_sharding",
        "modelopt_moe.legacy_layout",
        "modelopt_moe.extra_state_cuda_sync",
        "modelopt_state",
    ]
    assert [p.upstream_behaves() for p in fix.parts] == [False] * 4
    assert not torch.distributed.is_initialized(), "a probe leaked its private process group"


def test_modelopt_moe_legacy_layout_probe_accepts_a_fixed_upstream():
    import megatron.core.dist_checkpointing.serialization as ser

    from megatron.fixes.modelopt_moe import legacy_layout

    assert legacy_layout.probe_upstream_maps_legacy_layout(ser.load) is False
    assert legacy_layout.probe_upstream_maps_legacy_layout(legacy_layout._wrap_load(ser.load))
    assert not torch.distributed.is_initialized()


def test_modelopt_moe_extra_state_probe_accepts_a_fixed_upstream():
    from modelopt.torch.opt.plugins import megatron as opt_plugin

    from megatron.fixes.modelopt_moe import extra_state_cuda_sync as part

    upstream = opt_plugin._modelopt_get_extra_state
    assert part.probe_upstream_syncs_without_cuda(upstream) is True
    assert part.probe_upstream_syncs_without_cuda(part._wrap_get_extra_state(upstream)) is False


# ---- behavioural probes: what they see on the pins, and that rewording upstream cannot fool them -


def _reworded_save_checkpoint():
    """Upstream's ``save_checkpoint``, re-written: its local variables renamed and every string
    (the local-checkpoint warning included) changed, compiled into a copy of its module's namespace
    (same behaviour, different source text)."""
    import ast
    import inspect
    import textwrap

    from megatron.training import checkpointing

    upstream = inspect.unwrap(checkpointing.save_checkpoint)
    tree = ast.parse(textwrap.dedent(inspect.getsource(upstream)))
    renames = {"state_dict": "sd_renamed", "ckpt_type": "kind_renamed", "args": "cfg_renamed"}

    class Reword(ast.NodeTransformer):
        def visit_Name(self, node):
            node.id = renames.get(node.id, node.id)
            return node

        def visit_Constant(self, node):
            if isinstance(node.value, str) and "nvidia_modelopt" in node.value:
                node.value = "ModelOpt state is left out of this save."
            return node

    tree = ast.fix_missing_locations(Reword().visit(tree))
    namespace = dict(vars(checkpointing))
    exec(compile(tree, "<reworded save_checkpoint>", "exec"), namespace)
    reworded = namespace["save_checkpoint"]
    assert inspect.getsource(upstream) != ast.unparse(tree)
    return reworded


def test_modelopt_state_probe_sees_the_defect_on_the_pins():
    """Upstream's own save_checkpoint, run for a stand-in model: a persistent save stores no
    ModelOpt state (the flag is False: no megatron.post_training), a local save none even with
    the flag on; with the flag on, a persistent save stores it (the probe sees the flag act)."""
    import inspect

    from megatron.training import checkpointing

    save = inspect.unwrap(checkpointing.save_checkpoint)
    generate = inspect.unwrap(checkpointing.generate_state_dict)
    probe = modelopt_state.probe_upstream_saves_modelopt_state
    assert checkpointing.has_nvidia_modelopt is False
    assert probe(save, generate, False, local=False) is False
    assert probe(save, generate, True, local=False) is True
    assert probe(save, generate, True, local=True) is False
    assert modelopt_state.FIX.upstream_behaves() is False


def test_modelopt_state_probe_is_not_fooled_by_reworded_source(monkeypatch):
    """The old probe looked for upstream's warning text in its source; the behavioural one still
    sees the defect in a copy with renamed variables and another warning, and through a
    ``functools.wraps`` wrapper."""
    import functools

    from megatron.training import checkpointing

    reworded = _reworded_save_checkpoint()
    monkeypatch.setattr(checkpointing, "save_checkpoint", reworded)
    assert modelopt_state.FIX.upstream_behaves() is False

    @functools.wraps(reworded)
    def wrapper(*args, **kwargs):
        return reworded(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "save_checkpoint", wrapper)
    assert modelopt_state.FIX.upstream_behaves() is False


def test_modelopt_state_probe_accepts_a_behaving_upstream():
    """A save_checkpoint that stores the ModelOpt state in persistent and local saves (the
    behaviour the fix gives) makes the probe report True: the fix would stand aside."""
    import inspect

    from megatron.training import checkpointing

    def behaving_save_checkpoint(
        iteration,
        model,
        optimizer,
        opt_param_scheduler,
        flops,
        checkpointing_context=None,
        non_persistent_ckpt=False,
        **kwargs,
    ):
        args = get_args()  # noqa: F821 - resolved in the probe's namespace
        state_dict = generate_state_dict(  # noqa: F821
            args, model, optimizer, opt_param_scheduler, None, model_sd_kwargs={"metadata": {}}
        )
        save_modelopt_state(model, state_dict)  # noqa: F821
        if non_persistent_ckpt:
            checkpointing_context["local_checkpoint_manager"].save(state_dict, iteration)
        else:
            torch.save(state_dict, "unused")

    generate = inspect.unwrap(checkpointing.generate_state_dict)
    probe = modelopt_state.probe_upstream_saves_modelopt_state
    assert probe(behaving_save_checkpoint, generate, False, local=False) is True
    assert probe(behaving_save_checkpoint, generate, False, local=True) is True


def test_modelopt_state_probe_sees_upstream_after_apply(fix):
    """Installed, the fix sets has_nvidia_modelopt; the probe still judges upstream's own flag and
    functions, and leaves no state behind."""
    from megatron.training import checkpointing

    assert fix.apply().value == "active"
    assert checkpointing.has_nvidia_modelopt is True
    assert modelopt_state.FIX.upstream_behaves() is False
    fix.reset()
    assert checkpointing.has_nvidia_modelopt is False
    assert not hasattr(checkpointing, "print_distributed_quant_summary")


def test_expert_sharding_probe_is_not_fooled_by_a_wrapper(monkeypatch):
    """A plain wrapper around upstream's method (other source, no ``__wrapped__``) behaves the
    same, and the probe still sees the dense-TP replica id."""
    plugin = _plugin()
    upstream = plugin._MegatronParallelLinear.sharded_state_dict

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return upstream(self, prefix, sharded_offsets, metadata)

    monkeypatch.setattr(plugin._MegatronParallelLinear, "sharded_state_dict", sharded_state_dict)
    assert expert_sharding.FIX.upstream_behaves() is False
    assert not torch.distributed.is_initialized()


def test_legacy_layout_probe_is_not_fooled_by_a_wrapper(monkeypatch):
    import megatron.core.dist_checkpointing.serialization as ser

    from megatron.fixes.modelopt_moe import legacy_layout

    upstream = ser.load

    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        return upstream(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    monkeypatch.setattr(ser, "load", load)
    assert legacy_layout.FIX.upstream_behaves() is False
    assert not torch.distributed.is_initialized()


def test_extra_state_probe_is_not_fooled_by_a_wrapper(monkeypatch):
    """Upstream's function behind a plain wrapper (other code, other globals) still calls
    ``torch.cuda.synchronize()`` without CUDA, and the probe sees it; torch.cuda is put back."""
    from modelopt.torch.opt.plugins import megatron as opt_plugin

    from megatron.fixes.modelopt_moe import extra_state_cuda_sync as part

    upstream = opt_plugin._modelopt_get_extra_state
    sync, available = torch.cuda.synchronize, torch.cuda.is_available

    def _modelopt_get_extra_state(self):
        return upstream(self)

    monkeypatch.setattr(opt_plugin, "_modelopt_get_extra_state", _modelopt_get_extra_state)
    assert part.probe_upstream_syncs_without_cuda(_modelopt_get_extra_state) is True
    assert part.FIX.upstream_behaves() is False
    assert (torch.cuda.synchronize, torch.cuda.is_available) == (sync, available)


def test_modelopt_state_leaves_a_working_modelopt_guard_alone(monkeypatch):
    """Where upstream's ModelOpt guard succeeded (``has_nvidia_modelopt`` True, as with
    megatron.post_training installed), persistent saves already store the state: the probe still
    sees the local defect, and only the local patches are installed."""
    from megatron.training import checkpointing

    part = modelopt_state.FIX
    part.reset()
    monkeypatch.setattr(checkpointing, "has_nvidia_modelopt", True)
    try:
        assert part.upstream_behaves() is False
        assert part.apply().value == "active"
        assert [r.target for r in part.records()] == [
            "megatron.training.checkpointing.save_checkpoint",
            "megatron.training.training.save_checkpoint",
            "megatron.training.checkpointing.generate_state_dict",
            "megatron.training.checkpointing._load_base_checkpoint",
        ]
    finally:
        part.reset()
