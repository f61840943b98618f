"""Reading a checkpoint never runs code from it (``megatron/integrity/unpickle.py``), on the real
entrypoint (2 ranks, ``--cpu``).

One base run writes persistent ``torch_dist`` checkpoints at 5 and 10 and local ones every 2
(replicated to the other rank) and stops at 12. Crafted files (``tests/helpers/pickle_bomb.py``:
importing the module or calling what the file names creates a marker file) replace files of copies
of it: a local primary and a replica (repaired / rejected; the resume at 13 is bitwise); a
``common.pt`` in persistent 10 (it fails, the load falls back to 5; bitwise); the ``.metadata`` of
10 with a crafted byte object in 5 (both fail: one error naming both); and
``tools/verify_checkpoint.py`` / ``tools/check_state_digest.py`` report each.
A world-writable local directory is refused at start. Every checkpoint format the suite writes
(``torch_dist``, local with replication, distributed optimizer, ``--ckpt-format torch``,
``fsdp_dtensor``, ModelOpt-quantized) loads under the allowlist.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.functional_tests.conftest import lose_exit_save
from tests.helpers import pickle_bomb as pb
from tests.helpers.launch import (
    assert_bitwise_equal,
    local_tier_args,
    persistent_args,
    run_pretrain,
    start_lines,
)

pytestmark = pytest.mark.slow

SCHEDULE = ["--train-iters", "16"]
FIRE = "tests.helpers.pickle_bomb.fire"


def tiers(work: Path, local: bool = True) -> list[str]:
    return persistent_args(work) + (local_tier_args(2, work / "local") if local else [])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    work = tmp_path_factory.mktemp("unpickling_base")
    run_pretrain(work, *SCHEDULE, *tiers(work), "--exit-interval", "12")
    lose_exit_save(work / "ckpt", 12)  # the local tier is the newer one, as after a node loss
    assert sorted(p.name for p in (work / "ckpt").glob("iter_*")) == [
        "iter_0000005",
        "iter_0000010",
    ]
    assert sorted(p.name for p in (work / "local" / "1").iterdir()) == [
        "iter_0000012_0_local.pt",
        "iter_0000012_1_local.pt",
    ]
    return work


def copy_of(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def resume(work: Path, marker: Path, local: bool = True, check: bool = True):
    return run_pretrain(
        work,
        *SCHEDULE,
        *tiers(work, local),
        "--exit-interval",
        "14",
        env={pb.MARKER_ENV: str(marker)},
        check=check,
    )


def local_file(work: Path, holder: int, owner: int, iteration: int = 12) -> Path:
    return work / "local" / str(holder) / f"iter_{iteration:07d}_{owner}_local.pt"


def test_crafted_local_primary_and_replica_never_run(base, straight_16_exit_14, tmp_path):
    """Rank 1's primary and rank 0's replica (held by rank 1) are crafted: rank 1 is repaired from
    its replica on rank 0, rank 0 loads its own primary; nothing the files name is imported or
    called, and the resume at 13 is bitwise."""
    work = copy_of(base, tmp_path / "work")
    marker = tmp_path / "MARKER"
    pb.torch_file(local_file(work, 1, 1), marker)
    pb.torch_file(local_file(work, 1, 0), marker)
    run = resume(work, marker)
    assert pb.ran(marker) == []
    lines = start_lines(run.output)
    (l0,), (l1,) = lines[0], lines[1]
    assert "repaired from rank 0's replica" in l1 and "UnsafeCheckpointError" in l1, l1
    assert f"iter_0000012_1_local.pt names {FIRE}" in l1 and "--unrestricted-unpickling" in l1, l1
    assert "iteration 12 verified on all ranks: own primary" in l0, l0
    assert run.first_iteration() == 13
    assert_bitwise_equal(straight_16_exit_14, run.losses, range(13, 15))
    assert "tensors and the scalar state equal to the saved state (local tier" in run.output


def persistent_copy(base: Path, dest: Path) -> Path:
    """A copy without local checkpoints and without ``integrity.json`` in the persistent ones
    (as saved by upstream, or with ``--no-verify-integrity``)."""
    work = copy_of(base, dest)
    shutil.rmtree(work / "local")
    for it in (5, 10):
        (work / "ckpt" / f"iter_{it:07d}" / "integrity.json").unlink()
    return work


def ckpt(work: Path, iteration: int) -> Path:
    return work / "ckpt" / f"iter_{iteration:07d}"


@pytest.fixture(scope="module")
def crafted_common(base, tmp_path_factory):
    """Persistent 10 holds a crafted ``common.pt``."""
    work = persistent_copy(base, tmp_path_factory.mktemp("crafted_common") / "work")
    marker = work.parent / "MARKER"
    pb.torch_file(ckpt(work, 10) / "common.pt", marker)
    return work, marker


def test_crafted_common_pt_falls_back_to_the_previous_checkpoint(
    crafted_common, straight_16_exit_14
):
    work, marker = crafted_common
    run = resume(work, marker, local=False)
    assert pb.ran(marker) == []
    out = run.output
    assert "iter_0000010 failed verification" in out, out[-4000:]
    assert f"common.pt: names {FIRE}, outside the unpickling allowlist" in out, out[-4000:]
    assert "falling back to the previous complete checkpoint, iter_0000005" in out
    assert run.first_iteration() == 6
    assert_bitwise_equal(straight_16_exit_14, run.losses, range(6, 15))


def test_crafted_metadata_and_byte_object_fall_back_and_every_failure_is_named(base, tmp_path):
    """Persistent 10's ``.metadata`` and 5's ``common_state`` byte object (read through DCP, whose
    ``CheckpointException`` carries the failure) are crafted: 10 fails, the load falls back to 5,
    which fails too; the run stops naming both, having run neither."""
    work = persistent_copy(base, tmp_path / "work")
    marker = tmp_path / "MARKER"
    pb.dcp_metadata(ckpt(work, 10) / ".metadata", marker)
    pb.dcp_byte_object(ckpt(work, 5), "common_state/shard_0_1", marker)
    run = resume(work, marker, local=False, check=False)
    assert pb.ran(marker) == []
    assert run.returncode != 0 and not run.losses
    out = run.output
    assert "iter_0000010 failed verification" in out and f"names {FIRE}" in out, out[-4000:]
    assert "falling back to the previous complete checkpoint, iter_0000005" in out, out[-4000:]
    assert "iter_0000005 failed verification (restricted unpickling)" in out, out[-4000:]
    assert "the DCP byte object 'common_state/shard_0_1': names " + FIRE in out, out[-4000:]
    assert "earlier checkpoints also failed: iter_0000010" in out


def test_verifier_reports_crafted_files_and_never_runs_them(base, tmp_path, capsys):
    """``tools/verify_checkpoint.py`` on a crafted local replica, a crafted ``.metadata`` and a
    crafted ``common.pt``, ``tools/check_state_digest.py`` on the last: each reports the file and
    the global; the module the files name is never imported (in this process) nor called."""
    from tools import check_state_digest, verify_checkpoint

    marker = tmp_path / "MARKER"
    local = copy_of(base / "local", tmp_path / "local")
    pb.torch_file(local / "0" / "iter_0000012_1_local.pt", marker)  # rank 1's replica on rank 0
    md = persistent_copy(base, tmp_path / "md")
    pb.dcp_metadata(ckpt(md, 10) / ".metadata", marker)
    common = persistent_copy(base, tmp_path / "common")
    pb.torch_file(ckpt(common, 10) / "common.pt", marker)
    bomb = sys.modules.pop(pb.__name__)
    try:
        rc = verify_checkpoint.main(["--local-dir", str(local), "--no-progress", "--max-rows", "9"])
        out = capsys.readouterr()
        assert rc != 0 and "unsafe_pickle" in out.out, out
        assert f"0/iter_0000012_1_local.pt names {FIRE}" in out.out, out.out
        for d in (ckpt(md, 10), ckpt(common, 10)):
            rc = verify_checkpoint.main(["--persistent-dir", str(d), "--no-progress"])
            out = capsys.readouterr()
            assert rc != 0 and f"names {FIRE}" in out.out + out.err, (d, out)
        assert "unsafe_pickle" in out.out and "common.pt" in out.out, out.out
        rc = check_state_digest.main([str(ckpt(common, 10)), "--no-progress"])
        out = capsys.readouterr()
        assert rc == 2 and f"common.pt names {FIRE}" in out.err, out
        assert pb.__name__ not in sys.modules, "the crafted files' module was imported"
    finally:
        sys.modules[pb.__name__] = bomb
    assert pb.ran(marker) == []


def test_world_writable_local_directory_is_refused(base, tmp_path):
    work = copy_of(base, tmp_path / "work")
    os.chmod(work / "local" / "1", 0o777)
    run = resume(work, tmp_path / "MARKER", check=False)
    assert run.returncode != 0 and not run.losses
    line = f"local checkpoint path {work / 'local' / '1'} is writable by others (mode 777)"
    assert line in run.output, run.output[-3000:]
    assert "chmod go-w" in run.output and "--accept-shared-local-ckpt-dir" in run.output


# ---- every format the suite writes loads under the allowlist ------------------------------------


def _dcp_objects(metadata_path: Path):
    """``(what, bytes)`` of every byte object of a DCP checkpoint."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron.integrity import unpickle

    with open(metadata_path, "rb") as f:
        md = unpickle.pickle_load(f, what=str(metadata_path))
    for idx, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata):
            with open(metadata_path.parent / info.relative_path, "rb") as f:
                f.seek(info.offset)
                yield f"{info.relative_path} ({idx.fqn})", f.read(info.length)


def walk_checkpoints(root: Path) -> dict[str, int]:
    """Load every pickle of every checkpoint under ``root`` with the restricted loader (it raises
    on a global outside the allowlist); returns how many of each kind were loaded."""
    from megatron.integrity import unpickle

    counts = {"torch.save files": 0, "DCP .metadata": 0, "DCP byte objects": 0}
    for p in sorted(root.rglob("*")):
        if p.suffix == ".pt" and p.is_file():
            unpickle.torch_load(p, map_location="cpu")
            counts["torch.save files"] += 1
        elif p.name == ".metadata":
            counts["DCP .metadata"] += 1
            for what, blob in _dcp_objects(p):
                unpickle.torch_load(io.BytesIO(blob), map_location="cpu", what=what)
                counts["DCP byte objects"] += 1
    return counts


def test_every_format_loads_under_the_allowlist(base, tmp_path):
    from tests.functional_tests.test_fsdp_mla_mtp import ENV as FSDP_ENV
    from tests.functional_tests.test_fsdp_mla_mtp import FSDP
    from tests.functional_tests.test_quantize_moe import MOE, SAVED_AT, run_quantize

    save = ["--train-iters", "2", "--save-interval", "2"]
    run_pretrain(tmp_path / "torch", *save, "--save", str(tmp_path / "torch/ckpt"),
                 "--ckpt-format", "torch", nproc=1)  # fmt: skip
    run_pretrain(tmp_path / "distopt", *save, "--save", str(tmp_path / "distopt/ckpt"),
                 "--ckpt-format", "torch_dist", "--use-distributed-optimizer",
                 "--dist-ckpt-optim-fully-reshardable")  # fmt: skip
    run_pretrain(tmp_path / "fsdp", *FSDP, *save, "--save", str(tmp_path / "fsdp/ckpt"),
                 env=FSDP_ENV)  # fmt: skip
    run_pretrain(tmp_path / "moe", *MOE, *SAVED_AT, *save, "--save", str(tmp_path / "moe/ckpt"))
    run_quantize(tmp_path / "q_run", *MOE, *SAVED_AT, "--load", str(tmp_path / "moe/ckpt"),
                 "--save", str(tmp_path / "q"), "--recipe", "fp8", "--mock-data",
                 "--calib-batches", "1")  # fmt: skip
    counts = {}
    for name, root in [("torch_dist + local", base), ("torch", tmp_path / "torch"),
                       ("distopt", tmp_path / "distopt"), ("fsdp_dtensor", tmp_path / "fsdp"),
                       ("modelopt", tmp_path / "q")]:  # fmt: skip
        counts[name] = walk_checkpoints(root)
    assert counts["torch_dist + local"]["torch.save files"] == 4  # local 12: 2 ranks x 2 copies
    assert counts["torch_dist + local"]["DCP .metadata"] == 2
    assert counts["torch"]["torch.save files"] == 1
    assert all(c["DCP .metadata"] >= 1 and c["DCP byte objects"] >= 1
               for n, c in counts.items() if n != "torch"), counts  # fmt: skip
    assert counts["modelopt"]["DCP .metadata"] == 2  # the checkpoint and its modelopt_state
