"""Replication on CUDA hashes on the GPU: no host copy for checksums, no CPU hash, digests read
with one small copy (one GPU, a one-rank NCCL group; skipped without CUDA)."""

from __future__ import annotations

import os

import pytest

# tests/unit_tests/fixes is on sys.path (pytest rootdir-less import)
import replication_doubles as D
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture
def nccl_group():
    import torch.distributed as dist

    from tests.helpers.dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def test_replicate_hashes_on_the_gpu_without_host_copies_for_checksums(nccl_group, monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    from megatron.fixes import replication as R
    from megatron.integrity.checksum import device as dh
    from megatron.integrity.checksum import tensor as ck

    def no_cpu_hash(*a, **k):
        raise AssertionError("a CPU hash ran inside replicate() on CUDA")

    monkeypatch.setattr(R.transport, "_cpu_checksum", no_cpu_hash)
    monkeypatch.setattr(ck, "checksum_bytes", no_cpu_hash)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(n, device="cuda", generator=g) for n in (1 << 20, 4096, 3, 1 << 18)]
    tensors.append(torch.randn(64, 64, device="cuda", generator=g).t())  # non-contiguous
    want = [dh.pmix64(t.contiguous().cpu(), "torch") for t in tensors]
    strategy = R.FixedCliqueReplicationStrategy(nccl_group, target_device="cpu")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        hollows, _ = strategy.replicate(D.ListStateDict(tensors), "id0")
        torch.cuda.synchronize()
    record = ck.get_record(hollows[0])
    assert record["algorithm"] == "pmix64" and [e["checksum"] for e in record["entries"]] == want
    stored = list(hollows[0].tensors)
    assert all(s.device.type == "cpu" for s in stored)
    assert all(torch.equal(s, t.cpu()) for s, t in zip(stored, tensors))
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    d2h = [
        e
        for e in events
        if "DtoH" in e.name or "Device -> Pageable" in e.name or "Device -> Pinned" in e.name
    ]
    # one host copy per stored tensor plus one read of all digests; nothing for hashing
    assert len(d2h) <= len(tensors) + 1, [e.name for e in d2h]
    assert any("pmix64" in e.name for e in events), sorted({e.name for e in events})
