"""The checkpoint verifier on real checkpoints of ``pretrain_gpt.py`` (CPU, 2 gloo ranks, local
checkpoints with replication factor 2 and the replication fix's checksums, plus the persistent
``torch_dist`` checkpoint of the same iteration with ``integrity.json``), built once per module:
clean case, a flipped bit in a replica, NaN written into a primary, a corrupted / truncated
persistent checkpoint, missing copies, bad input, and the distributed mode (2 gloo processes)
giving the same report as one process."""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron.integrity.persistent import CheckpointInputError, PersistentCheckpoint
from megatron.verify import IterationMismatchError, verify_checkpoint
from tests.helpers.dist import run_distributed
from tests.helpers.launch import both_tiers_at, run_pretrain
from tools.verify_checkpoint import main as cli_main

pytestmark = pytest.mark.slow

ITER = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """One training run: local checkpoint (replicated) and persistent checkpoint, both of iteration
    10.

    The loop saves the local checkpoint at 10 (--non-persistent-save-interval 10); the run ends at
    10 and, since 10 % --save-interval != 0, saves the persistent checkpoint of 10 as well.
    """
    w = tmp_path_factory.mktemp("verify_run")
    run_pretrain(w, *both_tiers_at(w, ITER), "--verify-integrity")
    assert sorted(str(p.relative_to(w / "local")) for p in (w / "local").rglob("*.pt")) == [
        "0/iter_0000010_0_local.pt",
        "0/iter_0000010_1_local.pt",
        "1/iter_0000010_0_local.pt",
        "1/iter_0000010_1_local.pt",
    ]
    assert (w / "ckpt" / "iter_0000010" / "integrity.json").is_file()
    return w


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "local", dst / "local")
    shutil.copytree(src / "ckpt", dst / "ckpt")
    return dst


def _verify(w: Path, **kw):
    return verify_checkpoint(w / "local", w / "ckpt", **kw)


# --- helpers that locate bytes independently of the verifier ---------------------------------


def _record_data_offsets(path: Path) -> list[tuple[int, int]]:
    out = []
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            if "/data/" in info.filename and "/.data/" not in info.filename:
                f.seek(info.header_offset)
                head = f.read(30)
                n, m = struct.unpack("<HH", head[26:30])
                out.append((info.header_offset + 30 + n + m, info.file_size))
    return out


def _pick_shard(path: Path, pred):
    sd = torch.load(path, weights_only=False)
    shs = [sh for sh in sd._sharded_tensors if pred(sh)]
    assert shs, f"no shard matches in {path}"
    return shs[0]


def _file_offset_of(path: Path, t: torch.Tensor) -> int:
    """Byte offset in ``path`` of ``t``'s first byte: the (unique) stored record whose bytes at the
    tensor's storage offset are exactly ``t``'s bytes (a shard may be a view into a larger
    storage)."""
    want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    so = t.storage_offset() * t.element_size()
    raw = path.read_bytes()
    hits = [
        off + so
        for off, size in _record_data_offsets(path)
        if so + len(want) <= size and raw[off + so : off + so + len(want)] == want
    ]
    assert len(hits) == 1, hits
    return hits[0]


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


NAN_F32 = struct.pack("<f", float("nan"))


# --- clean --------------------------------------------------------------------------------------


def test_clean_local_vs_persistent_all_equal(ckpt, tmp_path):
    rep = _verify(ckpt)
    s = rep.summary()
    assert rep.ok and rep.problems == [], rep.format_text()
    assert (s["files"], s["primary_files"], s["replica_files"]) == (4, 2, 2)
    assert s["tensors"] > 100 and s["tensors_compared"] == s["tensors"] == s["tensors_equal"]
    assert s["tensors_mismatched"] == 0 and s["nonfinite_tensors"] == 0
    assert s["checksums_verified"] == s["tensors"] and s["checksums_failed"] == 0
    assert s["bytes_compared"] == sum(f.bytes_compared for f in rep.files) > 2_000_000
    assert s["objects_compared"] > 0 and s["objects_equal"] == s["objects_compared"]
    # the primary and the replica of each owner hold the same tensors
    per = {(f.owner_rank, f.role): f.tensors for f in rep.files}
    assert per[(0, "primary")] == per[(0, "replica")] and per[(1, "primary")] == per[(1, "replica")]
    # CLI: exit 0, JSON report
    out = tmp_path / "r.json"
    assert (
        cli_main(
            [
                "--local-dir",
                str(ckpt / "local"),
                "--persistent-dir",
                str(ckpt / "ckpt"),
                "--json",
                str(out),
                "--no-progress",
                "--quiet",
            ]
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert (
        d["ok"] is True and d["iteration"] == ITER and d["summary"]["tensors_equal"] == s["tensors"]
    )


# --- corrupted local files ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def corrupted(ckpt, tmp_path_factory):
    """A copy with (a) one bit flipped in element 37 of a layer-1 shard in the *replica* of rank 0's
    file held by rank 1, (b) a NaN written into element 5 of a shard in rank 1's *primary*."""
    w = _copy(ckpt, tmp_path_factory.mktemp("corrupted"))
    rep_file = w / "local" / "1" / "iter_0000010_0_local.pt"
    sh = _pick_shard(
        rep_file,
        lambda s: s.prepend_axis_num == 1
        and s.global_offset[0] == 1
        and s.data.dtype == torch.float32
        and s.data.dim() == 2
        and s.data.numel() > 100,
    )
    off = _file_offset_of(rep_file, sh.data) + 37 * 4
    _patch(rep_file, off, bytes([rep_file.read_bytes()[off] ^ 0x01]))  # mantissa LSB of element 37
    prim_file = w / "local" / "1" / "iter_0000010_1_local.pt"
    sh2 = _pick_shard(
        prim_file,
        lambda s: s.data.dtype == torch.float32
        and s.data.numel() > 10
        and not s.key.startswith("optimizer"),
    )
    _patch(prim_file, _file_offset_of(prim_file, sh2.data) + 5 * 4, NAN_F32)
    return w, sh, sh2


def _expected_global_index(sh: ShardedTensor, flat: int) -> list[int]:
    local = []
    for dim in reversed(sh.data.shape):
        local.append(flat % dim)
        flat //= dim
    local.reverse()
    p = sh.prepend_axis_num
    return list(sh.global_offset[:p]) + [o + i for o, i in zip(sh.global_offset[p:], local)]


def test_flipped_bit_in_replica_and_nan_in_primary_are_classified(corrupted, tmp_path):
    w, sh, sh2 = corrupted
    rep = _verify(w)
    assert not rep.ok
    kinds = sorted(p.kind for p in rep.problems)
    assert kinds == [
        "checksum_mismatch",
        "checksum_mismatch",
        "nonfinite",
        "value_mismatch",
        "value_mismatch",
    ], rep.format_text()
    by = {(p.kind, p.file): p for p in rep.problems}
    # (a) the flipped bit: replica of rank 0's shard, held by rank 1
    for kind in ("checksum_mismatch", "value_mismatch"):
        p = by[(kind, "1/iter_0000010_0_local.pt")]
        assert (p.role, p.holder_rank, p.owner_rank, p.key, p.global_offset) == (
            "replica",
            1,
            0,
            sh.key,
            list(sh.global_offset),
        )
    v = by[("value_mismatch", "1/iter_0000010_0_local.pt")].details
    assert v["differing_elements"] == 1
    assert v["first_difference_global_index"] == _expected_global_index(sh, 37)
    assert v["persistent_nan"] == 0 and 0 < v["max_abs_difference"] < 1e-3
    assert (
        v["first_difference_values"][1] == sh.data.reshape(-1)[37].item()
    )  # the persistent value is the original
    assert v["suspect"].startswith("local file changed after save")
    # the primary of the same shard (rank 0's own directory) is intact
    assert not [p for p in rep.problems if p.file == "0/iter_0000010_0_local.pt"]
    # (b) the NaN: rank 1's primary
    n = by[("nonfinite", "1/iter_0000010_1_local.pt")]
    assert (n.role, n.holder_rank, n.owner_rank, n.key, n.details) == (
        "primary",
        1,
        1,
        sh2.key,
        {"nan": 1, "inf": 0},
    )
    vb = by[("value_mismatch", "1/iter_0000010_1_local.pt")].details
    assert vb["differing_elements"] == 1 and vb["first_difference_values"][0] == "nan"
    assert vb["first_difference_global_index"] == _expected_global_index(sh2, 5)
    # summary and per-key table
    s = rep.summary()
    assert (s["tensors_mismatched"], s["checksums_failed"], s["nonfinite_tensors"]) == (2, 2, 1)
    assert s["tensors_equal"] == s["tensors_compared"] - 2
    rows = {r["key"]: r for r in rep.mismatch_rows()}
    r = rows[sh.key]
    assert (
        r["shards"],
        r["value"],
        r["checksum"],
        r["replica"],
        r["primary"],
        r["owners"],
        r["holders"],
    ) == (1, 1, 1, 1, 0, "0", "1")
    assert r["indices"] == "(1)"  # layer 1 (first prepended axis)
    r2 = rows[sh2.key]
    assert (r2["nonfinite"], r2["primary"], r2["replica"]) == (1, 1, 0)
    # CLI: exit status 1, same problems in the JSON
    out = tmp_path / "r.json"
    assert (
        cli_main(
            [
                "--local-dir",
                str(w / "local"),
                "--persistent-dir",
                str(w / "ckpt" / "iter_0000010"),
                "--json",
                str(out),
                "--no-progress",
                "--quiet",
            ]
        )
        == 1
    )
    d = json.loads(out.read_text())
    assert sorted(p["kind"] for p in d["problems"]) == kinds
    assert d == {**rep.to_dict(), "timing": d["timing"]}


def test_missing_replica_is_reported(ckpt, tmp_path):
    w = _copy(ckpt, tmp_path)
    (w / "local" / "1" / "iter_0000010_0_local.pt").unlink()
    rep = _verify(w)
    assert [(p.kind, p.owner_rank) for p in rep.problems] == [("missing_copy", 0)], (
        rep.format_text()
    )
    assert "--replication-factor 2" in rep.problems[0].message


# --- persistent checkpoint ---------------------------------------------------------------------


def test_persistent_alone_clean(ckpt):
    rep = verify_checkpoint(None, ckpt / "ckpt")
    assert rep.ok, rep.format_text()
    pc = PersistentCheckpoint(ckpt / "ckpt" / "iter_0000010")
    s = rep.summary()
    assert rep.mode == "persistent" and rep.iteration == ITER
    assert s["tensors"] == sum(len(m.chunks) for m in pc.tensors.values())
    assert s["objects_read"] == len(pc.objects)
    assert s["bytes_scanned"] == sum(
        m.size.numel() * m.properties.dtype.itemsize for m in pc.tensors.values()
    )
    assert rep.manifest == {
        "present": True,
        "verified": True,
        "files": 5,  # .metadata, metadata.json, 2 .distcp, the resume proof's state_digest.json
        "failed_files": [],
        "algorithm": "xxh3-64-blocks",
    }
    digest = json.loads((ckpt / "ckpt" / "iter_0000010" / "state_digest.json").read_text())
    assert rep.state_digest == {"present": True, "tensors": len(digest["tensors"]), "iteration": 10}
    text = rep.format_text()
    assert "integrity.json (xxh3-64-blocks)" in text and "state_digest.json" in text


def test_persistent_truncated_shard_is_detected(ckpt, tmp_path):
    w = _copy(ckpt, tmp_path)
    f = w / "ckpt" / "iter_0000010" / "__1_0.distcp"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    rep = verify_checkpoint(None, w / "ckpt")
    assert not rep.ok
    kinds = {p.kind for p in rep.problems}
    assert kinds == {"storage", "manifest"}, rep.format_text()
    assert rep.manifest["failed_files"] == ["__1_0.distcp"]
    storage = [p for p in rep.problems if p.kind == "storage"]
    assert storage and all(p.file == "__1_0.distcp" and "truncated" in p.message for p in storage)
    assert cli_main(["--persistent-dir", str(w / "ckpt"), "--no-progress", "--quiet"]) == 1


def _chunk_data_offset(pc: PersistentCheckpoint, key: str, chunk) -> tuple[Path, int]:
    """File and byte offset of a chunk's tensor data inside its ``.distcp`` file (parsed here with
    zipfile, independently of the verifier's reader)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = pc.storage[MetadataIndex(key, chunk.offsets)]
    path = pc.path / info.relative_path
    blob = path.read_bytes()[info.offset : info.offset + info.length]
    import io

    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        (rec,) = [
            i for i in zf.infolist() if "/data/" in i.filename and "/.data/" not in i.filename
        ]
    n, m = struct.unpack("<HH", blob[rec.header_offset + 26 : rec.header_offset + 30])
    return path, info.offset + rec.header_offset + 30 + n + m


def test_persistent_corrupted_chunk(ckpt, tmp_path):
    """NaN written into a persistent chunk: found by the NaN scan and (with integrity.json) by the
    manifest; against the local files every copy of that region mismatches -> suspect:
    persistent."""
    w = _copy(ckpt, tmp_path)
    pc = PersistentCheckpoint(w / "ckpt" / "iter_0000010")
    key = next(
        k
        for k in sorted(pc.tensors)
        if k.startswith("decoder.layers.") and k.endswith("linear_fc1.weight")
    )
    chunk = pc.tensors[key].chunks[0]
    path, off = _chunk_data_offset(pc, key, chunk)
    _patch(path, off + 4 * 3, NAN_F32)  # element 3 of the chunk
    del pc

    rep = verify_checkpoint(None, w / "ckpt")
    assert sorted(p.kind for p in rep.problems) == ["manifest", "nonfinite"], rep.format_text()
    n = next(p for p in rep.problems if p.kind == "nonfinite")
    assert (n.key, n.global_offset, n.role, n.file, n.details) == (
        key,
        list(chunk.offsets),
        "persistent",
        path.name,
        {"nan": 1, "inf": 0},
    )
    assert rep.manifest["failed_files"] == [path.name]

    (w / "ckpt" / "iter_0000010" / "integrity.json").unlink()
    rep = verify_checkpoint(None, w / "ckpt")
    assert [p.kind for p in rep.problems] == ["nonfinite"] and [p.kind for p in rep.warnings] == [
        "no_manifest"
    ]

    # against the local checkpoint: both copies (primary and replica) of that region differ, their
    # checksums hold -> the persistent side is the suspect
    rep = _verify(w)
    vm = [p for p in rep.problems if p.kind == "value_mismatch"]
    assert sorted(p.role for p in vm) == ["primary", "replica"], rep.format_text()
    assert all(p.key == key and p.global_offset == list(chunk.offsets) for p in vm)
    assert all(
        p.details["suspect"].startswith("persistent") and p.details["persistent_nan"] == 1
        for p in vm
    )
    assert {p.kind for p in rep.problems} == {"value_mismatch"}


# --- bad input -----------------------------------------------------------------------------------


def test_iteration_mismatch_and_missing_dirs(ckpt, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(ckpt / "ckpt" / "iter_0000010", other / "iter_0000020")
    with pytest.raises(
        IterationMismatchError,
        match=r"persistent checkpoint .*iter_0000020 is iteration 20, the "
        r"local checkpoint .* holds iteration\(s\) \[10\]",
    ):
        verify_checkpoint(ckpt / "local", other / "iter_0000020")
    with pytest.raises(
        CheckpointInputError, match=r"has no iteration 10; it has iteration\(s\) \[20\]"
    ):
        verify_checkpoint(ckpt / "local", other)
    with pytest.raises(CheckpointInputError, match="has no iteration 20"):
        verify_checkpoint(ckpt / "local", ckpt / "ckpt", iteration=20)
    assert (
        cli_main(
            [
                "--local-dir",
                str(ckpt / "local"),
                "--persistent-dir",
                str(other / "iter_0000020"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "iteration mismatch" in capsys.readouterr().err
    assert cli_main(["--local-dir", str(tmp_path / "missing"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- distributed ---------------------------------------------------------------------------------


def _dist_body(rank, world, local_dir, persistent, truncated, out_dir):
    import torch.distributed as dist

    from megatron.verify import verify_checkpoint as vc

    a = vc(local_dir, persistent, group=dist.group.WORLD)
    b = vc(None, truncated, group=dist.group.WORLD)
    assert a.timing["workers"] == 2
    if rank == 0:
        Path(out_dir, "a.json").write_text(
            json.dumps(a.to_dict(include_timing=False), sort_keys=True)
        )
        Path(out_dir, "b.json").write_text(
            json.dumps(b.to_dict(include_timing=False), sort_keys=True)
        )
    # every rank got the whole report
    assert len(a.files) == 4 and not a.ok


def test_distributed_report_equals_single_process(corrupted, ckpt, tmp_path):
    w, _sh, _sh2 = corrupted
    trunc = _copy(ckpt, tmp_path / "t")
    f = trunc / "ckpt" / "iter_0000010" / "__0_0.distcp"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    run_distributed(
        _dist_body, 2, str(w / "local"), str(w / "ckpt"), str(trunc / "ckpt"), str(tmp_path)
    )
    single_a = json.loads(json.dumps(_verify(w).to_dict(include_timing=False), sort_keys=True))
    single_b = json.loads(
        json.dumps(
            verify_checkpoint(None, trunc / "ckpt").to_dict(include_timing=False), sort_keys=True
        )
    )
    dist_a = json.loads((tmp_path / "a.json").read_text())
    dist_b = json.loads((tmp_path / "b.json").read_text())
    assert dist_a == single_a
    assert dist_b == single_b
    assert not single_a["ok"] and not single_b["ok"]
    assert {p["kind"] for p in single_b["problems"]} >= {"storage", "manifest"}
