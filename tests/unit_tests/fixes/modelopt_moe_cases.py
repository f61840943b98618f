"""Worker bodies for tests/unit_tests/fixes/test_modelopt_moe.py (run on gloo processes, CPU).

Each world size is launched once; the body switches topologies inside the launch
(``destroy_model_parallel`` / ``initialize_model_parallel``), builds real Megatron ``SequentialMLP``
experts (local ``ColumnParallelLinear``/``RowParallelLinear``), quantizes them with real ModelOpt
(fake quantization, max calibration on a tiny forward) and saves/loads ``torch_dist`` checkpoints.
Rank 0 writes what it measured to ``results.json``; the tests assert on it.

A topology is ``(TP, EP, ETP, PP)``. The model is two MoE layers (global layer ids 0 and 1, split
over PP) of ``NUM_EXPERTS`` experts each, keys ``decoder.layers.{l}.mlp.experts.experts.{e}...``.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

NUM_EXPERTS = 4
NUM_LAYERS = 2
HIDDEN, FFN = 16, 32

# (TP, EP, ETP, PP) saved in each launch, with the quantization recipe; each one is loaded under the
# next two topologies of the list (cyclically). ModelOpt's SequentialMLP wrapper rejects TP>1 with
# EP>1 ("TP+EP is not supported by QuantSequentialMLP"), so those combinations are only covered by
# the grouped-experts metadata simulation.
SAVES = {
    2: [
        ((1, 1, 2, 1), "FP8_DEFAULT_CFG"),
        ((2, 1, 1, 1), "INT8_DEFAULT_CFG"),
        ((1, 2, 1, 1), "FP8_DEFAULT_CFG"),
        ((2, 1, 2, 1), "INT8_DEFAULT_CFG"),
        ((1, 1, 1, 2), "FP8_DEFAULT_CFG"),
    ],
    4: [
        ((1, 2, 2, 1), "FP8_DEFAULT_CFG"),
        ((1, 4, 1, 1), "INT8_DEFAULT_CFG"),
        ((1, 1, 2, 2), "INT8_DEFAULT_CFG"),
        ((2, 1, 4, 1), "FP8_DEFAULT_CFG"),
    ],
}
LOADS_PER_SAVE = 2
# Legacy-layout and bad-input checks run in this launch only (same code path at any world size).
EXTRA_CHECKS_WORLD = 2


def topo_name(t) -> str:
    return "TP{}/EP{}/ETP{}/PP{}".format(*t)


# ------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------


def init_topology(t) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    tp, ep, etp, pp = t
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def my_layers(t) -> list[int]:
    from megatron.core import parallel_state as ps

    pp = t[3]
    per_stage = NUM_LAYERS // pp
    stage = ps.get_pipeline_model_parallel_rank()
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def build_experts(
    t, recipe: str, seed: int, num_experts: int = NUM_EXPERTS, impl: str = "sequential"
) -> torch.nn.ModuleDict:
    """Quantized experts for this rank's layers: ModuleDict {str(global layer): experts}.

    ``impl``: ``"sequential"`` (SequentialMLP of local Column/RowParallelLinear, CPU) or
    ``"te_grouped"`` (TEGroupedMLP of TE grouped linears, current CUDA device; needs TE).
    """
    import modelopt.torch.quantization as mtq
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules

    tp, ep, etp, pp = t
    te = impl == "te_grouped"
    cfg = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=num_experts,
        use_cpu_initialization=not te,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        add_bias_linear=False,
        moe_grouped_gemm=te,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
    )
    pg = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(seed)
    if te:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        cls, fc1, fc2 = TEGroupedMLP, TEColumnParallelGroupedLinear, TERowParallelGroupedLinear
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.moe.experts import SequentialMLP

        cls, fc1, fc2 = SequentialMLP, ColumnParallelLinear, RowParallelLinear
    model = torch.nn.ModuleDict(
        {
            str(layer): cls(
                num_experts // ep,
                cfg,
                MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2),
                pg_collection=pg,
            )
            for layer in my_layers(t)
        }
    )
    device = torch.device("cuda", torch.cuda.current_device()) if te else torch.device("cpu")

    def forward_loop(m):
        g = torch.Generator().manual_seed(seed + 17)
        for experts in m.values():
            n = experts.num_local_experts
            if te:
                x = (torch.randn(8 * n, HIDDEN, generator=g) * (1 + seed % 5)).to(device)
                experts(x, torch.tensor([8] * n), torch.ones(8 * n, device=device))
            else:
                for expert in experts.local_experts:
                    expert(torch.randn(8, HIDDEN, generator=g) * (1 + seed % 5))

    mtq.quantize(model, getattr(mtq, recipe), forward_loop)
    return model


def prefix(layer) -> str:
    return f"decoder.layers.{layer}.mlp.experts."


def sharded_sd(model) -> dict:
    sd = {}
    for layer, experts in model.items():
        sd.update(experts.sharded_state_dict(prefix=prefix(layer)))
    return sd


def load_into(model, ckpt_dir) -> None:
    """``dist_checkpointing.load`` + ``load_state_dict``, as Megatron's loader does."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(sharded_sd(model), str(ckpt_dir))
    for layer, experts in model.items():
        p = prefix(layer)
        experts.load_state_dict(
            {k[len(p) :]: v for k, v in loaded.items() if k.startswith(p)}, strict=True
        )


def save(model, ckpt_dir) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded_sd(model), str(ckpt_dir))


# ------------------------------------------------------------------------------------------------
# metadata checks
# ------------------------------------------------------------------------------------------------


def validation_error(sd) -> str | None:
    """Megatron's ``validate_sharding_integrity`` on the gathered metadata; its error text (or
    ``None``), the same on every rank."""
    from megatron.core.dist_checkpointing.validation import (
        determine_global_metadata,
        validate_sharding_integrity,
    )

    _, global_metadata = determine_global_metadata(sd)
    err = None
    if dist.get_rank() == 0:
        try:
            validate_sharding_integrity(global_metadata)
        except Exception as e:  # noqa: BLE001 - CheckpointingException, reported by the test
            err = str(e)
    box = [err]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _slices(st):
    p = st.prepend_axis_num
    return tuple(slice(o, o + s) for o, s in zip(st.global_offset[p:], st.local_shape))


def global_values(sd) -> dict[str, torch.Tensor]:
    """Every key's global tensor, assembled from the main replicas of all ranks."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    mine = [
        (
            st.key,
            st.global_shape,
            st.prepend_axis_num,
            st.global_offset,
            st.local_shape,
            st.data.detach().clone(),
        )
        for st in sd.values()
        if type(st) is ShardedTensor and is_main_replica(st.replica_id)
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[str, torch.Tensor] = {}
    for part in everyone:
        for key, gshape, p, goff, lshape, data in part:
            t = full.setdefault(key, torch.full(gshape[p:], float("nan"), dtype=data.dtype))
            t[tuple(slice(o, o + s) for o, s in zip(goff[p:], lshape))] = data.reshape(lshape)
    return full


def compare(sd, expected: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(mismatches, quantizer keys checked) of this rank's entries against ``expected``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    bad, checked = [], []
    for st in sd.values():
        if type(st) is not ShardedTensor:
            continue
        want = expected.get(st.key)
        if want is None:
            bad.append(f"{st.key}: not in checkpoint")
            continue
        want = want[_slices(st)].reshape(st.data.shape)
        if not torch.equal(st.data, want):
            bad.append(
                f"{st.key}{list(st.global_offset)}: {st.data.flatten()[:3].tolist()} != "
                f"{want.flatten()[:3].tolist()}"
            )
        if "quantizer" in st.key:
            checked.append(st.key)
    return bad, checked


def gather(obj) -> list:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def activate_cpu_runtime() -> None:
    """Megatron's torch_dist save calls ``torch.cuda.synchronize()`` (filesystem_async.py
    ``preload_tensors``): use the project's CPU backend for it."""
    from megatron.cpu import runtime

    runtime.activate()


# ------------------------------------------------------------------------------------------------
# launch bodies
# ------------------------------------------------------------------------------------------------


def _summary(err: str | None) -> str | None:
    """Number of invalid keys and the first two messages of a validation error."""
    if err is None:
        return None
    lines = [line for line in err.splitlines() if "Invalid access pattern" in line]
    return f"{len(lines)} invalid: " + "\n".join(line[:400] for line in lines[:2])


# TE grouped experts (cluster only): TP>1 with EP>1 is allowed there.
SAVES_TE = {
    4: [
        ((2, 2, 2, 1), "FP8_DEFAULT_CFG"),
        ((2, 2, 1, 1), "FP8_DEFAULT_CFG"),
        ((1, 2, 2, 1), "FP8_DEFAULT_CFG"),
        ((1, 4, 1, 1), "FP8_DEFAULT_CFG"),
        ((2, 1, 1, 2), "FP8_DEFAULT_CFG"),
    ],
}


def te_roundtrip_body(rank, world_size, out_dir):
    """Cluster: the round trip with TEGroupedMLP on one GPU per rank, over NCCL."""
    dist.destroy_process_group()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "nccl",
        init_method=f"file://{os.path.join(out_dir, 'nccl_store')}",
        rank=rank,
        world_size=world_size,
    )
    roundtrip_body(rank, world_size, out_dir, impl="te_grouped", saves=SAVES_TE[world_size])


def _upstream_validation(model) -> str | None:
    """Validation error of upstream's (unfixed) sharded state dict for the same model."""
    from megatron.fixes.modelopt_moe import FIX

    FIX.reset()  # module instances keep the CPU-safe get_extra_state bound at quantize time
    try:
        return validation_error(sharded_sd(model))
    finally:
        FIX.apply()


def roundtrip_body(rank, world_size, out_dir, impl="sequential", saves=None):
    """Save under every topology of ``saves`` (default SAVES[world_size]), load under the next
    LOADS_PER_SAVE ones; also measure upstream's validation result for each topology; then (for
    sequential experts) the legacy-layout and bad-input checks."""
    from megatron.core import parallel_state as ps

    from megatron.fixes.modelopt_moe import FIX

    if impl == "sequential":
        activate_cpu_runtime()
    FIX.apply()
    results: dict[str, Any] = {
        "world_size": world_size,
        "impl": impl,
        "fix_status": FIX.status.value,
        "validation": {},
        "roundtrip": {},
        "legacy": None,
        "bad_input": {},
    }
    saves = saves or SAVES[world_size]
    for i, (t, recipe) in enumerate(saves):
        init_topology(t)
        model = build_experts(t, recipe, seed=100 + i, impl=impl)
        sd = sharded_sd(model)
        fixed_err = validation_error(sd)
        upstream_err = _upstream_validation(model)
        results["validation"][topo_name(t)] = {
            "recipe": recipe,
            "fixed": fixed_err,
            "upstream": _summary(upstream_err),
        }
        assert fixed_err is None, f"{topo_name(t)}: {fixed_err}"
        ckpt = os.path.join(out_dir, f"{impl}_ws{world_size}_save{i}")
        save(model, ckpt)
        expected = global_values(sd)
        for j in range(1, LOADS_PER_SAVE + 1):
            lt = saves[(i + j) % len(saves)][0]
            init_topology(lt)
            fresh = build_experts(lt, recipe, seed=900 + 10 * i + j, impl=impl)
            before_bad, _ = compare(sharded_sd(fresh), expected)
            load_into(fresh, ckpt)
            after = sharded_sd(fresh)
            bad, checked = compare(after, expected)
            load_err = validation_error(after)
            everyone = gather((bad, checked, len(before_bad)))
            experts = {
                (k.split(".experts.experts.")[0], k.split(".experts.experts.")[1].split(".")[0])
                for _, ch, _ in everyone
                for k in ch
            }
            experts = sorted(x for x in experts if x[1].isdigit())
            results["roundtrip"][f"{topo_name(t)} -> {topo_name(lt)}"] = {
                "recipe": recipe,
                "mismatches": [m for b, _, _ in everyone for m in b][:10],
                "quantizer_tensors_checked": sum(len(ch) for _, ch, _ in everyone),
                "layer_experts_checked": len(experts),
                "differed_before_load": sum(n for _, _, n in everyone),
                "load_validation": load_err,
            }
    if impl != "sequential":
        ps.destroy_model_parallel()
        if rank == 0:
            with open(os.path.join(out_dir, f"results_{impl}_ws{world_size}.json"), "w") as f:
                json.dump(results, f, indent=1)
        return
    if world_size == EXTRA_CHECKS_WORLD:
        results["legacy"] = _legacy_case(rank, world_size, out_dir)
        results["bad_input"] = _bad_input_cases(rank, world_size, out_dir)
    ps.destroy_model_parallel()
    if rank == 0:
        with open(os.path.join(out_dir, f"results_ws{world_size}.json"), "w") as f:
            json.dump(results, f, indent=1)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _legacy_state(model, value_of) -> dict:
    """The model's sharded state dict with every expert quantizer tensor replaced by the layout
    from before per-expert quantizers: one tensor per (layer, linear, quantizer buffer), key
    ``...experts.experts.linear_fcN.<quantizer>.<buffer>``, value ``value_of(key)``, written by
    rank 0 only (replica id = global rank)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron.fixes.modelopt_moe.legacy_layout import _PER_EXPERT_KEY

    out = {}
    for k, st in sharded_sd(model).items():
        m = _PER_EXPERT_KEY.match(st.key) if type(st) is ShardedTensor else None
        if m is None:
            out[k] = st
            continue
        legacy_key = m["head"] + m["tail"]
        out[legacy_key] = ShardedTensor.from_rank_offsets(
            legacy_key, torch.tensor([value_of(legacy_key)]), replica_id=dist.get_rank()
        )
    return out


def _legacy_value(key: str) -> float:
    layer = int(key.split("decoder.layers.")[1].split(".")[0])
    fc = int(key.split("linear_fc")[1][0])
    q = 1 if "weight_quantizer" in key else 2
    return 0.25 * (1 + layer) + 0.0625 * fc + 0.5 * q


def _legacy_case(rank, world_size, out_dir) -> dict:
    """Pre-per-expert checkpoint (built from the old key layout) loaded into per-expert models."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    save_t = (1, 1, world_size, 1) if world_size > 1 else (1, 1, 1, 1)
    init_topology(save_t)
    model = build_experts(save_t, "FP8_DEFAULT_CFG", seed=7)
    ckpt = os.path.join(out_dir, f"ws{world_size}_legacy")
    os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_legacy_state(model, _legacy_value), ckpt)
    res = {}
    for lt in [(world_size, 1, 1, 1), (1, world_size, 1, 1)]:
        init_topology(lt)
        fresh = build_experts(lt, "FP8_DEFAULT_CFG", seed=8)
        cap = _Capture()
        log = logging.getLogger("megatron.fixes.modelopt_moe")
        log.addHandler(cap)
        try:
            load_into(fresh, ckpt)
        finally:
            log.removeHandler(cap)
        bad, n = [], 0
        for layer, experts in fresh.items():
            for i, expert in enumerate(experts.local_experts):
                for fc in (1, 2):
                    lin = getattr(expert, f"linear_fc{fc}")
                    for q in ("weight_quantizer", "input_quantizer"):
                        key = f"{prefix(layer)}experts.linear_fc{fc}.{q}._amax"
                        got = getattr(lin, q).amax.flatten().tolist()
                        n += 1
                        if got != [_legacy_value(key)]:
                            bad.append(f"layer {layer} local expert {i} fc{fc} {q}: {got}")
        # the non-quantizer tensors of the checkpoint are ordinary per-expert ones
        after = sharded_sd(fresh)
        weights_ok = all(
            torch.isfinite(st.data).all().item()
            for st in after.values()
            if type(st) is ShardedTensor
        )
        everyone = gather(
            (bad, n, [line for line in cap.lines if "shared value" in line][:1], weights_ok)
        )
        res[topo_name(lt)] = {
            "mismatches": [b for e in everyone for b in e[0]][:10],
            "amax_checked": sum(e[1] for e in everyone),
            "ranks_logged": sum(1 for e in everyone if e[2]),
            "log_line": next((e[2][0] for e in everyone if e[2]), None),
            "finite": all(e[3] for e in everyone),
        }
    return res


def _expect_layout_error(fn) -> str | None:
    from megatron.fixes.modelopt_moe import QuantizerLayoutError

    try:
        fn()
    except QuantizerLayoutError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - any other failure is reported as such
        return "WRONG EXCEPTION: " + traceback.format_exc()
    return None


def _bad_input_cases(rank, world_size, out_dir) -> dict:
    """Layouts that cannot be mapped: every rank must raise QuantizerLayoutError (and not hang)."""
    from megatron.core import dist_checkpointing

    res = {}
    t = (1, 1, world_size, 1) if world_size > 1 else (1, 1, 1, 1)
    init_topology(t)

    # 1) pre-per-expert layout whose shared tensor has the wrong shape for the model.
    model = build_experts(t, "FP8_DEFAULT_CFG", seed=11)
    ckpt = os.path.join(out_dir, f"ws{world_size}_bad_shape")
    os.makedirs(ckpt, exist_ok=True)
    state = _legacy_state(model, lambda k: 1.0)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for k in list(state):
        if k.endswith(
            "layers.%d.mlp.experts.experts.linear_fc1.weight_quantizer._amax" % my_layers(t)[0]
        ):
            state[k] = ShardedTensor.from_rank_offsets(k, torch.ones(3), replica_id=dist.get_rank())
    dist.barrier()
    dist_checkpointing.save(state, ckpt)
    fresh = build_experts(t, "FP8_DEFAULT_CFG", seed=12)
    res["shared_wrong_shape"] = gather(_expect_layout_error(lambda: load_into(fresh, ckpt)))

    # 2) per-expert FP8 (per-tensor amax) checkpoint into an INT8 (per-channel amax) model.
    ckpt2 = os.path.join(out_dir, f"ws{world_size}_fp8")
    save(model, ckpt2)
    int8 = build_experts(t, "INT8_DEFAULT_CFG", seed=13)
    res["per_tensor_into_per_channel"] = gather(
        _expect_layout_error(lambda: load_into(int8, ckpt2))
    )

    # 3) 4-expert checkpoint into an 8-expert model.
    eight = build_experts(t, "FP8_DEFAULT_CFG", seed=14, num_experts=2 * NUM_EXPERTS)
    res["missing_experts"] = gather(_expect_layout_error(lambda: load_into(eight, ckpt2)))
    dist.barrier()
    return res
