"""The distributed optimizer without apex/TE (torch Adam) on the real entrypoint: fully-reshardable
checkpoints (``--dist-ckpt-optim-fully-reshardable``) resume and change topology (fix
``distopt_reshard``).

* Resume at the same topology (2 ranks, DP 2) is bitwise equal to the uninterrupted run, fp32 and
  bf16; resume on 1 rank (DP 2 -> 1) follows it within the tolerance a changed gradient-reduction
  order allows (:data:`DP_CHANGE_RTOL`).
* A checkpoint written at TP 2 / DP 1 loads at TP 1 / DP 2: re-saved right after the load, every
  model weight and every per-parameter optimizer tensor (main parameter, ``exp_avg``,
  ``exp_avg_sq``) is bitwise the one saved at TP 2, and the optimizer step is kept.
* The default format (``dp_reshardable``) truly cannot change TP: it is refused on every rank with
  a message naming ``--dist-ckpt-optim-fully-reshardable``, and that advice works (the refused
  checkpoint, resumed once at TP 2 with the flag, then loads at TP 1).
* Guard: without the fix (``MEGATRON_FIXES_DISABLE=distopt_reshard``) the TP 2 -> 1 load fails on
  ``KeyError: 'step'``.

Dropout is off in this module: a DP change alters how many micro-batches one rank's dropout RNG
serves, so only with dropout off does the DP-change comparison isolate the reduction order.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.launch import assert_bitwise_equal, run_pretrain

pytestmark = pytest.mark.slow

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
DISTOPT = ["--use-distributed-optimizer", "--ckpt-format", "torch_dist", *NO_DROPOUT]
FULLY = [*DISTOPT, "--dist-ckpt-optim-fully-reshardable"]
PRECISION = {"fp32": [], "bf16": ["--bf16"]}
RESUMED = range(11, 21)

#: Relative tolerance of the lm loss after changing DP 2 -> 1 (iterations 11-20). One rank sums the
#: two micro-batches' gradients where two ranks reduce-scatter them, and the gradient norm (clipping
#: is active: --clip-grad 1, norms ~1.2-1.5) is summed over one shard instead of two: the order of
#: float additions changes, nothing else (same samples, same weights, dropout off). Measured on CPU
#: (torch 2.14.1): fp32 lm loss bitwise equal through iteration 20 (grad norm off by 1 ulp at 20),
#: bf16 at most 2.1e-5 (iteration 18). With MKL's and ATen's AVX-512 kernels and with both at AVX2
#: (docs/tests.md, "Kernel paths"): fp32 at most 8.9e-8, bf16 at most 2.8e-5 and 3.0e-5. The
#: bounds leave a margin of 10x over fp32's and 6x over bf16's.
DP_CHANGE_RTOL = {"fp32": 1e-6, "bf16": 2e-4}


def _error_ranks(output: str, text: str) -> set[int]:
    """Ranks whose error output holds a line starting with ``text`` (torchrun prefixes [rankN]:)."""
    return {
        int(m.group(1))
        for m in re.finditer(r"^\[rank(\d)\]: (?:\[rank\d\]: )?.*" + re.escape(text), output, re.M)
    }


def _saved(iteration_dir: Path) -> dict:
    """Every entry of a ``torch_dist`` checkpoint directory, as global tensors and objects
    (torch.distributed.checkpoint's ``dcp_to_torch_save``; no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = iteration_dir.parent / f"{iteration_dir.name}.pt"
    dcp_to_torch_save(str(iteration_dir), str(out))
    return torch.load(out, weights_only=False)


def _flat_tensors(tree, prefix="") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {}


# --- section: resume from a fully-reshardable checkpoint (same topology, DP 2 -> 1) ---------------


@pytest.fixture(scope="module", params=sorted(PRECISION))
def straight(request, tmp_path_factory):
    """20 iterations on 2 ranks (DP 2), a fully-reshardable checkpoint at 10 (and 20)."""
    work = tmp_path_factory.mktemp(f"straight_{request.param}")
    run = run_pretrain(
        work,
        "--save",
        str(work / "ckpt"),
        "--save-interval",
        "10",
        *FULLY,
        *PRECISION[request.param],
    )
    assert sorted(run.losses) == list(range(1, 21))
    return SimpleNamespace(precision=request.param, ckpt=work / "ckpt", losses=run.losses)


def _resume(straight, work: Path, nproc: int, env: dict | None = None, check: bool = True):
    return run_pretrain(
        work,
        "--load",
        str(straight.ckpt),
        "--ckpt-step",
        "10",
        *FULLY,
        *PRECISION[straight.precision],
        nproc=nproc,
        env=env,
        check=check,
    )


def test_fully_reshardable_resume_is_bitwise(straight, tmp_path):
    resumed = _resume(straight, tmp_path, nproc=2)
    assert resumed.first_iteration() == 11
    assert_bitwise_equal(straight.losses, resumed.losses, RESUMED)


def test_fully_reshardable_resume_on_fewer_ranks_follows_the_run(straight, tmp_path):
    """DP 2 -> 1: same global batch (2 micro-batches on the one rank), losses within the tolerance
    of a changed reduction order; iteration 11 (a forward pass of the loaded weights) bitwise."""
    resumed = _resume(straight, tmp_path, nproc=1)
    assert resumed.first_iteration() == 11 and sorted(resumed.losses) == list(RESUMED)
    # the resume proof: the DP 1 state equals the DP 2 state that was saved (RNG: another layout)
    assert re.search(
        r"\[resume-proof\] iteration 10: \d+ tensors and the scalar state equal to the saved state"
        r".*not compared: RNG states \(another parallel layout\)",
        resumed.output,
    ), resumed.output[-3000:]
    rtol = DP_CHANGE_RTOL[straight.precision]
    rel = {
        i: abs(
            float.fromhex(resumed.losses[i]["lm loss"])
            / float.fromhex(straight.losses[i]["lm loss"])
            - 1
        )
        for i in RESUMED
    }
    print(
        f"{straight.precision}: DP 2 -> 1, relative lm-loss difference per iteration: "
        + ", ".join(f"{i}: {r:.1e}" for i, r in rel.items())
    )
    assert rel[11] == 0, rel
    assert max(rel.values()) <= rtol, rel


# --- section: change TP/DP on resume (TP 2, DP 1 -> TP 1, DP 2) -----------------------------------

TP2 = ["--tensor-model-parallel-size", "2"]
#: 10 iterations; the vocabulary (257) padded to 512 rows at TP 1 and TP 2 alike (upstream pads to
#: a multiple of make_vocab_size_divisible_by x TP: with the default 128, 384 rows at TP 1 against
#: 512 at TP 2, and rows 384-511 of the embedding cannot be carried over).
AT_10 = ["--train-iters", "10", "--make-vocab-size-divisible-by", "256"]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """A TP 2 / DP 1 run of 10 iterations with a default-format (dp_reshardable) checkpoint at 10,
    then the advice of the refusal: resumed at TP 2 with --dist-ckpt-optim-fully-reshardable and
    saved right after the load (no iteration: --train-iters 10, --save-interval 1000)."""
    work = tmp_path_factory.mktemp("tp2")
    first = run_pretrain(
        work, *AT_10, *TP2, *DISTOPT, "--save", str(work / "default"), "--save-interval", "10"
    )
    assert sorted(first.losses) == list(range(1, 11))
    convert = run_pretrain(
        work,
        *AT_10,
        *TP2,
        *FULLY,
        "--load",
        str(work / "default"),
        "--save",
        str(work / "fully"),
        "--save-interval",
        "1000",
        loss_file="convert.jsonl",
    )
    assert convert.losses == {}, "the conversion must not train"
    assert (work / "fully" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    return work


def test_default_format_refuses_tp_change_naming_the_flag_that_works(tp2, tmp_path):
    run = run_pretrain(tmp_path, *AT_10, *DISTOPT, "--load", str(tp2 / "default"), check=False)
    assert run.returncode != 0 and run.losses == {}
    ranks = _error_ranks(
        run.output,
        "RuntimeError: (TP, PP) mismatch after resume ((1, 1) vs (2, 1) "
        "from checkpoint): this checkpoint holds the distributed optimizer's "
        "state in the 'dp_reshardable' format",
    )
    assert ranks == {0, 1}, run.output[-4000:]
    assert "adding --dist-ckpt-optim-fully-reshardable" in run.output
    assert "Please use `--ckpt-fully-parallel-save`" not in run.output
    # The message's other way on: --no-load-optim loads the weights resharded (no step here).
    fresh = run_pretrain(
        tmp_path,
        *AT_10,
        *DISTOPT,
        "--load",
        str(tp2 / "default"),
        "--no-load-optim",
        loss_file="no_load_optim.jsonl",
    )
    assert fresh.losses == {} and "loaded checkpoint from" in fresh.output.lower(), fresh.output[
        -3000:
    ]


def test_tp2_checkpoint_loads_at_tp1_dp2_with_every_value_in_place(tp2, tmp_path):
    """TP 2 / DP 1 -> TP 1 / DP 2, re-saved right after the load: every tensor of the checkpoint
    (model weights, main parameters, exp_avg, exp_avg_sq; global shapes) bitwise equal to the one
    saved at TP 2, per parameter; the optimizer step (param groups) kept."""
    run = run_pretrain(
        tmp_path,
        *AT_10,
        *FULLY,
        "--load",
        str(tp2 / "fully"),
        "--save",
        str(tmp_path / "tp1"),
        "--save-interval",
        "1000",
    )
    assert run.losses == {}
    assert re.search(  # proven at TP 1 against the digest taken at TP 2
        r"\[resume-proof\] iteration 10: \d+ tensors and the scalar state equal to the saved state",
        run.output,
    ), run.output[-3000:]
    before, after = (
        _saved(tp2 / "fully" / "iter_0000010"),
        _saved(tmp_path / "tp1" / "iter_0000010"),
    )
    tb, ta = _flat_tensors(before), _flat_tensors(after)
    weights = [k for k in tb if k.split(".")[0] in ("decoder", "embedding", "output_layer")]
    opt = {
        s: [k for k in tb if k.startswith(f"optimizer.state.{s}.")]
        for s in ("param", "exp_avg", "exp_avg_sq")
    }
    assert len(weights) >= 10 and all(len(v) == len(weights) for v in opt.values()), (weights, opt)
    assert sorted(tb) == sorted(ta)
    differ = [k for k in tb if tb[k].shape != ta[k].shape or not torch.equal(tb[k], ta[k])]
    assert not differ, f"values changed by TP 2 -> 1: {differ}"
    # Adam state is real (not zeros or the fresh-optimizer placeholder), and it was 10 steps in.
    assert all(tb[k].abs().sum() > 0 for k in opt["exp_avg_sq"])
    common = after["common_state/shard_0_1"][0]
    assert common["iteration"] == 10 and common["args"].tensor_model_parallel_size == 1
    steps = {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]}
    assert steps == {10}, steps


def test_guard_unfixed_upstream_cannot_change_tp(tp2, tmp_path):
    run = run_pretrain(
        tmp_path,
        *AT_10,
        *FULLY,
        "--load",
        str(tp2 / "fully"),
        check=False,
        env={"MEGATRON_FIXES_DISABLE": "distopt_reshard"},
    )
    assert run.returncode != 0 and run.losses == {}
    assert _error_ranks(run.output, "KeyError: 'step'"), run.output[-4000:]
