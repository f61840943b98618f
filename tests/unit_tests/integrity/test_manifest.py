"""integrity.json of persistent checkpoints (megatron.integrity.manifest) and its installation on
megatron-core's dist_checkpointing (megatron.training_ext.persistent_tier): every single-file
defect is found and named with its byte range, on every rank; and the guard: upstream's load
returns a flipped value without a word."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron.integrity import manifest as mf
from tests.helpers.dist import run_distributed

N = 1 << 16  # fp32 elements per rank: 256 KiB per file


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def _flip(p: Path, offset: int) -> None:
    b = bytearray(p.read_bytes())
    b[offset] ^= 0x04
    p.write_bytes(bytes(b))


# --- single process: hashing and checks --------------------------------------------------------


def test_hash_file_blocks_and_digest(tmp_path):
    data = os.urandom(3 * 1000 + 17)
    d = mf.hash_file(_write(tmp_path / "f", data), block_bytes=1000)
    import xxhash

    assert d.size == len(data) and len(d.blocks) == 4
    assert list(d.blocks) == [
        xxhash.xxh3_64_hexdigest(data[i : i + 1000]) for i in range(0, len(data), 1000)
    ]
    assert mf.hash_file(tmp_path / "f", block_bytes=1000) == d  # deterministic
    assert mf.hash_file(_write(tmp_path / "e", b"")).blocks == ()


def _manifest_for(d: Path, block: int = 1000) -> dict:
    mf.save_manifest(d, block_bytes=block)
    return json.loads((d / mf.INTEGRITY_FNAME).read_text())


def test_every_single_file_defect_is_named_with_its_range(tmp_path):
    d = tmp_path / "iter_0000001"
    d.mkdir()
    _write(d / "__0_0.distcp", os.urandom(5000))
    _write(d / "__1_0.distcp", os.urandom(2500))
    _write(d / "metadata.json", b'{"sharded_backend": "torch_dist"}')
    man = _manifest_for(d)
    assert man["algorithm"] == mf.ALGORITHM and man["version"] == mf.VERSION
    assert sorted(man["files"]) == ["__0_0.distcp", "__1_0.distcp", "metadata.json"]
    assert man["sizes"]["__0_0.distcp"] == 5000 and len(man["blocks"]["__0_0.distcp"]) == 5
    assert mf.check_files(d, man) == []

    _flip(d / "__0_0.distcp", 3456)  # block 3
    assert mf.check_files(d, man) == [
        mf.FileProblem(
            "__0_0.distcp", "bytes differ from what was saved (xxh3-64 block digest)", 3000, 3999
        )
    ]
    _flip(d / "__0_0.distcp", 3456)
    with open(d / "__1_0.distcp", "r+b") as f:
        f.truncate(1234)
    (d / "metadata.json").unlink()
    with open(d / "__0_0.distcp", "ab") as f:
        f.write(b"x")
    got = {p.file: (p.what, p.start, p.end) for p in mf.check_files(d, man)}
    assert got == {
        "__0_0.distcp": ("has 5001 bytes, 5000 were saved", 5000, 5000),
        "__1_0.distcp": ("truncated: 1234 of 2500 bytes", 1234, 2499),
        "metadata.json": ("missing (listed in integrity.json)", None, None),
    }


def test_two_swapped_blocks_are_found(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    a, b = os.urandom(1000), os.urandom(1000)
    _write(d / "__0_0.distcp", a + b)
    man = _manifest_for(d)
    _write(d / "__0_0.distcp", b + a)
    assert [(p.start, p.end) for p in mf.check_files(d, man)] == [(0, 1999)]


def test_upstream_sha256_manifest_verifies(tmp_path):
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    d = tmp_path / "c"
    d.mkdir()
    _write(d / "__0_0.distcp", os.urandom(3000))
    save_integrity_manifest(str(d))  # megatron-core's own writer
    man = mf.read_manifest(d)
    assert man["algorithm"] == "sha256"
    assert mf.check_files(d, man) == []
    _flip(d / "__0_0.distcp", 10)
    (p,) = mf.check_files(d, man)
    assert p.file == "__0_0.distcp" and "SHA-256" in p.what


def test_unknown_or_broken_manifest_is_an_error(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / mf.INTEGRITY_FNAME).write_text('{"algorithm": "md5", "files": {}}')
    with pytest.raises(mf.CheckpointIntegrityError, match="'md5'.*not known"):
        mf.read_manifest(d)
    (d / mf.INTEGRITY_FNAME).write_text("{not json")
    with pytest.raises(mf.CheckpointIntegrityError, match="not a valid manifest"):
        mf.read_manifest(d)
    (d / mf.INTEGRITY_FNAME).unlink()
    assert mf.read_manifest(d) is None


def test_manifest_that_leaves_out_files_fails_verification(tmp_path):
    d = tmp_path / "iter_0000001"
    d.mkdir()
    _write(d / "__0_0.distcp", os.urandom(3000))
    _write(d / ".metadata", b"m")
    _manifest_for(d)
    assert mf.verify_checkpoint_dir(d).files == 2
    _write(d / "__1_0.distcp", os.urandom(100))  # a file of another save
    with pytest.raises(mf.CheckpointIntegrityError) as e:
        mf.verify_checkpoint_dir(d)
    assert [p.file for p in e.value.problems] == ["__1_0.distcp"]
    assert "not covered by integrity.json (it lists 2 files)" in e.value.problems[0].what
    man = json.loads((d / mf.INTEGRITY_FNAME).read_text())
    man.update(files={}, sizes={}, blocks={})  # hand-edited: "verified 0 files" before
    (d / mf.INTEGRITY_FNAME).write_text(json.dumps(man))
    with pytest.raises(mf.CheckpointIntegrityError) as e:
        mf.verify_checkpoint_dir(d)
    assert [p.file for p in e.value.problems] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_unreadable_manifest_is_absent_under_no_verify_integrity(tmp_path, monkeypatch):
    monkeypatch.setattr(mf, "check_storage_ranges", lambda d: [])  # no .metadata in this one
    d = tmp_path / "iter_0000001"
    d.mkdir()
    (d / mf.INTEGRITY_FNAME).write_text("{not json")
    with pytest.raises(mf.CheckpointIntegrityError, match="not a valid manifest"):
        mf.verify_checkpoint_dir(d, hash_bytes=False)  # the default: an error
    s = mf.verify_checkpoint_dir(d, hash_bytes=False, damaged_as_absent=True)
    assert s.algorithm is None and s.files == 0
    assert s.notes[0].startswith("integrity.json unreadable (integrity.json: not a valid manifest")
    assert "treated as absent (--no-verify-integrity)" in s.notes[0]
    with pytest.raises(mf.CheckpointIntegrityError, match="not a valid manifest"):
        mf.verify_checkpoint_dir(d, require_manifest=True, damaged_as_absent=True)


# --- two ranks through megatron-core's dist_checkpointing --------------------------------------


def _state(rank: int, world: int):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(7)
    full = torch.randn(world, N, generator=g)
    return {
        "w": ShardedTensor.from_rank_offsets(
            "decoder.w", full[rank : rank + 1].clone(), (0, rank, world)
        )
    }


def _data_offset(ckpt: Path, file: str) -> int:
    """Byte offset, in ``file``, of the middle of the stored 'decoder.w' item."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    (info,) = [
        v for k, v in md.storage_data.items() if k.fqn == "decoder.w" and v.relative_path == file
    ]
    return int(info.offset) + int(info.length) // 2


def _load(ckpt: Path, rank: int, world: int, **kw) -> torch.Tensor:
    from megatron.core import dist_checkpointing

    sd = _state(rank, world)
    sd["w"].data = torch.zeros_like(sd["w"].data)
    return dist_checkpointing.load(sd, str(ckpt), **kw)["w"]


def _body(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron.cpu import runtime
    from megatron.training_ext import persistent_tier as pt

    runtime.activate()  # megatron-core's torch_dist writer calls torch.cuda.synchronize()
    tmp = Path(tmp)
    want = _state(rank, world)["w"].data

    # guard: upstream (nothing installed) writes no manifest and loads a flipped byte silently
    def fresh(p: Path) -> Path:
        if rank == 0:
            p.mkdir(parents=True)
        dist.barrier()
        return p

    up = fresh(tmp / "upstream" / "iter_0000005")
    dist_checkpointing.save(_state(rank, world), str(up))
    dist.barrier()
    assert not (up / mf.INTEGRITY_FNAME).exists()
    if rank == 0:
        _flip(up / "__1_0.distcp", _data_offset(up, "__1_0.distcp"))
    dist.barrier()
    got = _load(up, rank, world)
    assert torch.equal(got, want) == (rank == 0), (
        "upstream should load rank 1's flipped value silently"
    )

    pt.install(type("A", (), {})())  # defaults: write and verify
    try:
        fixed = fresh(tmp / "fixed" / "iter_0000005")
        dist_checkpointing.save(_state(rank, world), str(fixed))
        man = json.loads((fixed / mf.INTEGRITY_FNAME).read_text())
        assert man["algorithm"] == mf.ALGORITHM
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json"} <= set(man["files"])
        assert torch.equal(_load(fixed, rank, world), want)
        dist.barrier()
        off = _data_offset(fixed, "__1_0.distcp")
        if rank == 0:
            _flip(fixed / "__1_0.distcp", off)
        dist.barrier()
        pt.COMPONENT.state.verified.clear()  # a new process would verify again
        with pytest.raises(mf.CheckpointIntegrityError) as e:  # on both ranks
            _load(fixed, rank, world)
        (p,) = e.value.problems
        block = off // mf.BLOCK_BYTES * mf.BLOCK_BYTES
        assert (p.file, p.start) == ("__1_0.distcp", block) and p.start <= off <= p.end
        assert "decoder.w" in p.holds and "__1_0.distcp: bytes differ" in str(e.value)

        # without a manifest (upstream's checkpoint), a truncated file is named from .metadata
        pt.COMPONENT.state.verified.clear()
        if rank == 0:
            size = (up / "__0_0.distcp").stat().st_size
            with open(up / "__0_0.distcp", "r+b") as f:
                f.truncate(size - 100)
        dist.barrier()
        with pytest.raises(
            mf.CheckpointIntegrityError,
            match=r"__0_0.distcp: truncated: \d+ bytes, .metadata "
            r"places data up to byte \d+.*holds decoder.w",
        ):
            _load(up, rank, world)
        # upstream's --verify-integrity semantics: a checkpoint without integrity.json is refused
        pt.COMPONENT.state.verified.clear()
        with pytest.raises(mf.CheckpointIntegrityError, match="integrity.json: missing"):
            _load(up, rank, world, verify_integrity=True)

        # --no-verify-integrity: no manifest written
        pt.install(type("A", (), {"persistent_integrity": False})())
        off_dir = fresh(tmp / "off" / "iter_0000005")
        dist_checkpointing.save(_state(rank, world), str(off_dir))
        dist.barrier()
        assert not (off_dir / mf.INTEGRITY_FNAME).exists()
    finally:
        pt.uninstall()


def test_save_and_verify_on_two_ranks(tmp_path):
    run_distributed(_body, 2, str(tmp_path))
