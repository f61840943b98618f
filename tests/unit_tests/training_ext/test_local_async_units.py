"""Units of asynchronous local saves: the staging slot's snapshot and the deferred state digest
(summed later, from a snapshot, to the same values as the digest of the live tensors)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron.training_ext.local_tier.async_save import AsyncJob, AsyncLocalWriter, StagingSlot
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


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo world in this process (the writer builds its process groups from it)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _deferred_job(writer, tensor, iteration, gate=None, stage=None):
    """A save job whose snapshot of ``tensor`` the writer's snapshot thread takes (after ``gate``
    is set, when given; with ``stage`` instead of the slot's); ``got`` receives the snapshot the
    background work saw."""
    slot = writer.slot_for(iteration)
    got = {}
    if stage is not None:
        slot.stage = stage
    if gate is not None:
        stage = slot.stage
        slot.stage = lambda ts: gate.wait(10) and stage(ts)
    job = AsyncJob(iteration, slot, lambda j: got.update(t=j.payload["tensors"][0].clone()))
    job.sources = lambda: [tensor.detach()]
    job.stage_done = lambda staged: job.payload.update(tensors=staged)
    writer.submit(job)
    return job, got


def test_a_deferred_snapshot_is_taken_before_the_next_optimizer_step(one_rank):
    w = torch.nn.Parameter(torch.arange(1 << 16, dtype=torch.float32))
    opt = torch.optim.SGD([w], lr=1.0)
    writer = AsyncLocalWriter()
    try:
        assert not writer.defer_snapshot()  # the first save snapshots in the loop
        assert not writer.defer_snapshot()  # no optimizer step seen since: still in the loop
        w.grad = torch.ones_like(w)
        opt.step()  # the pre-step hook runs: from now on the snapshot may be deferred
        assert writer.steps == 1 and writer.defer_snapshot()
        before = w.detach().clone()
        gate = threading.Event()
        job, got = _deferred_job(writer, w, 2, gate)
        threading.Timer(0.3, gate.set).start()
        t0 = time.perf_counter()
        opt.step()  # waits for the snapshot (held back 0.3 s) before changing w
        waited = time.perf_counter() - t0
        assert job.done.wait(10) and job.error is None
        assert waited >= 0.25, waited
        assert torch.equal(got["t"], before) and not torch.equal(w.detach(), before)
        assert torch.equal(w.detach(), before - 1.0)
    finally:
        writer.close()


def test_without_the_pre_step_wait_a_deferred_snapshot_would_hold_the_next_step(one_rank):
    """Guard: the wait is what keeps the snapshot at the saved iteration."""
    w = torch.nn.Parameter(torch.zeros(1 << 16))
    opt = torch.optim.SGD([w], lr=1.0)
    writer = AsyncLocalWriter()
    writer._hook.remove()
    try:
        gate = threading.Event()
        job, got = _deferred_job(writer, w, 2, gate)
        w.grad = torch.ones_like(w)
        opt.step()  # does not wait
        gate.set()
        assert job.done.wait(10) and job.error is None
        assert torch.equal(got["t"], torch.full_like(got["t"], -1.0))  # the stepped values
    finally:
        writer.close()


def test_a_failed_deferred_snapshot_fails_the_save_and_releases_the_step(one_rank):
    writer = AsyncLocalWriter()
    try:

        def boom(_):
            raise MemoryError("no room for the staging buffer")

        job, got = _deferred_job(writer, torch.zeros(4), 2, stage=boom)
        writer.wait_staged()  # returns: a failed snapshot does not hold the step
        assert job.done.wait(10)
        assert job.error == "snapshot: MemoryError: no room for the staging buffer", job.error
        assert got == {}  # nothing was written
    finally:
        writer.close()
