"""A distributed-optimizer checkpoint with pipeline parallelism whose grad bucket ends in
alignment padding saves and resumes bitwise on the real entrypoint (fix
``distopt_padded_bucket``, Megatron-LM PR 5898).

2 CPU ranks (PP 2, DP 1), ``--use-distributed-optimizer --hidden-size 72
--max-position-embeddings 65``, ``torch_dist`` (``dp_reshardable``): on the first stage the
bucket closed before the shared word embedding records 68288 unpadded elements, its last
parameter ending at 68232.

* a run of 8 iterations saving at 4 (and 8), resumed from its checkpoint of 4: iterations 5-8
  log exactly the loss and grad norm of the uninterrupted run, and the resume proof says the
  loaded state is the saved one;
* guard (marker ``sweep``, outside the default lane: a third launch): with
  ``MEGATRON_FIXES_DISABLE=distopt_padded_bucket`` the save at 4 dies with upstream's
  ``Failed to validate global plan ... out of bounds chunk`` and leaves an ``iter_0000004``
  without ``.metadata`` and no tracker.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers.launch import assert_bitwise_equal, run_pretrain

pytestmark = pytest.mark.slow

PADDED = [
    "--use-distributed-optimizer",
    "--pipeline-model-parallel-size",
    "2",
    "--hidden-size",
    "72",
    "--max-position-embeddings",
    "65",
    "--ckpt-format",
    "torch_dist",
    "--train-iters",
    "8",
]
RESUMED = range(5, 9)
UNFIXED = {"MEGATRON_FIXES_DISABLE": "distopt_padded_bucket"}
REFUSED = "out of bounds chunk"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 iterations, checkpoints at 4 and 8; the fix active."""
    work = tmp_path_factory.mktemp("padded_straight")
    run = run_pretrain(work, *PADDED, "--save", str(work / "ckpt"), "--save-interval", "4")
    assert sorted(run.losses) == list(range(1, 9))
    assert REFUSED not in run.output
    return SimpleNamespace(ckpt=work / "ckpt", losses=run.losses)


def test_padded_bucket_saves_and_resumes_bitwise(straight, tmp_path):
    for it in (4, 8):
        d = straight.ckpt / f"iter_{it:07d}"
        assert {".metadata", "metadata.json", "integrity.json"} <= {p.name for p in d.iterdir()}
    assert (straight.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    resumed = run_pretrain(tmp_path, *PADDED, "--load", str(straight.ckpt), "--ckpt-step", "4")
    assert resumed.first_iteration() == 5 and sorted(resumed.losses) == list(RESUMED)
    proof = [x for x in resumed.output.splitlines() if x.startswith("[resume-proof] iteration 4")]
    assert proof and "equal to the saved state" in proof[0], resumed.output[-3000:]
    assert_bitwise_equal(straight.losses, resumed.losses, RESUMED)


@pytest.mark.sweep
def test_unfixed_upstream_save_dies_on_the_padded_bucket(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = run_pretrain(
        tmp_path,
        *PADDED,
        "--save",
        str(ckpt),
        "--save-interval",
        "4",
        env=UNFIXED,
        check=False,
        timeout=300,
    )
    assert run.returncode != 0 and sorted(run.losses) == [1, 2, 3, 4], run.output[-3000:]
    assert "Failed to validate global plan" in run.output and REFUSED in run.output
    assert "tensor-size:torch.Size([68288])" in run.output  # the first stage's bucket 0
    # what the failed save leaves: a partial iteration directory, no tracker
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()
    left = {p.name for p in (ckpt / "iter_0000004").iterdir()}
    assert ".metadata" not in left and "metadata.json" not in left, left
