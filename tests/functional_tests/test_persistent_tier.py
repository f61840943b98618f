"""The persistent tier through the real entrypoint (2 ranks, CPU, torch_dist): a typo in --load
stops the run before anything in --save is touched; a flipped byte in the newest checkpoint sends
the job to the previous complete one, and training from there is bitwise the uninterrupted run; a
truncated file with nothing to fall back to stops every rank before training, naming the file.

Guards (upstream's behaviour, without this fork's checks) are unit tests: upstream loads a flipped
byte silently (tests/unit_tests/integrity/test_manifest.py) and starts from scratch on a --load
that holds no checkpoint (test_upstream_starts_from_scratch_on_a_typo below)."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from megatron.integrity import manifest as mf
from megatron.integrity import persistent_dirs
from tests.functional_tests.conftest import SCHEDULE_16_EXIT_14
from tests.helpers.launch import assert_bitwise_equal, run_pretrain

pytestmark = pytest.mark.slow

SAVE_EVERY_5 = ["--ckpt-format", "torch_dist", "--save-interval", "5"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """--save of a run of the 16-iteration schedule stopped at 10: checkpoints 5 and 10."""
    work = tmp_path_factory.mktemp("persistent_saved")
    run = run_pretrain(
        work,
        "--train-iters",
        "16",
        "--exit-interval",
        "10",
        *SAVE_EVERY_5,
        "--save",
        str(work / "ckpt"),
        "--load",
        str(work / "ckpt"),
    )
    assert sorted(run.losses) == list(range(1, 11))
    for it in (5, 10):
        d = work / "ckpt" / f"iter_{it:07d}"
        man = mf.read_manifest(d)
        assert man["algorithm"] == mf.ALGORITHM and mf.check_files(d, man) == []
    return work / "ckpt"


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _error_ranks(output: str, text: str) -> set[int]:
    """Ranks whose traceback ends in ``text`` (torch prefixes each stderr line with [rankN]:)."""
    return {
        int(m.group(1))
        for m in re.finditer(r"^\[rank(\d)\]: (?:\[rank\d\]: )?" + re.escape(text), output, re.M)
    }


def test_typo_in_load_stops_before_save_is_touched(saved, tmp_path):
    ckpt = shutil.copytree(saved, tmp_path / "ckpt")
    before = _digests(ckpt)
    typo = tmp_path / "ckpy"
    run = run_pretrain(
        tmp_path,
        *SCHEDULE_16_EXIT_14,
        *SAVE_EVERY_5,
        "--save",
        str(ckpt),
        "--load",
        str(typo),
        check=False,
    )
    assert run.returncode != 0 and run.losses == {}
    want = (
        f"pretrain_gpt.py: --save {ckpt} already holds checkpoints (iter_0000005, iter_0000010, "
        f"latest_checkpointed_iteration.txt), but --load {typo} does not exist (a typo?)"
    )
    assert want in run.output, run.output[-3000:]
    assert f"pass --load {ckpt}" in run.output and "add --overwrite-save" in run.output
    assert "building GPT model" not in run.output  # refused before any model is built
    assert _digests(ckpt) == before and not typo.exists()


def test_upstream_starts_from_scratch_on_a_typo(tmp_path):
    """Guard: upstream's load of a --load without a checkpoint returns nothing to resume from (so
    its saves then overwrite --save); only the check above stops it."""
    from types import SimpleNamespace

    from megatron.training import checkpointing

    args = SimpleNamespace(
        non_persistent_global_ckpt_dir=None,
        non_persistent_ckpt_type=None,
        ckpt_step=None,
        exit_on_missing_checkpoint=False,
    )
    assert not checkpointing.checkpoint_exists(str(tmp_path / "typo"))
    assert checkpointing._load_base_checkpoint(str(tmp_path / "typo"), args, rank0=True) == (
        None,
        "",
        False,
        None,
    )


def test_flipped_byte_falls_back_to_previous_checkpoint_bitwise(
    saved, straight_16_exit_14, tmp_path
):
    ckpt = shutil.copytree(saved, tmp_path / "ckpt")
    bad = ckpt / "iter_0000010" / "__1_0.distcp"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, inside some tensor's bytes
    bad.write_bytes(bytes(data))
    run = run_pretrain(
        tmp_path, *SCHEDULE_16_EXIT_14, *SAVE_EVERY_5, "--save", str(ckpt), "--load", str(ckpt)
    )
    assert "[persistent-tier] iter_0000010 failed verification:" in run.output
    assert re.search(
        r"__1_0\.distcp: bytes differ from what was saved \(xxh3-64 block digest\) "
        r"\(bytes 0-\d+\); holds ",
        run.output,
    ), run.output[-3000:]
    assert "falling back to the previous complete checkpoint, iter_0000005" in run.output
    # .metadata, metadata.json, __0_0.distcp, __1_0.distcp and the resume proof's
    # state_digest.json: the manifest covers every file but itself
    assert "[persistent-tier] iter_0000005: verified 5 files" in run.output
    assert run.first_iteration() == 6
    assert_bitwise_equal(straight_16_exit_14, run.losses, range(6, 15))
    man = mf.read_manifest(ckpt / "iter_0000010")  # saved again at 10 by this run: intact
    assert mf.check_files(ckpt / "iter_0000010", man) == []


def test_truncated_file_stops_every_rank_before_training(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(
        saved / "iter_0000010", ckpt / "iter_0000010"
    )  # nothing earlier to fall back to
    shutil.copy(saved / "latest_checkpointed_iteration.txt", ckpt)
    cut = ckpt / "iter_0000010" / "__0_0.distcp"
    size = cut.stat().st_size
    with open(cut, "r+b") as f:
        f.truncate(size // 2)
    run = run_pretrain(
        tmp_path,
        *SCHEDULE_16_EXIT_14,
        *SAVE_EVERY_5,
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        check=False,
    )
    assert run.returncode != 0 and run.losses == {}
    head = (
        f"megatron.integrity.manifest.CheckpointIntegrityError: checkpoint "
        f"{ckpt / 'iter_0000010'} failed verification"
    )
    assert _error_ranks(run.output, head) == {0, 1}, run.output[-4000:]
    assert _error_ranks(
        run.output,
        f"  __0_0.distcp: truncated: {size // 2} of {size} bytes "
        f"(bytes {size // 2}-{size - 1}); holds ",
    ) == {0, 1}
    assert f"no earlier complete checkpoint in {ckpt} to fall back to" in run.output
    assert "EOFError" not in run.output


@pytest.mark.parametrize("tracker", ["garbage", "missing", "names_deleted"])
def test_wrong_tracker_resumes_from_the_newest_complete_checkpoint(
    saved, straight_16_exit_14, tmp_path, tracker
):
    """The tracker is a hint: garbage (upstream: exit code 0, nothing trained), missing (upstream:
    starts from random weights and its saves overwrite iterations 5 and 10) or naming a deleted
    iteration (upstream: FileNotFoundError); the newest complete checkpoint, iter_0000010, is
    resumed and training from it is bitwise the uninterrupted run."""
    ckpt = shutil.copytree(saved, tmp_path / "ckpt")
    t = ckpt / "latest_checkpointed_iteration.txt"
    if tracker == "garbage":
        t.write_text("abc")
        why = f"{t} holds 'abc', not an iteration number"
    elif tracker == "missing":
        t.unlink()
        why = f"{t} is missing"
    else:
        shutil.copytree(ckpt / "iter_0000010", ckpt / "iter_0000015")
        t.write_text("15")
        shutil.rmtree(ckpt / "iter_0000015")
        why = f"{t} names iteration 15, but {ckpt / 'iter_0000015'} does not exist"
    run = run_pretrain(
        tmp_path, *SCHEDULE_16_EXIT_14, *SAVE_EVERY_5, "--save", str(ckpt), "--load", str(ckpt)
    )
    assert (
        f"[persistent-tier] {why}: the tracker is a hint, not the truth; resuming from the newest "
        f"complete checkpoint, iter_0000010 (the tracker is rewritten at the next save)"
    ) in run.output, run.output[-3000:]
    assert run.first_iteration() == 11
    assert_bitwise_equal(straight_16_exit_14, run.losses, range(11, 15))
    newest = persistent_dirs.complete_iterations(ckpt)[-1]
    assert newest > 10 and t.read_text().strip() == str(newest)  # rewritten by this run's save
    for it in (5, 10):  # nothing overwritten
        d = ckpt / f"iter_{it:07d}"
        assert _digests(d) == _digests(saved / d.name)


def test_load_of_an_iteration_directory_is_refused_before_training(saved, tmp_path):
    ckpt = shutil.copytree(saved, tmp_path / "ckpt")
    before = _digests(ckpt)
    run = run_pretrain(
        tmp_path,
        *SCHEDULE_16_EXIT_14,
        *SAVE_EVERY_5,
        "--save",
        str(tmp_path / "other"),
        "--load",
        str(ckpt / "iter_0000010"),
        check=False,
    )
    assert run.returncode == 1 and run.losses == {}
    line = (
        f"pretrain_gpt.py: --load {ckpt / 'iter_0000010'} is an iteration directory, not a "
        f"checkpoint directory: upstream would find no checkpoint in it and train from random "
        f"weights. Pass --load {ckpt} --ckpt-step 10 to resume from it"
    )
    assert run.output.count(line) == 2, run.output[-3000:]  # every rank
    assert _digests(ckpt) == before and not (tmp_path / "other").exists()


def test_save_under_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "afile").write_text("x")
    run = run_pretrain(
        tmp_path,
        *SAVE_EVERY_5,
        "--save",
        str(tmp_path / "afile" / "ckpt"),
        "--load",
        str(tmp_path / "afile" / "ckpt"),
        check=False,
    )
    assert run.returncode == 1 and run.losses == {}
    assert (
        run.output.count(
            f"--save {tmp_path / 'afile' / 'ckpt'} is under a file, {tmp_path / 'afile'}, not a "
            f"directory"
        )
        == 2
    ), run.output[-3000:]
    assert "building GPT model" not in run.output
