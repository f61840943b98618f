"""The ModelOpt user flow on the real entrypoints, for a tiny MoE GPT (2 layers, hidden 64,
4 experts, top-2, no bias, dropout off), CPU/gloo, 2 processes:

1. ``pretrain_gpt.py`` trains 6 iterations at EP=2 and saves ``torch_dist`` checkpoints (5 and 6);
2. ``tools/quantize.py`` quantizes checkpoint 5 (FP8, fake quantization) with max calibration on
   2 global batches of an indexed dataset written by ``tools/preprocess_data.py``;
3. ``pretrain_gpt.py --load <quantized> --restore-modelopt-state`` trains iterations 6-10 at the
   saved topology (EP=2, ETP=1; it also writes a local checkpoint at 8, replicated) and at another
   one (EP=1, ETP=2): the forward of the loaded state (iteration 6) agrees, and the amax values
   that the other topology saves are exactly the calibrated ones (a misplaced amax fails both);
   later losses agree within the FP8 rounding's own effect, and unquantized within the reduction
   order (:data:`FORWARD_RTOL`, :data:`RTOL`, :data:`QUANTIZED_RTOL`: which CPU kernel paths they
   were measured on, ``docs/tests.md``);
4. the run is resumed from the local checkpoint at 8 after losing rank 1's local directory
   (recovery from its replica), with no persistent checkpoint and no ``--restore-modelopt-state``:
   it resumes quantized, bitwise equal to the uninterrupted run, and the ``torch_dist`` checkpoint
   it then saves holds the ModelOpt state and exactly the calibrated amax values.

Bad input to ``tools/quantize.py`` is rejected with a message on every rank before any collective.
"""

from __future__ import annotations

import argparse
import ast
import math
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from megatron.integrity.local_identity import RUN_TOKEN_FILE
from tests.helpers import fastlaunch
from tests.helpers.dist import free_port
from tests.helpers.launch import (
    REPO,
    TINY_GPT,
    Run,
    assert_bitwise_equal,
    default_launcher,
    device,
    launch_env,
    run_captured,
    run_pretrain,
)

pytestmark = pytest.mark.slow

QUANTIZE = REPO / "tools" / "quantize.py"
MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--disable-bias-linear",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
SAVED_AT = ["--expert-model-parallel-size", "2"]  # TP1 ETP1 EP2 (dense DP2, expert DP1)
MOVED_TO = ["--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "2"]  # EDP1
LOCAL = [
    "--non-persistent-ckpt-type",
    "local",
    "--non-persistent-save-interval",
    "4",
    "--replication",
    "--replication-jump",
    "1",
    "--replication-factor",
    "2",
]
#: The comparisons across the two topologies, measured under six CPU kernel paths (MKL's AVX-512
#: and AVX2 and SSE4.2 GEMMs, ATen's AVX-512, AVX2 and scalar kernels: docs/tests.md) on this flow.
#: Iteration 6 is a forward pass of the loaded weights and quantizers (no optimizer step yet): the
#: topologies differ only in the order of the ETP all-reduce of linear_fc2's partial outputs,
#: O(1 ulp), which the FP8 input quantizers absorb unless a value sits on a rounding boundary.
#: Measured: bitwise equal on all six paths; the same checkpoint with experts 2-3's weight amax
#: replaced by experts 0-1's (0.7-9% apart, what a placement by local expert index gives) moves it
#: 4.2e-5 to 5.2e-5, 40x this bound.
FORWARD_RTOL = 1e-6
#: Unquantized, iterations 6-10 at both topologies (the same fp32 arithmetic on differently
#: partitioned experts; only the order of sums differs: the ETP all-reduce, the expert-gradient
#: reduction over EDP, the token permutation, each O(1 ulp) = 6e-8 relative, amplified by Adam's
#: normalised updates over the 4 optimizer steps). Measured at most 1.7e-7 on the six paths.
RTOL = 2e-5
#: Quantized, iterations 7-10. After the first update the two topologies' weights differ in their
#: last bits, and the fake quantizers turn every value that sits on an E4M3 rounding boundary into
#: a whole FP8 step apart (one step is 6-12% of the value): from there the losses differ by
#: re-rounding noise of the same nature as the FP8 quantization itself, whose own effect on this
#: model's loss (quantized against unquantized, iterations 6-10) measured 7.9e-6 to 9.9e-4. Across
#: the topologies: 0 to 2.0e-4 over the six paths, depending on which values land on a boundary
#: (bitwise with MKL's AVX2 GEMM and ATen's scalar kernels, 1.2e-4 with the AVX-512 defaults). A
#: misplaced amax is not visible here above that noise (1.4e-5 to 6.1e-4), so these iterations
#: only bound the drift by the quantization's own effect; the quantizer state is checked where the
#: comparison is exact: iteration 6 (:data:`FORWARD_RTOL`) and the saved amax values (bitwise).
QUANTIZED_RTOL = 1e-3
#: Quantizers on rank 0 (all static, all must hold an amax): 2 layers x (linear_qkv, linear_proj)
#: x (input, weight) + local experts x 2 layers x (fc1, fc2) x (input, weight) + 5 layer norms.
QUANTIZERS_RANK0 = {2: 8 + 2 * 8 + 5, 1: 8 + 4 * 8 + 5}  # by EP size
AMAX_KEYS = 2 * 2 * 2 + 2 * 4 * 2 * 2 + 5  # global: every expert once


def run_quantize(
    workdir: Path,
    *args: str,
    nproc: int = 2,
    check: bool = True,
    timeout: float = 600,
    env: dict | None = None,
) -> Run:
    """``torchrun --nproc-per-node N tools/quantize.py [--cpu] TINY_GPT ARGS`` in ``workdir``
    (``--cpu`` unless ``env`` asks for ``MEGATRON_TEST_DEVICE=cuda`` and CUDA is present, as
    ``launch.run_pretrain``); on CPU the same ranks forked by ``tests.helpers.fastlaunch``, as
    ``launch.run_pretrain``."""
    workdir.mkdir(parents=True, exist_ok=True)
    full_env = launch_env(env)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(QUANTIZE),
    ]
    if not (full_env.get("MEGATRON_TEST_DEVICE") == "cuda" and torch.cuda.is_available()):
        cmd.append("--cpu")
    cmd += TINY_GPT + list(args)
    if default_launcher(env) == "forked":  # the ranks forked from the preloaded server
        out = workdir / "quantize.out"
        returncode = fastlaunch.run(QUANTIZE, cmd[6:], nproc, workdir, full_env, out, timeout)
        output = out.read_text(errors="replace")
    else:
        proc = run_captured(cmd, workdir, full_env, timeout)
        returncode, output = proc.returncode, proc.stdout
    if check:
        assert returncode == 0, f"quantize.py failed ({returncode}):\n{output[-6000:]}"
    return Run(returncode, output, {})


def read_amax(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Every ``..._quantizer._amax`` tensor of a ``torch_dist`` checkpoint (global values)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt_dir)).read_metadata()
    sd = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.endswith("quantizer._amax")
    }
    load(sd, storage_reader=FileSystemReader(str(ckpt_dir)), no_dist=True)
    return sd


def quant_summaries(output: str, when: str) -> list[dict]:
    """The quantizer counts rank 0 logged
    (``megatron.training_ext.modelopt.print_quant_summary``)."""
    pat = re.compile(r"ModelOpt \(" + re.escape(when) + r"[^)]*\): rank 0 holds (\{.*\})")
    return [ast.literal_eval(m.group(1)) for m in pat.finditer(output)]


def losses(run: Run, iterations) -> dict[int, float]:
    return {i: float.fromhex(run.losses[i]["lm loss"]) for i in iterations}


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    from tools.preprocess_data import preprocess

    root = tmp_path_factory.mktemp("quantize_moe")
    preprocess(
        [
            "--input",
            sysconfig.get_paths()["stdlib"] + "/json",
            "--pattern",
            "*.py",
            "--output-prefix",
            str(root / "data" / "corpus"),
            "--tokenizer-type",
            "ByteLevelTokenizer",
            "--append-eod",
            "--no-progress",
        ]
    )
    data = root / "data" / "corpus_text_document"

    base = run_pretrain(
        root / "base",
        *MOE,
        *SAVED_AT,
        "--train-iters",
        "6",
        "--save",
        str(root / "ckpt"),
        "--save-interval",
        "5",
    )
    assert sorted(base.losses) == [1, 2, 3, 4, 5, 6]
    # quantize checkpoint 5 (6 exists too: its iteration-6 loss is the unquantized reference)
    (root / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5")

    quant = run_quantize(
        root / "q_run",
        *MOE,
        *SAVED_AT,
        "--load",
        str(root / "ckpt"),
        "--save",
        str(root / "q"),
        "--recipe",
        "fp8",
        "--data-path",
        str(data),
        "--split",
        "98,1,1",
        "--calib-batches",
        "2",
    )

    ref = run_pretrain(
        root / "ref",
        *MOE,
        *SAVED_AT,
        "--train-iters",
        "10",
        "--load",
        str(root / "q"),
        "--restore-modelopt-state",
        "--no-load-optim",
        "--save",
        str(root / "ref" / "ckpt"),
        "--save-interval",
        "1000",
        "--non-persistent-local-ckpt-dir",
        str(root / "ref" / "local"),
        *LOCAL,
    )
    return {"root": root, "base": base, "quant": quant, "ref": ref, "q": root / "q"}


def test_quantized_checkpoint_holds_modelopt_state_and_calibrated_amax(flow):
    from megatron.core import dist_checkpointing

    q = flow["q"]
    assert (q / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    ckpt = q / "iter_0000005"
    state = dist_checkpointing.load_common_state_dict(str(ckpt / "modelopt_state"))
    assert [mode for mode, _ in state["modelopt_state_dict"]] == ["quantize", "max_calibrate"]
    amax = read_amax(ckpt)
    assert len(amax) == AMAX_KEYS, sorted(amax)
    assert not [k for k in amax if "output_layer" in k or "router" in k or "embedding" in k]
    experts = {
        int(m.group(1)) for k in amax for m in [re.search(r"experts\.experts\.(\d+)\.", k)] if m
    }
    assert experts == {0, 1, 2, 3}  # global expert ids, both EP ranks' experts
    assert all(torch.isfinite(v).all() and (v > 0).all() for v in amax.values()), amax
    counts = re.search(
        r"quantize\.py: saved quantized checkpoint .* \(rank 0: (\{.*\})\)", flow["quant"].output
    )
    assert counts, flow["quant"].output[-3000:]
    counts = ast.literal_eval(counts.group(1))
    assert counts["enabled"] == counts["static"] == counts["calibrated"] == QUANTIZERS_RANK0[2]


def test_training_from_quantized_checkpoint_is_quantized(flow):
    ref, base = flow["ref"], flow["base"]
    assert sorted(ref.losses) == [6, 7, 8, 9, 10]
    assert all(math.isfinite(v) for v in losses(ref, range(6, 11)).values())
    after = quant_summaries(ref.output, "After loading checkpoint")
    assert after and after[-1]["calibrated"] == after[-1]["static"] == QUANTIZERS_RANK0[2], after
    # Guard: iteration 6 sees the same weights and batch as the unquantized run's iteration 6
    # (dropout off); only the FP8 fake quantization differs, and it must show, a little
    # (measured 2.7e-5 to 3.3e-5 relative under six CPU kernel paths, docs/tests.md).
    q6, u6 = losses(ref, [6])[6], losses(base, [6])[6]
    assert q6 != u6
    assert abs(q6 - u6) / abs(u6) < 1e-2, (q6, u6)


def topology_problems(ref: Run, moved: Run, iterations, calibrated: dict, saved: dict) -> list[str]:
    """What tells the quantized run at another topology (``moved``) from the one at the saved
    topology (``ref``): losses beyond :data:`FORWARD_RTOL` at iteration 6 (the forward of the
    loaded state) or :data:`QUANTIZED_RTOL` later, or not finite; amax values (``saved``, read
    from the checkpoint ``moved`` wrote) that are not bitwise the ``calibrated`` ones."""
    problems = []
    want, got = losses(ref, iterations), losses(moved, iterations)
    for i in iterations:
        rtol = FORWARD_RTOL if i == 6 else QUANTIZED_RTOL
        if not math.isfinite(got[i]) or abs(got[i] - want[i]) > rtol * abs(want[i]):
            problems.append(f"iteration {i}: lm loss {got[i]!r}, saved topology {want[i]!r}")
    if sorted(saved) != sorted(calibrated):
        problems.append(f"amax keys {sorted(set(saved) ^ set(calibrated))}")
    problems += [f"amax {k}" for k in sorted(saved) if not torch.equal(saved[k], calibrated[k])]
    return problems


def test_quantized_checkpoint_trains_under_another_topology(flow, tmp_path):
    moved = run_pretrain(
        tmp_path,
        *MOE,
        *MOVED_TO,
        "--train-iters",
        "10",
        "--load",
        str(flow["q"]),
        "--restore-modelopt-state",
        "--no-load-optim",
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "10",
    )
    assert sorted(moved.losses) == [6, 7, 8, 9, 10]
    after = quant_summaries(moved.output, "After loading checkpoint")
    assert after and after[-1]["calibrated"] == after[-1]["static"] == QUANTIZERS_RANK0[1], after
    calibrated = read_amax(flow["q"] / "iter_0000005")
    saved = read_amax(tmp_path / "ckpt" / "iter_0000010")
    problems = topology_problems(flow["ref"], moved, range(6, 11), calibrated, saved)
    assert not problems, f"EP1/ETP2 vs EP2/ETP1: {problems}"


def test_unquantized_model_trains_alike_under_both_topologies(flow, tmp_path):
    """The bound the quantized comparison builds on: without quantization, the two topologies
    train iterations 6-10 from checkpoint 5 within the reduction order (:data:`RTOL`)."""
    runs = {
        name: run_pretrain(
            tmp_path / name,
            *MOE,
            *topology,
            "--train-iters",
            "10",
            "--load",
            str(flow["root"] / "ckpt"),
            "--ckpt-step",
            "5",
            "--no-load-optim",
        )
        for name, topology in (("saved", SAVED_AT), ("moved", MOVED_TO))
    }
    saved, moved = (losses(runs[name], range(6, 11)) for name in ("saved", "moved"))
    assert saved[6] == losses(flow["base"], [6])[6]  # the same forward as the run that saved 5
    bad = {i: (saved[i], moved[i]) for i in saved if abs(moved[i] - saved[i]) > RTOL * saved[i]}
    assert not bad, f"unquantized EP1/ETP2 vs EP2/ETP1 beyond rtol {RTOL}: {bad}"


def misplace_expert_weight_amax(src: Path, dst: Path) -> list[str]:
    """Copy the quantized checkpoint ``src`` to ``dst`` with the weight amax of experts 2 and 3
    replaced by those of experts 0 and 1 (what a placement by local expert index would load at
    EP2), its ``integrity.json`` written anew; returns the keys changed. The serialized items of
    two scalar amax tensors have the same length in ``torch_dist`` files, so one item's bytes are
    copied over the other's, at the places ``.metadata`` names."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron.integrity.manifest import save_manifest

    shutil.copytree(src, dst)
    ckpt = dst / "iter_0000005"
    where = {
        index.fqn: info
        for index, info in FileSystemReader(str(ckpt)).read_metadata().storage_data.items()
        if index.fqn.endswith("weight_quantizer._amax") and ".experts.experts." in index.fqn
    }
    changed = []
    for key, info in where.items():
        for to, frm in ((".experts.2.", ".experts.0."), (".experts.3.", ".experts.1.")):
            if to in key:
                src_info = where[key.replace(to, frm)]
                item = (ckpt / src_info.relative_path).read_bytes()
                item = item[src_info.offset : src_info.offset + src_info.length]
                assert len(item) == info.length, (key, len(item), info.length)
                with open(ckpt / info.relative_path, "r+b") as f:
                    f.seek(info.offset)
                    f.write(item)
                changed.append(key)
    (ckpt / "integrity.json").unlink()
    save_manifest(ckpt)  # a checkpoint that verifies: only its amax placement is wrong
    return sorted(changed)


def test_guard_misplaced_expert_amax_fails_the_topology_check(flow, tmp_path):
    """Guard: the check of :func:`test_quantized_checkpoint_trains_under_another_topology` fails
    when the quantizers hold another expert's amax: at iteration 6 (measured 4.2e-5 to 5.2e-5
    relative, :data:`FORWARD_RTOL` 1e-6) and in the amax values the run saves."""
    changed = misplace_expert_weight_amax(flow["q"], tmp_path / "q")
    assert len(changed) == 2 * 2 * 2  # layers x experts 2-3 x (fc1, fc2)
    moved = run_pretrain(
        tmp_path / "run",
        *MOE,
        *MOVED_TO,
        "--train-iters",
        "6",
        "--load",
        str(tmp_path / "q"),
        "--restore-modelopt-state",
        "--no-load-optim",
        "--save",
        str(tmp_path / "run" / "ckpt"),
        "--save-interval",
        "6",
    )
    calibrated = read_amax(flow["q"] / "iter_0000005")
    saved = read_amax(tmp_path / "run" / "ckpt" / "iter_0000006")
    problems = topology_problems(flow["ref"], moved, [6], calibrated, saved)
    assert problems[0].startswith("iteration 6: lm loss"), problems
    assert problems[1:] == [f"amax {k}" for k in changed], problems


def test_local_checkpoint_recovery_resumes_quantized(flow, tmp_path):
    work = tmp_path / "ref"
    shutil.copytree(flow["root"] / "ref", work)
    local = work / "local"
    assert sorted(p.name for p in (local / "1").iterdir()) == [
        "iter_0000008_0_local.pt",
        "iter_0000008_1_local.pt",
    ]
    # the job died after the local save at 8: no persistent checkpoint yet (--save holds only the
    # run token written at the first start, which makes this the same run: docs/local-tier.md)
    for p in (work / "ckpt").iterdir():
        if p.name != RUN_TOKEN_FILE:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.rmtree(local / "1")  # ... and rank 1 lost its local directory: recover from replica
    resumed = run_pretrain(
        work,
        *MOE,
        *SAVED_AT,
        "--train-iters",
        "10",
        "--load",
        str(work / "ckpt"),
        "--save",
        str(work / "ckpt"),
        "--save-interval",
        "10",
        "--non-persistent-local-ckpt-dir",
        str(local),
        *LOCAL,
        loss_file="resumed.jsonl",
    )
    assert resumed.first_iteration() == 9, "did not resume from the local checkpoint"
    assert "restored ModelOpt state of local checkpoint" in resumed.output
    after = quant_summaries(resumed.output, "After loading checkpoint")
    assert after and after[-1]["calibrated"] == after[-1]["static"] == QUANTIZERS_RANK0[2], after
    assert_bitwise_equal(flow["ref"].losses, resumed.losses, range(9, 11))
    # The torch_dist checkpoint written after the recovery is quantized too, with the calibrated
    # amax values (max calibration fixes them; training does not move them).
    saved = work / "ckpt" / "iter_0000010"
    assert (saved / "modelopt_state").is_dir()
    calibrated, now = read_amax(flow["q"] / "iter_0000005"), read_amax(saved)
    assert sorted(now) == sorted(calibrated)
    assert all(torch.equal(now[k], calibrated[k]) for k in now)


def _namespace(tmp_path: Path, **over) -> argparse.Namespace:
    ns = dict(
        recipe="fp8",
        cpu=True,
        calib_batches=2,
        ckpt_format="torch_dist",
        virtual_pipeline_model_parallel_size=None,
        load=str(tmp_path / "ckpt"),
        save=str(tmp_path / "out"),
        mock_data=False,
        data_path=["data/corpus"],
    )
    ns.update(over)
    return argparse.Namespace(**ns)


def test_quantize_validates_input_before_any_collective(tmp_path):
    from tools.quantize import RECIPES, validate_quantize_args

    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000003").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    quantized = tmp_path / "quantized"
    (quantized / "iter_0000003" / "modelopt_state").mkdir(parents=True)
    (quantized / "latest_checkpointed_iteration.txt").write_text("3")
    assert validate_quantize_args(_namespace(tmp_path)) is RECIPES["fp8"]
    cases = {
        "--recipe is required": dict(recipe=None),
        "unknown --recipe 'fp9'": dict(recipe="fp9"),
        "--recipe nvfp4 needs CUDA": dict(recipe="nvfp4"),
        "--calib-batches must be >= 1": dict(calib_batches=0),
        "--ckpt-format must be torch_dist": dict(ckpt_format="torch"),
        "no checkpoint in --load": dict(load=str(tmp_path / "nowhere")),
        "--save must differ from --load": dict(save=str(ckpt)),
        "calibration data needed": dict(data_path=None),
        "already holds ModelOpt state": dict(load=str(quantized)),
    }
    for message, over in cases.items():
        with pytest.raises(SystemExit, match=re.escape(message)):
            validate_quantize_args(_namespace(tmp_path, **over))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(SystemExit, match="names checkpoint iter_0000007"):
        validate_quantize_args(_namespace(tmp_path))
    # On the real launcher: every rank exits with the reason (no rank waits in a collective).
    if device() == "cpu":
        bad = run_quantize(
            tmp_path / "bad",
            "--mock-data",
            "--load",
            str(ckpt),
            "--save",
            str(tmp_path / "out"),
            "--recipe",
            "nvfp4",
            check=False,
            timeout=300,
        )
        assert bad.returncode != 0
        # (torchrun may stop the other rank before it prints; none may hang)
        assert "--recipe nvfp4 needs CUDA" in bad.output, bad.output[-3000:]


@pytest.mark.gpu
def test_quantize_nvfp4_and_train_on_gpu(tmp_path):
    """One GPU (EP=1): NVFP4 (CUDA-only fake quantization) round trip through the same flow."""
    env = {"MEGATRON_TEST_DEVICE": "cuda"}
    run_pretrain(
        tmp_path / "base",
        *MOE,
        "--train-iters",
        "3",
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "3",
        nproc=1,
        env=env,
    )
    run_quantize(
        tmp_path / "q_run",
        *MOE,
        "--mock-data",
        "--load",
        str(tmp_path / "ckpt"),
        "--save",
        str(tmp_path / "q"),
        "--recipe",
        "nvfp4",
        "--calib-batches",
        "1",
        nproc=1,
        env=env,
    )
    run = run_pretrain(
        tmp_path / "train",
        *MOE,
        "--train-iters",
        "5",
        "--load",
        str(tmp_path / "q"),
        "--restore-modelopt-state",
        "--no-load-optim",
        nproc=1,
        env=env,
    )
    assert sorted(run.losses) == [4, 5]
    assert all(math.isfinite(v) for v in losses(run, [4, 5]).values())
    after = quant_summaries(run.output, "After loading checkpoint")
    assert after and after[-1]["calibrated"] == after[-1]["static"] > 0, after
