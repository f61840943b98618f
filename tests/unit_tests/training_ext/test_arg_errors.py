"""``megatron.training_ext.arg_errors``: upstream's bare argument assertions named (the guard:
upstream alone raises an ``AssertionError`` without a message), the ``--eval-interval`` check."""

from __future__ import annotations

import argparse
import sys

import pytest

from megatron.training_ext import arg_errors
from megatron.training_ext import args as fork_args

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
    "--train-iters 20 --eval-interval 10 --tokenizer-type NullTokenizer --vocab-size 257"
).split()


def _upstream_failure(monkeypatch, argv):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    parser = fork_args.entrypoint_parser()
    args = parse_args(fork_args.add_fork_args)  # upstream's, as parse_and_validate_args calls it
    with pytest.raises(AssertionError) as info:
        validate_args(args, {})
    return info.value, parser


def test_guard_upstream_raises_a_bare_assertion(monkeypatch):
    error, _ = _upstream_failure(monkeypatch, [*TINY, "--save", "ck"])
    assert str(error) == ""  # what a user sees from upstream alone: no flag named


def test_explain_names_the_flags_and_values(monkeypatch):
    error, parser = _upstream_failure(monkeypatch, [*TINY, "--save", "ck"])
    line = arg_errors.explain(error, parser)
    assert line == (
        "invalid arguments (--save-interval=None; with --save=ck): "
        "upstream requires args.save_interval is not None"
    )


def test_explain_follows_a_local_variable_to_its_flags(monkeypatch):
    error, parser = _upstream_failure(monkeypatch, [*TINY, "--tensor-model-parallel-size", "3"])
    line = arg_errors.explain(error, parser)
    assert line.startswith("invalid arguments (world size (ranks launched)=2, ")
    assert "--tensor-model-parallel-size=3" in line and "--pipeline-model-parallel-size=1" in line
    assert "is not divisible" in line  # upstream's own message kept


def test_explain_ignores_assertions_outside_argument_validation():
    try:
        assert 1 == 2
    except AssertionError as e:
        assert arg_errors.explain(e, None) is None


def test_parse_and_validate_args_exits_with_the_line(monkeypatch):
    def upstream(**kw):
        error, _ = _upstream_failure(monkeypatch, [*TINY, "--micro-batch-size", "0"])
        raise error

    with pytest.raises(arg_errors.ArgumentMistake) as info:
        arg_errors.parse_and_validate_args(upstream, fork_args.entrypoint_parser)
    assert info.value.code == (
        "pretrain_gpt.py: invalid arguments (--micro-batch-size=0): "
        "upstream requires args.micro_batch_size > 0"
    )


def test_missing_eval_interval_is_refused():
    ns = argparse.Namespace(eval_interval=None, full_validation=False, skip_train=False)
    with pytest.raises(arg_errors.ArgumentMistake, match="--eval-interval is required"):
        arg_errors.check_later_failures(ns)
    for ok in (
        argparse.Namespace(eval_interval=10, full_validation=False, skip_train=False),
        argparse.Namespace(eval_interval=None, full_validation=True, skip_train=False),
        argparse.Namespace(eval_interval=None, full_validation=False, skip_train=True),
    ):
        arg_errors.check_later_failures(ok)


def test_replication_groups_that_do_not_divide_the_world_are_refused():
    """A restart on fewer nodes with the old --replication-jump/--replication-factor: one line
    naming the flags (NVRx asserts 'Cannot split 2 ranks into replication groups!' later)."""
    local = dict(non_persistent_ckpt_type="local", replication=True, eval_interval=10)
    ns = argparse.Namespace(**local, replication_jump=2, replication_factor=2, world_size=2)
    with pytest.raises(arg_errors.ArgumentMistake) as info:
        arg_errors.check_later_failures(ns)
    assert info.value.code == (
        "pretrain_gpt.py: invalid arguments (--replication-jump=2, --replication-factor=2, world "
        "size=2): NVRx's replication groups need jump x factor to divide the world size. A "
        "restart on fewer nodes needs its own values (here e.g. --replication-jump 1 "
        "--replication-factor 2); the local checkpoints written with the old ones are still used"
    )
    for world, jump, factor in ((4, 2, 2), (2, 1, 2), (8, 2, 2)):
        ok = argparse.Namespace(
            **local, replication_jump=jump, replication_factor=factor, world_size=world
        )
        arg_errors.check_later_failures(ok)
    no_repl = argparse.Namespace(
        non_persistent_ckpt_type="local", replication=False, eval_interval=10, world_size=3
    )
    arg_errors.check_later_failures(no_repl)


def test_megatron_fsdp_with_pipeline_parallelism_is_refused():
    """Megatron-FSDP's device mesh spans (dp_cp ep tp) over the whole world: with PP 2 upstream's
    model build fails with an ``einops.EinopsError`` traceback; refused with one line instead."""
    ns = argparse.Namespace(use_megatron_fsdp=True, pipeline_model_parallel_size=2, eval_interval=1)
    with pytest.raises(arg_errors.ArgumentMistake) as info:
        arg_errors.check_later_failures(ns)
    assert info.value.code == (
        "pretrain_gpt.py: invalid arguments (--use-megatron-fsdp with "
        "--pipeline-model-parallel-size=2): Megatron-FSDP does not support pipeline parallelism "
        "(its device mesh spans data, expert and tensor parallel ranks only); use "
        "--pipeline-model-parallel-size 1, or --use-distributed-optimizer without "
        "--use-megatron-fsdp"
    )
    for fsdp, pp in ((True, 1), (False, 2)):
        ok = argparse.Namespace(use_megatron_fsdp=fsdp, pipeline_model_parallel_size=pp)
        arg_errors.check_later_failures(argparse.Namespace(**vars(ok), eval_interval=1))
