"""A fine-tuning job (``--pretrained-checkpoint``) that crashes after writing only non-persistent
checkpoints resumes them on restart, not the pretrained weights (fix ``pretrained_redirect``): for
global non-persistent checkpoints and for the local tier, the restart starts at the iteration after
the non-persistent save and repeats the crashed run's next loss bitwise. Guard: with the fix
disabled the restart starts over at iteration 1 from the pretrained checkpoint (a finetune)."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.launch import FAULTS_ENTRY, run_pretrain, run_pretrain_reaped

pytestmark = pytest.mark.slow

CRASH = {"MEGATRON_TEST_FAULT": "rank=1,iteration=4"}  # rank 1 dies before iteration 5


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    work = tmp_path_factory.mktemp("pretrained")
    run_pretrain(work, "--save", str(work / "ckpt"), "--save-interval", "2", "--exit-interval", "2")
    return work / "ckpt"


def _tier(work, kind):
    extra = ["--non-persistent-ckpt-type", kind, "--non-persistent-save-interval", "3"]
    if kind == "local":
        extra += ["--non-persistent-local-ckpt-dir", str(work / "local")]
    return [
        "--load",
        str(work / "ckpt"),
        "--save",
        str(work / "ckpt"),
        "--save-interval",
        "1000",
        *extra,
    ]


def _crashed_finetune(work, kind, pretrained):
    """Fine-tune from ``pretrained``, non-persistent saves every 3 iterations, crash after 4."""
    crashed = run_pretrain_reaped(
        work,
        "--pretrained-checkpoint",
        str(pretrained),
        *_tier(work, kind),
        env=CRASH,
        check=False,
        timeout=400,
        entry=FAULTS_ENTRY,
    )
    assert crashed.returncode != 0 and sorted(crashed.losses) == [1, 2, 3, 4], crashed.output[
        -3000:
    ]
    assert not (work / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    return crashed


def _restart(work, kind, pretrained, env=None):
    return run_pretrain(
        work,
        "--pretrained-checkpoint",
        str(pretrained),
        *_tier(work, kind),
        "--exit-interval",
        "5",
        env=env,
    )


@pytest.mark.parametrize("kind", ["global", "local"])
def test_restart_resumes_the_non_persistent_checkpoint_over_the_pretrained_one(
    tmp_path, pretrained, kind
):
    work = tmp_path / kind
    crashed = _crashed_finetune(work, kind, pretrained)
    if kind == "global":
        guard = tmp_path / "guard"
        shutil.copytree(work, guard)
    resumed = _restart(work, kind, pretrained)
    assert sorted(resumed.losses) == [4, 5], resumed.output[-3000:]
    assert resumed.losses[4]["lm loss"] == crashed.losses[4]["lm loss"]  # bitwise (hex floats)
    assert (
        f"[resume] this run has a {kind} non-persistent checkpoint at iteration 3 and no "
        f"persistent one in {work / 'ckpt'}: resuming it"
    ) in resumed.output
    assert "attempting to finetune" not in resumed.output
    if kind == "global":
        unfixed = _restart(
            guard, kind, pretrained, env={"MEGATRON_FIXES_DISABLE": "pretrained_redirect"}
        )
        assert "attempting to finetune with checkpoint in" in unfixed.output
        assert min(unfixed.losses) == 1, (
            "guard: unfixed upstream should start over from the pretrained weights"
        )
