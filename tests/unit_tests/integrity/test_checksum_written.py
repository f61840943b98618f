"""Checksums of what a save wrote (megatron.integrity.checksum.written): equal to hashing the file
from disk when nothing else touched it; on megatron-core's dist_checkpointing (2 ranks), a
checkpoint whose data files another save replaced between the write and the manifest never
verifies; guard: a manifest hashed from disk after the save verifies that mix."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from megatron.integrity import manifest as mf
from megatron.integrity.checksum import written as wd
from megatron.integrity.checksum.file import hash_file
from tests.helpers.dist import run_distributed

N = 1 << 16


@pytest.mark.parametrize("chunks", [[0], [1], [999, 1, 1000, 3000], [2500] * 5, [10_000]])
def test_hashing_file_equals_hash_file(tmp_path, chunks):
    got = {}
    p = tmp_path / "__0_0.distcp"
    rng = torch.Generator().manual_seed(len(chunks))
    with wd.HashingFile(open(p, "wb"), lambda d: got.setdefault("d", d), block_bytes=1000) as f:
        for n in chunks:
            f.write(torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).numpy().tobytes())
    assert got["d"] == hash_file(p, 1000)


def test_a_seek_falls_back_to_hashing_from_disk(tmp_path):
    got = {}
    with wd.HashingFile(io.BytesIO(), lambda d: got.setdefault("d", d)) as f:
        f.write(b"abc")
        f.seek(0)
        f.write(b"x")
    assert got == {"d": None}


def test_side_files_are_not_checkpoint_files():
    token = "0123456789abcdef0123456789abcdef"
    assert wd.is_side_file(f"__0_0.distcp.{token}.written")
    assert not wd.is_side_file("__0_0.distcp") and not wd.is_side_file("x.written")


def _state(rank: int, world: int, seed: int):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    full = torch.randn(world, N, generator=torch.Generator().manual_seed(seed))
    return {
        "w": ShardedTensor.from_rank_offsets(
            "decoder.w", full[rank : rank + 1].clone(), (0, rank, world)
        )
    }


def _body(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron.cpu import runtime
    from megatron.training_ext import persistent_tier as pt

    runtime.activate()
    tmp = Path(tmp)

    def fresh(p: Path) -> Path:
        if rank == 0:
            p.mkdir(parents=True)
        dist.barrier()
        return p

    def save_overwritten_in_between(x: Path, other: Path, async_save: bool) -> None:
        """Save seed 1 into ``x``; between this save's writes and its manifest, the other save's
        data files (seed 2, same layout) land in ``x``, as a second job in phase would do.
        ``async_save``: through NVRx's writer (``--async-save``), else megatron-core's."""
        run = wd.run_with_token

        def write_then_replaced(token, fn, *a, **kw):
            out = run(token, fn, *a, **kw)
            name = f"__{rank}_0.distcp"
            shutil.copyfile(other / name, x / name)
            return out

        wd.run_with_token = write_then_replaced
        try:
            req = dist_checkpointing.save(
                _state(rank, world, 1), str(x), async_sharded_save=async_save
            )
            if req is not None:
                req.execute_sync()
        finally:
            wd.run_with_token = run

    pt.install(type("A", (), {})())
    try:
        other = fresh(tmp / "other" / "iter_0000010")
        dist_checkpointing.save(_state(rank, world, 2), str(other))
        dist.barrier()
        # a save nothing disturbed: the manifest as written equals the files, no side file left
        assert not [p.name for p in other.iterdir() if p.name.endswith(wd.SIDE_SUFFIX)]
        man = mf.read_manifest(other)
        for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
            assert man["files"][name] == hash_file(other / name).checksum
        mf.verify_checkpoint_dir(other)

        for async_save in (False, True):
            mixed = fresh(tmp / f"mixed_{async_save}" / "iter_0000010")
            save_overwritten_in_between(mixed, other, async_save)
            dist.barrier()
            with pytest.raises(mf.CheckpointIntegrityError) as e:  # on both ranks
                mf.verify_checkpoint_dir(mixed)
            assert sorted(p.file for p in e.value.problems) == ["__0_0.distcp", "__1_0.distcp"]
            assert all("bytes differ" in p.what for p in e.value.problems), str(e.value)
            assert not [p.name for p in mixed.iterdir() if p.name.endswith(wd.SIDE_SUFFIX)]

        # guard: a manifest hashed from disk after the save (as before) verifies the mix
        orig, wd.take_written = wd.take_written, lambda d, names: {}
        try:
            from_disk = fresh(tmp / "from_disk" / "iter_0000010")
            save_overwritten_in_between(from_disk, other, False)
            dist.barrier()
            mf.verify_checkpoint_dir(from_disk)  # no error: the mix verifies
        finally:
            wd.take_written = orig
    finally:
        pt.uninstall()


def test_files_of_another_save_never_verify(tmp_path):
    run_distributed(_body, 2, str(tmp_path))
