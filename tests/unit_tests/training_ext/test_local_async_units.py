"""Units of asynchronous local saves: the staging slot's snapshot and the deferred state digest
(summed later, from a snapshot, to the same values as the digest of the live tensors)."""

from __future__ import annotations

import torch

from megatron.training_ext.local_tier.async_save import StagingSlot
from megatron.training_ext.resume_proof.digest import DeferredDigest, PartialDigest


def test_a_snapshot_holds_the_values_at_staging_and_reuses_its_buffers():
    base = torch.arange(64, dtype=torch.float32)
    a, b = base[:32].view(4, 8), base[32:]  # two views of one storage: one copy
    big = torch.zeros(1000)
    small = big[10:20]  # a small view of a large storage: copied alone
    ints = torch.arange(6, dtype=torch.int64).view(2, 3).t()  # non-contiguous
    slot = StagingSlot()
    staged = slot.stage([a, b, small, ints])
    assert slot.nbytes == 64 * 4 + 10 * 4 + 6 * 8
    want = [t.clone() for t in (a, b, small, ints)]
    base.add_(1.0)
    big.fill_(7.0)
    ints.mul_(3)
    for s, w in zip(staged, want):
        assert s.dtype == w.dtype and s.shape == w.shape and torch.equal(s, w)
    assert staged[0].untyped_storage().data_ptr() == staged[1].untyped_storage().data_ptr()
    buffers = [buf.data_ptr() for buf in slot.buffers]
    again = slot.stage([a, b, small, ints])  # same sizes: the same buffers, new values
    assert sorted(buf.data_ptr() for buf in slot.buffers) == sorted(buffers)
    assert torch.equal(again[0], a) and torch.equal(again[2], small) and torch.equal(again[3], ints)


def test_a_deferred_digest_sums_its_snapshot_to_the_live_digest():
    torch.manual_seed(0)
    w = torch.randn(6, 4)
    state = torch.randn(24)
    live, deferred = PartialDigest(), DeferredDigest()
    for acc in (live, deferred):
        acc.add("w", acc.block_sum(w, (2, 0), (8, 4)), (8, 4), w.dtype, "model")
        v = acc.range_sum(w, 4, 20, (6, 4), (2, 0), (8, 4), state[4:20])
        acc.add("optimizer.state.exp_avg.w", v, (8, 4), state.dtype, "optimizer")
    snapshot = StagingSlot().stage(deferred.tensors())
    deferred.bind(snapshot)
    w.mul_(2.0)  # training goes on: the deferred digest reads the snapshot
    state.zero_()
    deferred.evaluate()
    assert deferred.sums == live.sums and deferred.meta == live.meta
    assert deferred.recorded == []
