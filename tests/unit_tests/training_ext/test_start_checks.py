"""What a start checks in its first seconds (megatron.training_ext.start_checks) and how the
persistent tier finds the checkpoint to resume from when the tracker is wrong
(persistent_tier.resume_point, read_metadata). Through the entrypoint:
tests/functional_tests/test_persistent_tier.py."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest

from megatron.training_ext import persistent_tier as pt
from megatron.training_ext import start_checks as sc
from megatron.training_ext.persistent_tier import resume as pt_resume


def _complete(root, *iterations):
    for it in iterations:
        d = root / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"m")
        (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return root


def _tracker(root, text):
    (root / "latest_checkpointed_iteration.txt").write_text(text)


# --- --load naming an iteration directory --------------------------------------------------------


def test_load_of_an_iteration_directory_is_refused_naming_the_fix(tmp_path):
    _complete(tmp_path / "ck", 10)
    with pytest.raises(SystemExit) as e:
        sc.check_load_dir(SimpleNamespace(load=str(tmp_path / "ck" / "iter_0000010")))
    assert str(e.value) == (
        f"pretrain_gpt.py: --load {tmp_path / 'ck' / 'iter_0000010'} is an iteration directory, "
        f"not a checkpoint directory: upstream would find no checkpoint in it and train from "
        f"random weights. Pass --load {tmp_path / 'ck'} --ckpt-step 10 to resume from it"
    )
    sc.check_load_dir(SimpleNamespace(load=str(tmp_path / "ck")))  # the root: fine


# --- --save and the local directory: writable, with room ---------------------------------------

TINY = dict(
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    ffn_hidden_size=256,
    vocab_size=128,
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    world_size=2,
)


def test_estimate_counts_weights_and_adam_state():
    # attention 4 * 64^2, MLP 2 * 64 * 256, two layers, tied embedding 128 * 64: 106496 weights
    assert sc.estimate_checkpoint_bytes(SimpleNamespace(**TINY)) == (106496 * 12, 106496 * 12)
    bf16 = sc.estimate_checkpoint_bytes(
        SimpleNamespace(**TINY, bf16=True, use_distributed_optimizer=True)
    )
    assert bf16 == (106496 * 14, 106496 * 2 + 106496 * 12 // 2)


def test_save_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as e:
        sc.check_directories(SimpleNamespace(**TINY, save=str(tmp_path / "afile" / "ck")))
    assert (
        f"--save {tmp_path / 'afile' / 'ck'} is under a file, {tmp_path / 'afile'}, not a "
        f"directory" in str(e.value)
    )
    with pytest.raises(SystemExit, match="is a file, not a directory"):
        sc.check_directories(SimpleNamespace(**TINY, save=str(tmp_path / "afile")))


def test_read_only_save_is_refused(tmp_path, monkeypatch):
    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(sc.tempfile, "mkstemp", read_only)
    with pytest.raises(SystemExit) as e:
        sc.check_directories(SimpleNamespace(**TINY, save=str(tmp_path)))
    assert f"--save {tmp_path} cannot be written: Read-only file system" in str(e.value)


def test_no_room_for_one_checkpoint_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(
        sc.shutil, "disk_usage", lambda p: SimpleNamespace(total=10**9, used=0, free=10**6)
    )
    args = SimpleNamespace(
        **TINY,
        save=str(tmp_path / "ck"),
        non_persistent_ckpt_type="local",
        non_persistent_local_ckpt_dir=str(tmp_path / "local"),
    )
    with pytest.raises(SystemExit) as e:
        sc.check_directories(args)
    msg = str(e.value)
    assert f"--save {tmp_path / 'ck'} has 0.00 GB free, but one checkpoint of this model " in msg
    assert f"--non-persistent-local-ckpt-dir {tmp_path / 'local'} has 0.00 GB free" in msg
    assert not (tmp_path / "ck").exists() and not (tmp_path / "local").exists()


def test_writable_directories_pass_and_nothing_is_created(tmp_path):
    sc.check_directories(SimpleNamespace(**TINY, save=str(tmp_path / "new" / "ck")))
    sc.check_directories(SimpleNamespace(**TINY, save=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


# --- the tracker is a hint -----------------------------------------------------------------------


def test_tracker_right_is_followed(tmp_path):
    _tracker(_complete(tmp_path, 5, 10), "10")
    assert pt.resume_point(str(tmp_path)) == (None, None)
    _tracker(tmp_path, "release")
    assert pt.resume_point(str(tmp_path)) == (None, None)


@pytest.mark.parametrize(
    "tracker, why",
    [
        (None, "{t} is missing"),
        ("abc", "{t} holds 'abc', not an iteration number"),
        ("15", "{t} names iteration 15, but {root}/iter_0000015 does not exist"),
        (
            "5",
            "{t} names iteration 5, but iter_0000010 is complete and newer (to resume from 5, "
            "pass --ckpt-step 5)",
        ),
    ],
)
def test_wrong_tracker_is_overruled_by_the_newest_complete(tmp_path, tracker, why):
    _complete(tmp_path, 5, 10)
    (tmp_path / "iter_0000012").mkdir()  # incomplete: a save that was cut off
    if tracker is not None:
        _tracker(tmp_path, tracker)
    t = tmp_path / "latest_checkpointed_iteration.txt"
    assert pt.resume_point(str(tmp_path)) == (
        10,
        why.format(t=t, root=tmp_path)
        + ": the tracker is a hint, not the truth; resuming from the newest complete checkpoint, "
        "iter_0000010 (the tracker is rewritten at the next save)",
    )


def test_incomplete_named_iteration_is_overruled(tmp_path):
    _complete(tmp_path, 5)
    (tmp_path / "iter_0000010").mkdir()
    _tracker(tmp_path, "10")
    step, line = pt.resume_point(str(tmp_path))
    assert step == 5 and f"{tmp_path / 'iter_0000010'} is incomplete" in line


def test_garbage_tracker_without_any_checkpoint_stops(tmp_path):
    _tracker(tmp_path, "abc")
    with pytest.raises(SystemExit) as e:
        pt.resume_point(str(tmp_path))
    assert "holds no complete checkpoint" in str(e.value) and "remove" in str(e.value)
    assert pt.resume_point(str(tmp_path / "empty")) == (None, None)  # a first start


def test_damaged_tracker_stops_with_code_1_not_0(tmp_path):
    from megatron.training import checkpointing

    _tracker(tmp_path, "abc")
    wrapped = pt_resume._wrap_read_metadata(checkpointing.read_metadata)
    with pytest.raises(SystemExit) as e:
        wrapped(str(tmp_path / "latest_checkpointed_iteration.txt"))
    assert isinstance(e.value.code, str) and "holds 'abc', not an iteration number" in e.value.code
    pt.install(SimpleNamespace())  # the overruled trackers are the installed tier's state
    pt.COMPONENT.state.overruled.add(
        os.path.realpath(tmp_path / "latest_checkpointed_iteration.txt")
    )
    try:
        assert wrapped(str(tmp_path / "latest_checkpointed_iteration.txt")) == (-1, False)
    finally:
        pt.uninstall()


def test_upstream_exits_with_code_0_on_a_damaged_tracker(tmp_path):
    """Guard: upstream's read_metadata ends the start with exit code 0 (success to SLURM and
    ft_launcher) on a tracker that is not a number."""
    import inspect

    from megatron.training import checkpointing

    upstream = inspect.unwrap(checkpointing.read_metadata)  # also where this process wrapped it
    _tracker(tmp_path, "abc")
    with pytest.raises(SystemExit) as e:
        upstream(str(tmp_path / "latest_checkpointed_iteration.txt"))
    assert e.value.code is None


def test_torn_non_persistent_tracker_names_the_newest_complete_beside_it(tmp_path, capsys):
    """Upstream writes the global non-persistent tracker in place: killed between the open and
    the write (found by the crash-point sweep, ``docs/crash-points.md``), it is empty. The start
    resumes the newest complete non-persistent checkpoint instead of stopping (exit 1, naming a
    remedy, removing the file, that would start from scratch); with none, no non-persistent
    checkpoint loads (upstream's -1)."""
    from megatron.training import checkpointing

    root = tmp_path / "ck" / "non_persistent"
    _complete(root, 4, 6)
    (root / "iter_0000008").mkdir()  # a save cut off
    _tracker(root, "")
    wrapped = pt_resume._wrap_read_metadata(checkpointing.read_metadata)
    assert wrapped(str(root / "latest_checkpointed_iteration.txt")) == (6, False)
    out = capsys.readouterr().out
    assert "holds '', not an iteration number (a save stopped while writing it)" in out
    assert "resuming from the newest complete non-persistent checkpoint, iter_0000006" in out
    empty = tmp_path / "other" / "non_persistent"
    empty.mkdir(parents=True)
    _tracker(empty, "")
    assert wrapped(str(empty / "latest_checkpointed_iteration.txt")) == (-1, False)
    assert "holds no complete checkpoint: no non-persistent checkpoint loads" in (
        capsys.readouterr().out
    )
