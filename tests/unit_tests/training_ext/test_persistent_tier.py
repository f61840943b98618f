"""The persistent tier's start checks and fallback rule (megatron.training_ext.persistent_tier), the
data checks (megatron.training_ext.data_checks) and the verifier's usage errors, without training.

The entrypoint behaviour (typo'd --load, flipped byte, truncated file) is in
tests/functional_tests/test_persistent_tier.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from megatron.integrity.manifest import CheckpointIntegrityError, FileProblem
from megatron.training_ext import data_checks
from megatron.training_ext import persistent_tier as pt
from megatron.training_ext.persistent_tier import fallback as pt_fallback
from tests.helpers.dist import run_distributed


def _ckpt(root: Path, *iterations: int, complete: bool = True) -> Path:
    for i in iterations:
        d = root / f"iter_{i:07d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"m")
        if complete:
            (d / "metadata.json").write_text("{}")
    (root / pt.TRACKER).write_text(str(max(iterations)))
    return root


def _args(**kw) -> argparse.Namespace:
    base = dict(save=None, load=None, overwrite_save=False)
    return argparse.Namespace(**{**base, **kw})


def test_save_dir_rules(tmp_path):
    save = _ckpt(tmp_path / "run", 5, 10)
    empty = tmp_path / "empty"
    empty.mkdir()
    # allowed: a first start (no checkpoints in --save, --load missing), resume from --save itself
    pt.check_save_dir(_args(save=str(tmp_path / "new"), load=str(tmp_path / "new")))
    pt.check_save_dir(_args(save=str(empty), load=str(tmp_path / "typo")))
    pt.check_save_dir(_args(save=str(save), load=str(save) + "/"))
    pt.check_save_dir(_args(save=str(save), load=str(tmp_path / "typo"), overwrite_save=True))
    # refused: anything that would start elsewhere and overwrite --save
    cases = {
        "typo": (str(tmp_path / "typo"), "does not exist \\(a typo\\?\\)"),
        "empty": (str(empty), "holds no checkpoint"),
        "none": (None, "no --load was given"),
        "other": (
            str(_ckpt(tmp_path / "other", 3)),
            "resume from --load .*other, another directory",
        ),
    }
    for name, (load, why) in cases.items():
        with pytest.raises(SystemExit, match=why) as e:
            pt.check_save_dir(_args(save=str(save), load=load))
        msg = str(e.value)
        assert f"--save {save} already holds checkpoints (iter_0000005, iter_0000010, " in msg, name
        assert f"pass --load {save}" in msg and pt.OVERWRITE_FLAG in msg, name


def test_saved_checkpoints_lists_what_would_be_overwritten(tmp_path):
    assert pt.saved_checkpoints(str(tmp_path / "missing")) == []
    root = _ckpt(tmp_path / "r", 5)
    (root / pt.__name__).mkdir()  # unrelated entries do not count
    (root / "local_tier_run_token.json").write_text("{}")
    (root / "non_persistent" / "iter_0000007").mkdir(parents=True)
    assert pt.saved_checkpoints(str(root)) == ["iter_0000005", pt.TRACKER, "non_persistent/"]


def _failing_load(root: Path, bad: set, calls: list):
    """A load_checkpoint stand-in: the iteration it loads is args.ckpt_step or the tracker's."""
    state = argparse.Namespace(ckpt_step=None)

    def load_checkpoint():
        it = state.ckpt_step or int((root / pt.TRACKER).read_text())
        calls.append(it)
        d = root / f"iter_{it:07d}"
        if it in bad:
            raise CheckpointIntegrityError(d, [FileProblem("__1_0.distcp", "bytes differ", 0, 9)])
        return it, 0

    return state, load_checkpoint


def test_fallback_to_previous_complete_checkpoint(tmp_path, capsys):
    root = _ckpt(tmp_path / "ck", 5, 10, 15)
    (root / "iter_0000012").mkdir()  # an interrupted save: no metadata.json
    calls: list = []
    state, load = _failing_load(root, {15, 10}, calls)
    wrapped = pt_fallback._wrap_load_checkpoint(load, lambda: state)
    assert wrapped() == (5, 0)
    assert calls == [15, 10, 5] and state.ckpt_step is None  # 12 skipped, the user's value restored
    out = capsys.readouterr().out
    assert (
        "iter_0000015 failed verification" in out
        and "falling back to the previous complete checkpoint, iter_0000010" in out
    )


def test_no_fallback_when_none_is_left_or_the_user_chose_the_step(tmp_path):
    root = _ckpt(tmp_path / "ck", 5, 10)
    state, load = _failing_load(root, {5, 10}, [])
    with pytest.raises(
        CheckpointIntegrityError,
        match="no earlier complete checkpoint in .*also failed: iter_0000010",
    ):
        pt_fallback._wrap_load_checkpoint(load, lambda: state)()
    calls: list = []
    state, load = _failing_load(root, {10}, calls)
    state.ckpt_step = 10
    with pytest.raises(CheckpointIntegrityError, match="--ckpt-step 10 asks for this one"):
        pt_fallback._wrap_load_checkpoint(load, lambda: state)()
    assert calls == [10] and state.ckpt_step == 10


# --- data checks ------------------------------------------------------------------------------


def test_no_training_data_is_refused():
    names = dict(
        data_path=None,
        data_args_path=None,
        train_data_path=None,
        valid_data_path=None,
        test_data_path=None,
        per_split_data_args_path=None,
    )
    with pytest.raises(SystemExit, match=r"give --data-path PREFIX .* or --mock-data"):
        data_checks.check_data_args(argparse.Namespace(mock_data=False, **names))
    data_checks.check_data_args(argparse.Namespace(mock_data=True, **names))
    data_checks.check_data_args(
        argparse.Namespace(mock_data=False, **{**names, "data_path": ["x"]})
    )


def _dataset(prefix: str, docs) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:
        b.add_document(np.asarray(d, dtype=np.uint16), [len(d)])
    b.finalize(prefix + ".idx")
    return prefix


def test_max_token_id_full_and_sampled(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, 1000) for _ in range(50)]
    docs[31][17] = 999
    p = _dataset(str(tmp_path / "d"), docs)
    assert data_checks.max_token_id(p) == (999, 1.0)
    parts = [data_checks.max_token_id(p, r, 3) for r in range(3)]
    assert max(m for m, _ in parts) == 999 and all(f == 1.0 for _, f in parts)
    m, frac = data_checks.max_token_id(p, budget_bytes=10_000)  # sampled windows
    assert m <= 999 and 0 < frac < 1


def _token_body(rank: int, world: int, prefix: str) -> None:
    assert data_checks.check_token_ids([prefix], 1000) == {prefix: 999}
    with pytest.raises(SystemExit, match=r"holds token id 999.*--vocab-size of at least 1000"):
        data_checks.check_token_ids(
            [prefix], 256
        )  # on both ranks, although only one slice holds it


def test_token_ids_beyond_the_vocabulary_are_refused_on_every_rank(tmp_path):
    docs = [[1, 2, 3]] * 40 + [[5, 999]] + [[4] * 10] * 40
    run_distributed(_token_body, 2, _dataset(str(tmp_path / "d"), docs))


def test_not_an_indexed_dataset(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"garbage" * 5)
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(SystemExit, match="is not a megatron-core indexed dataset index"):
        data_checks.max_token_id(str(tmp_path / "x"))
    with pytest.raises(SystemExit, match="cannot read the indexed dataset"):
        data_checks.max_token_id(str(tmp_path / "missing"))


# --- the verifier's usage errors -------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing_dir", "is_dir"])
def test_verifier_refuses_an_unwritable_json_path_up_front(tmp_path, capsys, where):
    from tools.verify_checkpoint import main

    path = {"missing_dir": tmp_path / "nope" / "r.json", "is_dir": tmp_path}[where]
    # exit 2 (usage) before anything is checked: the checkpoint directory does not even exist
    assert (
        main(["--persistent-dir", str(tmp_path / "no_checkpoint_here"), "--json", str(path)]) == 2
    )
    err = capsys.readouterr().err
    assert f"--json {path}: " in err and "give a path in a writable directory" in err
    assert "no_checkpoint_here" not in err


def test_integrity_flags_reach_the_policy():
    from megatron.training_ext.args import add_fork_args, validate_fork_args

    parser = add_fork_args(argparse.ArgumentParser())
    parser.add_argument("--verify-integrity", action="store_true")  # upstream's flag
    try:
        pt.install(parser.parse_args([]))
        assert (
            pt.COMPONENT.state.policy.write,
            pt.COMPONENT.state.policy.verify,
            pt.COMPONENT.state.policy.require,
        ) == (True, True, False)
        pt.install(parser.parse_args(["--no-verify-integrity"]))
        assert (pt.COMPONENT.state.policy.write, pt.COMPONENT.state.policy.verify) == (False, False)
        pt.install(parser.parse_args(["--verify-integrity"]))
        assert pt.COMPONENT.state.policy.require is True
    finally:
        pt.uninstall()
    with pytest.raises(SystemExit, match="contradict each other"):
        validate_fork_args(parser.parse_args(["--verify-integrity", "--no-verify-integrity"]))


def test_a_second_start_in_one_process_verifies_again():
    """A restart attempt in the same process re-verifies what it loads: the memo of verified
    directories (one verification per directory and process) is forgotten at the new start."""
    args = argparse.Namespace(persistent_integrity=True, verify_integrity=False)
    try:
        pt.install(args)
        pt.COMPONENT.state.verified["/ckpt/iter_0000008"] = object()
        pt.install(args)
        assert pt.COMPONENT.state.verified == {}
    finally:
        pt.uninstall()
