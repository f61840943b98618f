"""Command-line mistakes through the entrypoint (2 ranks): each of upstream's bare argument
assertions a user can trigger ends, on every rank, in one line naming the flags of the failed check
with their values, no traceback, a non-zero exit; a missing ``--eval-interval`` is refused at start
instead of failing when the data loaders are built (``megatron.training_ext.arg_errors``)."""

from __future__ import annotations

import pytest

from tests.helpers import launch as fl

#: (name, extra arguments, flags the message must name, text it must contain)
MISTAKES = [
    (
        "save without interval",
        ["--save", "ck"],
        ["--save-interval=None", "--save=ck"],
        "is not None",
    ),
    (
        "batch not divisible",
        ["--global-batch-size", "5"],
        ["--global-batch-size=5", "--micro-batch-size=2", "data-parallel size"],
        "divisible",
    ),
    (
        "heads do not divide hidden",
        ["--num-attention-heads", "3"],
        ["--hidden-size=64", "--num-attention-heads=3"],
        "%",
    ),
    (
        "TP larger than world",
        ["--tensor-model-parallel-size", "3"],
        ["--tensor-model-parallel-size=3", "world size"],
        "not divisible",
    ),
    (
        "CP larger than world",
        ["--context-parallel-size", "3"],
        ["--context-parallel-size=3"],
        "not divisible",
    ),
    ("fp16 and bf16", ["--fp16", "--bf16"], ["--bf16=True", "--fp16=True"], "not args.bf16"),
    (
        "sequence longer than positions",
        ["--seq-length", "128"],
        ["--max-position-embeddings=64", "--seq-length=128"],
        "greater than or equal",
    ),
    (
        "two warmups",
        ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"],
        ["--lr-warmup-iters=5", "--lr-warmup-fraction=0.1"],
        "only specify one",
    ),
    (
        "iterations and samples",
        ["--train-samples", "80"],
        ["--train-samples=80", "--train-iters=20"],
        "iteration-based",
    ),
    (
        "layers not divisible by PP",
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
        ["--num-layers=3", "--pipeline-model-parallel-size=2"],
        "divisible",
    ),
    (
        "EP without experts",
        ["--expert-model-parallel-size", "2"],
        ["--num-experts=None", "--expert-model-parallel-size=2"],
        "num_experts",
    ),
    (
        "VPP without PP",
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        ["--pipeline-model-parallel-size=1"],
        "interleaved",
    ),
    ("micro batch 0", ["--micro-batch-size", "0"], ["--micro-batch-size=0"], "> 0"),
    ("min-lr above lr", ["--min-lr", "1", "--lr", "0.1"], ["--min-lr=1.0", "--lr=0.1"], "<="),
]


def _check(out: str, returncode: int, flags: list[str], text: str) -> None:
    lines = [ln for ln in out.splitlines() if ln.startswith("pretrain_gpt.py: ")]
    assert returncode != 0, out[-2000:]
    assert len(lines) == 2, out[-3000:]  # one line per rank, the same
    assert lines[0] == lines[1]
    for flag in flags:
        assert flag in lines[0], lines[0]
    assert text in lines[0], lines[0]
    # no rank printed a traceback (the launcher's own failure page follows, as torchrun's does)
    assert "AssertionError" not in out and 'arguments.py", line' not in out, out[-3000:]
    assert out.count("Traceback (most recent call last)") <= 1, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name,extra,flags,text", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_is_named_on_every_rank(tmp_path, name, extra, flags, text):
    run = fl.run_pretrain(tmp_path, *extra, check=False, timeout=120)
    _check(run.output, run.returncode, flags, text)
    assert "invalid arguments (" in run.output


@pytest.mark.slow
def test_missing_eval_interval_is_refused_at_start(tmp_path):
    """Upstream's default ``--eval-interval`` is None; ``training.py`` divides by it when it
    builds the data loaders (TypeError after model and optimizer setup)."""
    if fl.default_launcher() != "forked":
        pytest.skip("built from the forked launcher's argv (CPU)")
    argv = fl.entry_args([])
    i = argv.index("--eval-interval")
    del argv[i : i + 2]
    out = tmp_path / "run.out"
    fl.FORKED_LAUNCHES.append("test_missing_eval_interval_is_refused_at_start")
    code = fl.fastlaunch.run(fl.ENTRY, argv, 2, tmp_path, fl.launch_env(), out, timeout=120)
    text = out.read_text()
    _check(text, code, ["--eval-interval is required"], "--eval-iters 0")
    assert "iteration        1/" not in text  # refused before training


@pytest.mark.slow
def test_megatron_fsdp_with_pipeline_parallelism_is_refused(tmp_path):
    """Upstream builds Megatron-FSDP's device mesh over (dp_cp ep tp) only: with PP 2 every rank
    dies in the model build with an ``einops.EinopsError`` traceback. Refused at argument
    validation instead, on every rank, before any process group (no ``CUDA_DEVICE_MAX_CONNECTIONS``
    override: FSDP on ``--cpu`` is not refused for the CPU backend's own default)."""
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]  # fmt: skip
    run = fl.run_pretrain(
        tmp_path, *fsdp, "--pipeline-model-parallel-size", "2", check=False, timeout=120,
        env={"CUDA_DEVICE_MAX_CONNECTIONS": ""},
    )  # fmt: skip
    flags = ["--use-megatron-fsdp", "--pipeline-model-parallel-size=2"]
    _check(run.output, run.returncode, flags, "does not support pipeline parallelism")
    assert "EinopsError" not in run.output and "CUDA_DEVICE_MAX_CONNECTIONS" not in run.output
