"""Fully-reshardable distributed-optimizer checkpoints with several grad buckets resume bitwise on
the real entrypoint (fix ``distopt_bucket_offsets``, Megatron-LM PR 5077).

2 CPU ranks (DP 2), ``--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable
--overlap-grad-reduce --ddp-bucket-size 5000`` (8 grad buckets on the tiny GPT; without
``--overlap-grad-reduce`` there is one bucket and no defect), dropout on:

* a run of 16 iterations saving at 8 (and 16), resumed from its checkpoint of 8: iterations 9-16
  log exactly the loss and grad norm of the uninterrupted run;
* guard: with ``MEGATRON_FIXES_DISABLE=distopt_bucket_offsets`` the save at 8 warns
  ``param range exceeds unpadded buffer`` and the run resumed from it logs other losses (or,
  where the resume proof is installed, is refused because the loaded optimizer state is not the
  saved one).

Four launches: the straight run (its checkpoint of 8 is the resume's), the resume, and the guard's
first half and resume (the defect is in the save, so the guard needs its own).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers.launch import assert_bitwise_equal, run_pretrain

pytestmark = pytest.mark.slow

BUCKETED = [
    "--use-distributed-optimizer",
    "--ckpt-format",
    "torch_dist",
    "--dist-ckpt-optim-fully-reshardable",
    "--overlap-grad-reduce",
    "--ddp-bucket-size",
    "5000",
    "--train-iters",
    "16",
]
RESUMED = range(9, 17)
UNFIXED = {"MEGATRON_FIXES_DISABLE": "distopt_bucket_offsets"}
WARNING = "param range exceeds unpadded buffer"
#: The prefix of the resume proof's refusal of a load that differs from what was saved.
REFUSED = "[resume-proof] iteration 8: the state loaded from persistent torch_dist"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """16 iterations, a fully-reshardable checkpoint at 8 (and 16); the fix active."""
    work = tmp_path_factory.mktemp("bucketed_straight")
    run = run_pretrain(work, *BUCKETED, "--save", str(work / "ckpt"), "--save-interval", "8")
    assert sorted(run.losses) == list(range(1, 17))
    assert WARNING not in run.output, "the fixed save must not read past the world tensors"
    return SimpleNamespace(ckpt=work / "ckpt", losses=run.losses)


def _resume(ckpt, work, env=None, check=True):
    run = run_pretrain(
        work, *BUCKETED, "--load", str(ckpt), "--ckpt-step", "8", env=env, check=check
    )
    if check:
        assert run.first_iteration() == 9 and sorted(run.losses) == list(RESUMED)
    return run


def _first_difference(reference: dict, other: dict) -> int | None:
    return next(
        (
            i
            for i in RESUMED
            if (reference[i]["lm loss"], reference[i]["grad norm"])
            != (other[i]["lm loss"], other[i]["grad norm"])
        ),
        None,
    )


def _report(name: str, reference: dict, other: dict) -> None:
    print(f"{name}: first iteration that differs: {_first_difference(reference, other)}")
    for i in RESUMED:
        print(
            f"  {i:2d}  straight lm loss {reference[i]['lm loss (decimal)']!r} "
            f"grad norm {reference[i]['grad norm (decimal)']!r} | resumed lm loss "
            f"{other[i]['lm loss (decimal)']!r} grad norm {other[i]['grad norm (decimal)']!r}"
        )


def test_fully_reshardable_resume_with_buckets_is_bitwise(straight, tmp_path):
    resumed = _resume(straight.ckpt, tmp_path)
    _report("fixed", straight.losses, resumed.losses)
    assert_bitwise_equal(straight.losses, resumed.losses, RESUMED)


def test_unfixed_upstream_resume_differs(straight, tmp_path):
    first = run_pretrain(
        tmp_path,
        *BUCKETED,
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "8",
        "--exit-interval",
        "8",
        env=UNFIXED,
        loss_file="first_half.jsonl",
    )
    assert sorted(first.losses) == list(range(1, 9))
    assert_bitwise_equal(straight.losses, first.losses, range(1, 9))
    assert WARNING in first.output, first.output[-4000:]
    # The resume proof compares the loaded state with the digest taken at the save and refuses,
    # naming the optimizer state the unfixed writer shifted: the defect, caught before training.
    resumed = _resume(tmp_path / "ckpt", tmp_path, env=UNFIXED, check=False)
    assert resumed.returncode != 0 and resumed.losses == {}, resumed.output[-4000:]
    refusal = [x for x in resumed.output.splitlines() if REFUSED in x]
    assert refusal and "optimizer state (optimizer.state." in refusal[0], resumed.output[-4000:]
    # (with --resume-proof warn it trains, and iteration 9 already differs: 5.830432 vs 5.623096,
    # docs/fixes/distopt_bucket_offsets.md)
