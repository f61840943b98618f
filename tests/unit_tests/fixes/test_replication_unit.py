"""Replication fix and megatron.integrity.checksum.tensor: single-process tests (no process
group)."""

from __future__ import annotations

import pickle
import random

import pytest
import replication_doubles as D
import torch
import xxhash

from megatron.fixes import FixStatus
from megatron.fixes import replication as R
from megatron.integrity.checksum import tensor as ck


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


# ----------------------------------------------------------------------------- checksums


class _Holder:
    """Any picklable object carries a record, as a TensorAwareStateDict does."""


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.randn(5, 3).to(torch.bfloat16),
        (torch.randn(6) * 10).to(torch.float8_e4m3fn),
        torch.arange(7, dtype=torch.int32).to(torch.uint16),
        torch.tensor([True, False, True]),
        torch.tensor(2.5, dtype=torch.float64),
        torch.empty(0, 3),
    ],
    ids=["f32", "bf16", "f8", "u16", "bool", "0d", "empty"],
)
def test_tensor_checksum_is_xxh3_of_row_major_bytes(t):
    assert ck.tensor_checksum(t) == xxhash.xxh3_64_intdigest(_raw(t))
    assert 0 <= ck.tensor_checksum(t) < 2**64


def test_tensor_checksum_of_views_is_over_logical_elements():
    x = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    view = x[:, ::2]
    assert ck.tensor_checksum(view) == ck.tensor_checksum(view.contiguous())
    assert ck.tensor_checksum(view) != ck.tensor_checksum(x)
    assert ck.tensor_checksum(x[1:]) == xxhash.xxh3_64_intdigest(_raw(x[1:]))
    y = x.clone()
    y[3, 9] += 1
    assert ck.tensor_checksum(y) != ck.tensor_checksum(x)


def test_tensor_checksum_refuses_quantized_and_meta():
    with pytest.raises(TypeError, match="dequantize"):
        ck.tensor_checksum(D.quantize(torch.randn(4)))
    with pytest.raises(ValueError, match="meta"):
        ck.tensor_checksum(torch.empty(3, device="meta"))


def test_record_roundtrip_and_verification():
    a, b = torch.randn(3, 4), torch.arange(5, dtype=torch.int64)
    entries = [ck.make_entry(0, "w.a", a, global_offset=(0, 0)), ck.make_entry(1, "w.b", b)]
    assert entries[0] == {
        "index": 0,
        "key": "w.a",
        "global_offset": [0, 0],
        "dtype": "float32",
        "shape": [3, 4],
        "nbytes": 48,
        "checksum": ck.tensor_checksum(a),
    }

    h = _Holder()
    ck.attach_record(h, ck.make_record(3, entries))
    h2 = pickle.loads(pickle.dumps(h))
    rec = ck.get_record(h2)
    assert rec["owner_rank"] == 3 and rec["algorithm"] == "xxh3_64" and rec["version"] == 1
    assert ck.verify_record(rec, [a, b]) == []

    bad = a.clone()
    bad[1, 2] = -bad[1, 2]
    mismatches = ck.verify_record(rec, [bad, b])
    assert len(mismatches) == 1 and mismatches[0].key == "w.a" and mismatches[0].index == 0
    assert "checksum mismatch" in str(mismatches[0]) and "'w.a'" in str(mismatches[0])
    assert mismatches[0].actual == ck.tensor_checksum(bad)

    wrong_dtype = ck.verify_record(rec, [a.double(), b])
    assert len(wrong_dtype) == 1 and "dtype/shape" in wrong_dtype[0].detail
    assert any("record lists 2" in m.detail for m in ck.verify_record(rec, [a]))

    ck.attach_record(h, None)
    assert ck.get_record(h) is None
    ck.attach_record(h, dict(rec, version=99))
    with pytest.raises(ValueError, match="version 99"):
        ck.get_record(h)


# ----------------------------------------------------------------------------- conversion


def test_is_quantized_duck_typing():
    assert R.is_quantized(D.quantize(torch.randn(3)))
    assert not R.is_quantized(torch.randn(3))
    assert not R.is_quantized(torch.nn.Parameter(torch.randn(3)))
    assert hasattr(torch.randn(3), "dequantize")  # why hasattr is no test


def test_prepare_tensor_converts_only_what_needs_it():
    w = torch.randn(4, 6).to(torch.bfloat16)
    q = D.quantize(w)
    out, converted = R.prepare_tensor("q", q)
    assert converted and type(out) is torch.Tensor and out.dtype == torch.bfloat16
    assert torch.equal(out, q.dequantize())

    plain = torch.randn(3, 3)
    out, converted = R.prepare_tensor("p", plain)
    assert out is plain and not converted

    offset = torch.randn(20)[4:13].view(3, 3)  # contiguous offset view: carried as it is
    out, converted = R.prepare_tensor("o", offset)
    assert out is offset and not converted

    strided = torch.randn(4, 6)[:, ::2]
    out, converted = R.prepare_tensor("s", strided)
    assert converted and out.is_contiguous() and torch.equal(out, strided)


def test_check_tensor_refusals_name_the_key():
    assert R.check_tensor("ok", torch.randn(2)) is None
    assert R.check_tensor("q", D.quantize(torch.randn(2))) is None
    assert "'m.meta'" in R.check_tensor("m.meta", torch.empty(2, device="meta"))
    assert "'s.sparse'" in R.check_tensor("s.sparse", torch.eye(3).to_sparse())
    qint = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    assert "'n.native'" in R.check_tensor("n.native", qint)
    assert "not a torch.Tensor" in R.check_tensor("x", 3)

    class Opaque(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    msg = R.check_tensor("w.opaque", Opaque(torch.zeros(2)))
    assert "'w.opaque'" in msg and "Opaque" in msg and "dequantize" in msg
    with pytest.raises(R.UnsupportedTensorError, match="'w.opaque'"):
        R.prepare_tensor("w.opaque", Opaque(torch.zeros(2)))


# ----------------------------------------------------------------------------- message planning


@pytest.mark.parametrize("seed", range(5))
def test_plan_messages_tiles_each_segment_in_place(seed):
    """Segments hold one dtype and at most the bucket (or one larger tensor); messages cover every
    byte of every tensor once, never exceed the bucket, never span two segments, and each message
    is one contiguous range of its segment (so the receiver receives it in place); large tensors
    are never copied through staging."""
    rng = random.Random(seed)
    dtypes = ["float32", "bfloat16", "uint8"]
    entries = [
        {"dtype": rng.choice(dtypes), "nbytes": rng.choice([0, 2, 4, 50, 100, 256, 1000, 4096])}
        for _ in range(40)
    ]
    bucket, direct_min = 512, 300
    groups, names, offsets, totals = R.segments(entries, bucket)
    assert sorted(i for g in groups for i in g) == list(range(40))
    for g, members in enumerate(groups):
        assert all(entries[i]["dtype"] == names[g] for i in members)
        assert totals[g] == sum(entries[i]["nbytes"] for i in members)
        assert totals[g] <= bucket or len(members) == 1
        assert members == sorted(members)
    sizes = [e["nbytes"] for e in entries]
    msgs = R.plan_messages(1, sizes, bucket, direct_min, groups)
    covered = [[0] * n for n in sizes]
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    for m in msgs:
        assert m.src == 1 and 0 < m.size <= bucket
        assert m.start + m.size <= totals[m.group]
        assert sum(p[2] for p in m.pieces) == m.size  # contiguous: no gaps inside a group
        for i, toff, length, moff in m.pieces:
            assert group_of[i] == m.group
            assert offsets[i] + toff == m.start + moff  # in place in the flat buffer
            if sizes[i] >= direct_min:
                assert m.direct
            for b in range(toff, toff + length):
                covered[i][b] += 1
    assert all(c == 1 for row in covered for c in row)


def test_interleave_round_robin():
    a = R.plan_messages(0, [10, 10, 10], 10, 10)
    b = R.plan_messages(1, [10], 10, 10)
    assert [m.src for m in R.interleave([a, b])] == [0, 1, 0, 0]


# ----------------------------------------------------------------------------- the fix object


@pytest.fixture
def clean_fix():
    R.FIX.reset()
    yield R.FIX
    R.FIX.reset()


def test_upstream_nvrx_070_does_not_behave(clean_fix):
    assert clean_fix.installed_version() == "0.7.0"
    assert clean_fix.upstream_behaves() is False


def test_apply_is_idempotent_and_reset_restores_upstream(clean_fix):
    from nvidia_resiliency_ext.checkpointing.local.replication import strategies

    upstream = strategies.CliqueReplicationStrategy
    up_replicate = upstream.__dict__["replicate"]
    up_retrieve = upstream.__dict__["retrieve_execute"]
    assert upstream is R.UpstreamClique and up_replicate is R.UPSTREAM_REPLICATE

    assert clean_fix.apply() is FixStatus.ACTIVE
    assert strategies.CliqueReplicationStrategy is R.FixedCliqueReplicationStrategy
    assert upstream.__dict__["replicate"] is R.fixed_replicate
    assert upstream.__dict__["retrieve_execute"] is R.fixed_retrieve_execute
    assert issubclass(R.FixedCliqueReplicationStrategy, upstream)

    assert clean_fix.apply() is FixStatus.ACTIVE  # second call changes nothing
    assert strategies.CliqueReplicationStrategy is R.FixedCliqueReplicationStrategy
    assert len(clean_fix._patcher._originals) == 3

    clean_fix.reset()
    assert clean_fix.status is FixStatus.NOT_APPLIED
    assert strategies.CliqueReplicationStrategy is upstream
    assert upstream.__dict__["replicate"] is up_replicate
    assert upstream.__dict__["retrieve_execute"] is up_retrieve
    assert clean_fix.upstream_behaves() is False  # the probe sees upstream again


def test_stands_aside_when_upstream_already_dequantizes(clean_fix, monkeypatch):
    """If NVRx's replicate handed the transport dense, dequantized tensors, the fix would stand
    aside: simulate such an upstream by swapping the replicate the probe runs."""
    from nvidia_resiliency_ext.checkpointing.local.replication import strategies

    def behaving_replicate(self, local_ckpt, id_):
        tensors = [
            (
                t.dequantize() if type(t).dequantize is not torch.Tensor.dequantize else t
            ).contiguous()
            for t in local_ckpt.pop_tensors()
        ]
        others = self.local_group.all_gather_object(local_ckpt)
        data = self.local_group.all_gather_batch(tensors, target_device=self.target_device)
        for lch, td in zip(others, data):
            lch.insert_tensors(td)
        return others, self.local_group.all_gather_object(id_)

    monkeypatch.setattr(R, "UPSTREAM_REPLICATE", behaving_replicate)
    assert clean_fix.upstream_behaves() is True
    assert clean_fix.apply() is FixStatus.STANDS_ASIDE
    assert strategies.CliqueReplicationStrategy is R.UpstreamClique


def test_fixed_strategy_validates_its_knobs():
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper

    s = R.FixedCliqueReplicationStrategy(GroupWrapper(), bucket_bytes=1 << 20, pipeline_depth=3)
    assert (s.bucket_bytes, s.pipeline_depth, s.target_device) == (1 << 20, 3, "cpu")
    with pytest.raises(ValueError, match="bucket_bytes"):
        R.FixedCliqueReplicationStrategy(GroupWrapper(), bucket_bytes=0)


def test_probe_is_not_fooled_by_a_wrapper(clean_fix, monkeypatch):
    """NVRx's replicate behind a plain wrapper (other source, no ``__wrapped__``) still hands the
    transport the quantized tensor itself; the behavioural probe still sees the defect."""
    upstream = R.UPSTREAM_REPLICATE

    def replicate(self, local_ckpt, id_):
        return upstream(self, local_ckpt, id_)

    monkeypatch.setattr(R, "UPSTREAM_REPLICATE", replicate)
    assert clean_fix.upstream_behaves() is False


def test_declared_patches_match_the_installed_records(clean_fix):
    """The fix's patches are declared (listed before install) with the targets and reasons the
    registry records once it is installed."""
    declared = [(s.target, s.why) for s in clean_fix.specs()]
    assert [p.target for p in clean_fix.patches] == [t for t, _ in declared]
    assert clean_fix.apply() is FixStatus.ACTIVE
    assert [(s.target, s.why) for s in clean_fix.specs()] == declared
