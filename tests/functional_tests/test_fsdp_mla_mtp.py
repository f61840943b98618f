"""Megatron-FSDP ``fsdp_dtensor`` checkpoints of a GPT with fused Multi-Latent Attention and MTP,
through the real entrypoint (``pretrain_gpt.py --cpu``, 2 gloo ranks).

Model: the tiny GPT of ``launch.py`` (2 layers, hidden 64, dropout on) with MLA (q_lora_rank 24,
kv_lora_rank 16, qk_head_dim 16, qk_pos_emb_head_dim 8, v_head_dim 12, RoPE), the fused down
projection (``--mla-down-proj-fusion``: one ``linear_qkv_down_proj`` of 24 + 16 + 8 = 48 rows) and
one MTP layer; ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
--use-distributed-optimizer --ckpt-format fsdp_dtensor``. On 2 ranks several parameters have an
empty local FSDP shard, so unfixed upstream (0.19.2) hangs in the first save.

How equality is checked: checkpoints are read back into full tensors with torch's
``dcp_to_torch_save`` (independent of Megatron and of the fix), every ``model.*`` and
``optimizer.*`` entry (weights, ``exp_avg``, ``exp_avg_sq``, ``step``, param-group metadata)
compared bit for bit. A run that loads a checkpoint and re-saves it without training must write
exactly what it read: a weight the load missed would keep its initial value (from another seed)
instead of the value after 2 training steps.

Launches: straight run (4 iterations, saves at 2 and 4); re-save from another seed; the same at
TP=2 on 4 ranks; resume from iteration 2 (losses and grad norms of 3-4 and the iteration-4
checkpoint bitwise); a legacy (unfixed upstream, ``MEGATRON_FIXES_DISABLE=fsdp_dtensor``, 1 rank:
upstream cannot save on 2) and its load into the fixed entrypoint on 2 ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import assert_bitwise_equal, run_pretrain

pytestmark = pytest.mark.slow

#: Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1 (launch.py's default for TP).
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
FSDP = [
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--use-distributed-optimizer",
    "--no-gradient-reduce-div-fusion",
    "--ckpt-format",
    "fsdp_dtensor",
]
Q_LORA, KV_LORA, POS = 24, 16, 8
MLA_MTP = [
    "--multi-latent-attention",
    "--q-lora-rank",
    str(Q_LORA),
    "--kv-lora-rank",
    str(KV_LORA),
    "--qk-head-dim",
    "16",
    "--qk-pos-emb-head-dim",
    str(POS),
    "--v-head-dim",
    "12",
    "--rope-type",
    "rope",
    "--mla-down-proj-fusion",
    "--mtp-num-layers",
    "1",
    "--position-embedding-type",
    "rope",
]
MODEL = FSDP + MLA_MTP
OTHER_SEED = ["--seed", "999"]
#: re-save what was loaded: train_iters == loaded iteration runs no step; pretrain() saves at the
#: end because the iteration is not a multiple of --save-interval
RESAVE = ["--train-iters", "2", "--save-interval", "1000"]
LEGACY_NOTICE = "written by megatron-core <= 0.19.2 without the fix"


def read_checkpoint(ckpt_dir: Path, scratch: Path) -> dict:
    """``model.*`` / ``optimizer.*`` entries of an fsdp_dtensor checkpoint as full tensors (or
    plain values), flattened with '.' (DCP's own key names)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(tempfile.mkdtemp(dir=scratch)) / "full.pt"
    dcp_to_torch_save(str(ckpt_dir), str(out))
    flat: dict = {}

    def walk(obj, prefix):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}")
        else:
            flat[prefix] = obj

    loaded = torch.load(out, weights_only=False)
    for top in ("model", "optimizer"):
        walk(loaded[top], top)
    return flat


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    return type(a) is type(b) and a == b


def assert_checkpoints_bitwise(want: dict, got: dict) -> None:
    assert set(want) == set(got), (
        f"keys only expected: {sorted(set(want) - set(got))[:10]}; "
        f"only found: {sorted(set(got) - set(want))[:10]}"
    )
    bad = sorted(k for k in want if not _same(want[k], got[k]))
    assert not bad, f"{len(bad)} of {len(want)} entries differ, e.g. {bad[:10]}"


def _checkpoint_at(src: Path, iteration: int, dst: Path) -> Path:
    """Copy of ``src`` holding only ``iter_<iteration>`` as the latest checkpoint."""
    name = f"iter_{iteration:07d}"
    dst.mkdir(parents=True)
    shutil.copytree(src / name, dst / name)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def train_straight(work: Path, model: list, iterations: int = 4, **kw) -> dict:
    """Train ``iterations`` steps from scratch, saving every 2; returns the logged losses."""
    run = run_pretrain(
        work,
        *model,
        "--train-iters",
        str(iterations),
        "--save",
        str(work / "ckpt"),
        "--save-interval",
        "2",
        **kw,
    )
    assert sorted(run.losses) == list(range(1, iterations + 1))
    assert sorted(p.name for p in (work / "ckpt").glob("iter_*")) == [
        f"iter_{i:07d}" for i in range(2, iterations + 1, 2)
    ]
    return run.losses


#: What the resume proof finds at TP 2 without the fix ``fsdp_rng``: the files hold every TP rank's
#: RNG states, but the load gives TP rank 1 the torch CPU stream of TP rank 0.
TP2_RNG_FINDING = "RNG state of rank(s) 1 (torch); 3 (torch)"


def resave_from_other_seed(work: Path, tmp_path: Path, model: list, **kw) -> tuple[dict, dict]:
    """Load ``work``'s iteration-2 checkpoint into a model started from another seed and save it
    again without training; returns (what was loaded, what was re-saved) as full tensors."""
    load = _checkpoint_at(work / "ckpt", 2, tmp_path / "load")
    run = run_pretrain(
        tmp_path,
        *model,
        *OTHER_SEED,
        *RESAVE,
        "--load",
        str(load),
        "--save",
        str(tmp_path / "resaved"),
        "--use-checkpoint-opt-param-scheduler",
        **kw,
    )
    assert "tensors and the scalar state equal to the saved state" in run.output
    return (
        read_checkpoint(work / "ckpt" / "iter_0000002", tmp_path),
        read_checkpoint(tmp_path / "resaved" / "iter_0000002", tmp_path),
    )


def assert_unfused_layout(entries: dict) -> None:
    """The fixed layout: q/kv sections and ``transformer_layer`` on disk, nothing fused, no
    ``mtp_model_layer``."""
    assert any(k.endswith("linear_q_down_proj.weight") for k in entries)
    assert any(k.endswith("linear_kv_down_proj.weight") for k in entries)
    assert not [k for k in entries if "linear_qkv_down_proj" in k or "mtp_model_layer" in k]
    assert any(".mtp.layers.0.transformer_layer." in k for k in entries)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    work = tmp_path_factory.mktemp("straight")
    return work, train_straight(work, MODEL, env=ENV)


def test_reload_from_other_seed_restores_every_entry_bitwise(tmp_path, straight):
    want, got = resave_from_other_seed(straight[0], tmp_path, MODEL, env=ENV)
    assert_unfused_layout(want)
    assert sum(isinstance(v, torch.Tensor) for v in want.values()) > 100
    assert_checkpoints_bitwise(want, got)


def test_tp2_reload_from_other_seed_restores_every_entry_bitwise(tmp_path):
    """TP=2 x FSDP=2 on 4 ranks: the same save / reload-from-another-seed / re-save round trip
    (the MLA down projections are duplicated across TP ranks, the up projections and the MLP
    split; FSDP shards each TP rank's part unevenly)."""
    model = MODEL + ["--tensor-model-parallel-size", "2"]
    # saved with upstream's data loaders (fix data_loader_rng off): only TP rank 0 builds them
    # and draws from its CPU generator, so the TP ranks' saved torch streams differ and a load
    # that gives TP rank 1 rank 0's stream (the fsdp_rng guard below) shows; with the fix every
    # TP rank's stream is its seed's, the same on both, and the wrong key would go unseen
    straight_env = {**ENV, "MEGATRON_FIXES_DISABLE": "data_loader_rng"}
    train_straight(tmp_path / "straight", model, iterations=2, nproc=4, env=straight_env)
    want, got = resave_from_other_seed(tmp_path / "straight", tmp_path, model, nproc=4, env=ENV)
    assert_unfused_layout(want)
    assert_checkpoints_bitwise(want, got)
    # guard (fix fsdp_rng): unfixed, every rank loads rank (0, 0)'s RNG states; the resume proof
    # refuses the load, naming the TP-rank-1 ranks' torch stream
    load = _checkpoint_at(tmp_path / "straight" / "ckpt", 2, tmp_path / "load_unfixed")
    unfixed = run_pretrain(
        tmp_path,
        *model,
        *OTHER_SEED,
        *RESAVE,
        "--load",
        str(load),
        "--save",
        str(tmp_path / "resaved_unfixed"),
        nproc=4,
        env={**ENV, "MEGATRON_FIXES_DISABLE": "fsdp_rng"},
        check=False,
        loss_file="unfixed.jsonl",
    )
    assert unfixed.returncode != 0 and TP2_RNG_FINDING in unfixed.output, unfixed.output[-3000:]


def test_resume_is_bitwise(tmp_path, straight):
    work, losses = straight
    load = _checkpoint_at(work / "ckpt", 2, tmp_path / "ckpt")
    resumed = run_pretrain(
        tmp_path,
        *MODEL,
        "--train-iters",
        "4",
        "--load",
        str(load),
        "--save",
        str(load),
        "--save-interval",
        "2",
        env=ENV,
    )
    assert resumed.first_iteration() == 3
    assert_bitwise_equal(losses, resumed.losses, range(3, 5))
    assert_checkpoints_bitwise(
        read_checkpoint(work / "ckpt" / "iter_0000004", tmp_path),
        read_checkpoint(load / "iter_0000004", tmp_path),
    )


def _legacy_to_fixed(legacy: dict) -> dict:
    """What the fixed code must write for the state an unfixed checkpoint holds: fused rows
    split into the q (first q_lora_rank rows) and kv sections, other entries of a fused key
    (step, param-group metadata) copied to both, mtp_model_layer renamed."""
    out = {}
    for key, value in legacy.items():
        key = key.replace(".mtp_model_layer.", ".transformer_layer.")
        if ".linear_qkv_down_proj.weight" not in key:
            out[key] = value
            continue
        q_key = key.replace(".linear_qkv_down_proj.weight", ".linear_q_down_proj.weight")
        kv_key = key.replace(".linear_qkv_down_proj.weight", ".linear_kv_down_proj.weight")
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            assert value.shape[0] == Q_LORA + KV_LORA + POS, (key, value.shape)
            out[q_key], out[kv_key] = value[:Q_LORA], value[Q_LORA:]
        else:
            out[q_key] = out[kv_key] = value
    return out


def test_legacy_layout_checkpoint_loads_into_fixed_entrypoint(tmp_path):
    legacy_dir = tmp_path / "legacy"
    run_pretrain(
        legacy_dir,
        *MODEL,
        "--train-iters",
        "2",
        "--save",
        str(legacy_dir / "ckpt"),
        "--save-interval",
        "2",
        nproc=1,
        env={**ENV, "MEGATRON_FIXES_DISABLE": "fsdp_dtensor"},
    )
    legacy = read_checkpoint(legacy_dir / "ckpt" / "iter_0000002", tmp_path)
    fused = [k for k in legacy if k.startswith("model.") and "linear_qkv_down_proj" in k]
    assert len(fused) == 3, fused  # decoder layers 0, 1 and the MTP layer: the unfixed layout
    assert any(".mtp_model_layer." in k for k in legacy)
    assert not [k for k in legacy if "linear_q_down_proj" in k or ".transformer_layer." in k]

    fixed_dir = tmp_path / "fixed"
    run = run_pretrain(
        fixed_dir,
        *MODEL,
        *OTHER_SEED,
        *RESAVE,
        "--load",
        str(legacy_dir / "ckpt"),
        "--save",
        str(fixed_dir / "ckpt"),
        env=ENV,
    )
    assert LEGACY_NOTICE in run.output  # detected from the checkpoint's metadata
    got = read_checkpoint(fixed_dir / "ckpt" / "iter_0000002", tmp_path)
    assert_checkpoints_bitwise(_legacy_to_fixed(legacy), got)
