"""Unit tests of the checkpoint verifier's building blocks (no training run): key normalisation,
chunk-cover geometry, bitwise equality, NaN/Inf counting, the fused one-pass scan (checksum equal
to the replication fix's definition), deep object comparison, work assignment, input errors."""

from __future__ import annotations

import argparse
import io
import json
import os

import pytest
import torch

from megatron.integrity.checksum import tensor as ck
from megatron.integrity.persistent import (
    CheckpointInputError,
    check_chunk_cover,
    resolve_persistent_dir,
)
from megatron.integrity.readahead import ReadAhead
from megatron.integrity.tensor_ops import bytes_equal, count_nonfinite, deep_difference, fused_scan
from megatron.verify import discover_local, verify_checkpoint
from megatron.verify.report import Problem, VerifyReport, format_table, normalize_key
from megatron.verify.schedule import assign, local_units


def test_normalize_key_replaces_numeric_segments_only():
    assert normalize_key("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight") == (
        "decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
        (3, 7),
    )
    assert normalize_key("decoder.layers.self_attention.linear_qkv.weight") == (
        "decoder.layers.self_attention.linear_qkv.weight",
        (),
    )
    # digits inside a name are not a segment
    assert normalize_key("embedding.fp8_meta.layer12x.weight") == (
        "embedding.fp8_meta.layer12x.weight",
        (),
    )
    assert normalize_key("0.weight.1") == ("*.weight.*", (0, 1))


def test_chunk_cover_exact_gap_overlap_bounds():
    assert check_chunk_cover((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))]) == []
    assert check_chunk_cover((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 6))]) == []
    gap = check_chunk_cover((4, 6), [((0, 0), (2, 6))])
    assert len(gap) == 1 and "cover 12 of 24" in gap[0]
    over = check_chunk_cover((4, 6), [((0, 0), (3, 6)), ((2, 0), (2, 6))])
    assert any("overlap" in e for e in over)
    oob = check_chunk_cover((4, 6), [((0, 0), (2, 6)), ((2, 0), (3, 6))])
    assert any("exceeds the global shape" in e for e in oob)
    assert check_chunk_cover((), [((), ())]) == []
    assert check_chunk_cover((), []) == ["0-d tensor stored in 0 chunks"]


def test_bytes_equal_is_bitwise():
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert bytes_equal(a, a.clone())  # NaN with the same payload is equal bitwise
    assert not torch.equal(a, a.clone())  # ... unlike torch.equal
    assert not bytes_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bytes_equal(a, a.double())
    assert not bytes_equal(a, a[:2])
    assert bytes_equal(
        torch.arange(12.0).reshape(3, 4).t(), torch.arange(12.0).reshape(3, 4).t().contiguous()
    )


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2, torch.complex64]
)
def test_count_nonfinite(dtype):
    t = torch.zeros(1000, dtype=dtype)
    assert count_nonfinite(t) == (0, 0)
    t[3] = float("nan")
    t[7] = float("inf")
    t[8] = float("-inf")
    nan, inf = count_nonfinite(t)
    if dtype.is_complex:  # real and imaginary parts of nan+0j / inf+0j
        assert nan >= 1 and inf >= 2
    else:
        assert (nan, inf) == (1, 2)
    assert count_nonfinite(torch.arange(10)) == (0, 0)


@pytest.mark.parametrize("n", [0, 1, 1000, (1 << 18) + 3])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool]
)
def test_fused_scan_checksum_equals_tensor_checksum(n, dtype):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 3).to(dtype)
    checksum, equal, nonfinite = fused_scan(t, t.clone(), block_bytes=4096)
    assert checksum == ck.tensor_checksum(t)
    assert equal is True and nonfinite is False
    if n > 10 and dtype.is_floating_point:
        u = t.clone()
        u[n - 1] = float("nan")
        c2, e2, nf2 = fused_scan(u, t, block_bytes=4096)
        assert c2 != checksum and e2 is False and nf2 is True
        assert fused_scan(t, None, want_checksum=False, block_bytes=4096) == (None, None, False)


def test_deep_difference():
    a = {"x": [torch.arange(4), io.BytesIO(b"ab"), float("nan")], "ns": argparse.Namespace(k=1)}
    b = {"x": [torch.arange(4), io.BytesIO(b"ab"), float("nan")], "ns": argparse.Namespace(k=1)}
    assert deep_difference(a, b) is None
    b["x"][0] = torch.tensor([0, 1, 2, 4])
    assert "['x'][0]" in deep_difference(a, b)
    b["x"][0] = torch.arange(4)
    b["ns"].k = 2
    assert "['ns']" in deep_difference(a, b)
    assert "keys differ" in deep_difference({"a": 1}, {"b": 1})


def test_assign_groups_owners_and_respects_visibility():
    # 2 owners x 2 copies, 2 ranks, shared storage: each rank gets one owner's primary + replica
    files = [
        ("0/iter_0000010_0_local.pt", 0, 100),
        ("1/iter_0000010_0_local.pt", 0, 100),
        ("0/iter_0000010_1_local.pt", 1, 100),
        ("1/iter_0000010_1_local.pt", 1, 100),
    ]
    out = local_units([files, files], 2)
    assert sorted(map(sorted, out.values())) == [
        ["0/iter_0000010_0_local.pt", "1/iter_0000010_0_local.pt"],
        ["0/iter_0000010_1_local.pt", "1/iter_0000010_1_local.pt"],
    ]
    # node-local storage: rank r sees only directory r -> it checks exactly those files
    vis = [[f for f in files if f[0].startswith("0/")], [f for f in files if f[0].startswith("1/")]]
    out = local_units(vis, 2)
    assert sorted(out[0]) == ["0/iter_0000010_0_local.pt", "0/iter_0000010_1_local.pt"]
    assert sorted(out[1]) == ["1/iter_0000010_0_local.pt", "1/iter_0000010_1_local.pt"]
    # greedy balance by bytes
    out = assign([("a", 10, {0, 1}), ("b", 6, {0, 1}), ("c", 5, {0, 1})], 2)
    assert out == {0: ["a"], 1: ["b", "c"]}


def test_format_table_and_report_json_roundtrip():
    txt = format_table(("key", "n"), [["a.b", 3], ["c", 12]])
    assert txt.splitlines()[2].endswith(" 3") and txt.splitlines()[3].startswith("c")
    rep = VerifyReport("local", "/l", None, 10)
    rep.problems.append(
        Problem(
            "nonfinite",
            "m",
            file="1/x.pt",
            holder_rank=1,
            owner_rank=0,
            role="replica",
            key="decoder.layers.mlp.linear_fc1.weight",
            global_offset=[1, 0, 0],
            prepend_axis_num=1,
        )
    )
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["ok"] is False and d["summary"]["problems_by_kind"] == {"nonfinite": 1}
    row = d["mismatch_table"][0]
    assert (
        row["key"],
        row["shards"],
        row["nonfinite"],
        row["replica"],
        row["primary"],
        row["indices"],
    ) == ("decoder.layers.mlp.linear_fc1.weight", 1, 1, 1, 0, "(1)")
    assert Problem.from_dict(d["problems"][0]) == rep.problems[0]


def test_input_errors(tmp_path):
    with pytest.raises(CheckpointInputError, match="does not exist"):
        discover_local(tmp_path / "nope")
    with pytest.raises(CheckpointInputError, match="nothing to verify"):
        verify_checkpoint()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointInputError, match="no local checkpoint files"):
        verify_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointInputError, match="neither a torch_dist iteration directory"):
        resolve_persistent_dir(tmp_path / "empty")
    it = tmp_path / "root" / "iter_0000020"
    it.mkdir(parents=True)
    (it / ".metadata").write_bytes(b"x")
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    with pytest.raises(
        CheckpointInputError, match=r"has no iteration 10; it has iteration\(s\) \[20\]"
    ):
        resolve_persistent_dir(tmp_path / "root", 10)
    assert resolve_persistent_dir(tmp_path / "root") == (it, 20)
    (it / "metadata.json").write_text('{"sharded_backend": "fsdp_dtensor"}')
    with pytest.raises(CheckpointInputError, match="only torch_dist"):
        resolve_persistent_dir(it)


def test_discover_local_session_dirs_and_dirty(tmp_path):
    for holder, owner in ((0, 0), (0, 1), (1, 0), (1, 1)):
        d = tmp_path / "sess" / str(holder)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"iter_0000010_{owner}_local.pt").write_bytes(b"x" * (holder + 1))
    (tmp_path / "sess" / "1" / "iter_0000020_1_local.dirty.pt").write_bytes(b"")
    lay = discover_local(tmp_path)
    assert lay.rank_root == tmp_path / "sess" and lay.iterations == [10]
    assert [(f.holder_rank, f.owner_rank, f.role) for f in lay.files[10]] == [
        (0, 0, "primary"),
        (0, 1, "replica"),
        (1, 0, "replica"),
        (1, 1, "primary"),
    ]
    assert lay.dirty == ["sess/1/iter_0000020_1_local.dirty.pt"]
    (tmp_path / "sess2" / "0").mkdir(parents=True)
    (tmp_path / "sess2" / "0" / "iter_0000010_0_local.pt").write_bytes(b"x")
    with pytest.raises(CheckpointInputError, match="several sessions"):
        discover_local(tmp_path)


def test_readahead_order_bound_and_cache_skip(tmp_path):
    import time

    f = tmp_path / "data.bin"
    f.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    ra = ReadAhead(block_bytes=64 * 1024, max_ahead_bytes=0)
    t0 = ra.add(f, 0, 1000)
    t1 = ra.add(f, 1000, 1000)
    t2 = ra.add(f, 2000, 1000)
    assert (t0, t1, t2) == (0, 1, 2)
    deadline = time.time() + 10
    while ra._done < 1 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert ra._done == 1  # ticket 2 waits: 1000 bytes queued beyond the last wanted ticket > 0
    ra.wait(t2)
    assert ra._done == 2
    ra.close()
    # a file just written is in the page cache: the RWF_NOWAIT probes find it, nothing is read
    ra = ReadAhead(block_bytes=64 * 1024)
    ra.wait(ra.add(f))
    if hasattr(os, "RWF_NOWAIT"):
        assert ra.bytes_read == 0
    ra.close()
    off = ReadAhead(enabled=False)
    assert off.add(f) == -1
    off.wait(-1)
