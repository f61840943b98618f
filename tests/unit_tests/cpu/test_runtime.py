"""megatron.cpu.runtime: CUDA device arguments map to CPU, and the CUDA RNG stand-in is a separate,
restorable stream that dropout draws from (the basis of bitwise resume with dropout).

The runtime is process-global, so both scripts run in a process of their own: forked from the
test forkserver (``tests.helpers.dist.run_python``: torch and upstream imported, nothing applied or
activated; ``activate()`` imports upstream before it patches anyway), not a fresh interpreter.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers.dist import run_python

SCRIPT = textwrap.dedent(
    """
    import threading, torch
    from megatron.cpu import runtime
    runtime.activate(); runtime.activate()  # idempotent

    # devices
    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
    x = torch.ones(3).cuda()
    assert x.device.type == "cpu" and x.to("cuda:0").device.type == "cpu"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.cuda.device_count() == 1
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record(); ev1.record(); assert ev0.elapsed_time(ev1) >= 0

    # in a new thread and inside a custom backward, where torch function modes are normally off
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.zeros(1, device="cuda").device.type)); \
t.start(); t.join()
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a): return a * 2
        @staticmethod
        def backward(ctx, g):
            seen.append(torch.zeros(1, device="cuda").device.type); return g * 2
    F.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == ["cpu", "cpu"], seen

    # the CUDA RNG stand-in: dropout on a stand-in GPU tensor draws from it, not from the CPU
    # generator (torch.manual_seed seeds both, as on a GPU, so seed the CPU first)
    _drop = torch.nn.functional.dropout
    drop = lambda x, p: _drop(x.cuda(), p)
    torch.manual_seed(1); torch.cuda.manual_seed(7)
    a = drop(torch.ones(1000), 0.5)
    torch.manual_seed(2); torch.cuda.manual_seed(7)     # other CPU seed: same mask
    b = drop(torch.ones(1000), 0.5)
    assert torch.equal(a, b)
    torch.manual_seed(1); torch.cuda.manual_seed(8)     # other CUDA seed: other mask
    c = drop(torch.ones(1000), 0.5)
    assert not torch.equal(a, c)
    state = torch.cuda.get_rng_state()
    d = drop(torch.ones(1000), 0.5)
    torch.cuda.set_rng_state(state)
    e = drop(torch.ones(1000), 0.5)
    assert torch.equal(d, e)
    cpu_before = torch.get_rng_state()
    drop(torch.ones(1000), 0.5)
    assert torch.equal(cpu_before, torch.get_rng_state()), "dropout must not consume the CPU stream"
    print("OK")
    """
)


@pytest.mark.slow
def test_cpu_runtime_in_subprocess():
    out = run_python(SCRIPT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-4000:]


GUARD = textwrap.dedent(
    """
    import torch
    try:
        torch.empty(2, device="cuda")
    except (RuntimeError, AssertionError) as e:
        print("FAILS", type(e).__name__)
    """
)


def test_guard_without_runtime_cuda_calls_fail():
    """Guard: on this machine upstream's CUDA calls fail without the runtime, so the test above
    proves the runtime does the work."""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU is present")
    out = run_python(GUARD, timeout=300)
    assert "FAILS" in out.stdout, out.stdout + out.stderr[-2000:]


METADATA = textwrap.dedent(
    """
    import torch
    from megatron.core.dist_checkpointing import mapping
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing import optimizer as optim_ckpt
    from megatron.cpu import runtime
    from megatron.cpu.runtime import CudaToCpuMode

    calls = []
    upstream_tf = CudaToCpuMode.__torch_function__
    def counting(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return upstream_tf(self, func, types, args, kwargs)
    CudaToCpuMode.__torch_function__ = counting
    if PATCHED:
        runtime.activate()
    else:  # the mode alone, as the backend enters it, without the backend's patches
        CudaToCpuMode().__enter__()

    w = torch.randn(4, 6).cuda()
    exp_avg = torch.zeros(4, 6).cuda()
    calls.clear()
    sh = mapping.ShardedTensor.from_rank_offsets("w", w, (0, 1, 2), replica_id=(0, 0, 0))
    opt = optim_ckpt.make_sharded_optimizer_tensor(sh, exp_avg, "optimizer.state.exp_avg")
    built = len(calls)
    assert type(sh) is mapping.ShardedTensor and sh.global_shape == (8, 6)  # a classmethod still
    assert sh.global_offset == (4, 0) and sh.data is w
    assert opt.key == "optimizer.state.exp_avg.w" and opt.data is exp_avg
    # upstream's validation still runs and still rejects what it rejected
    try:
        mapping.ShardedTensor("x", torch.zeros(3).cuda(), torch.float16, (3,), (3,), (0,), None)
        print("NOT REJECTED")
    except CheckpointingException:
        pass
    print("MODE CALLS", built)
    """
)


@pytest.mark.parametrize("patched", [True, False], ids=["backend", "guard-mode-alone"])
def test_checkpoint_metadata_is_built_without_the_mode(patched):
    """The CPU backend runs upstream's ShardedTensor metadata helpers (validation, the rank-offset
    constructor, the optimizer's ShardedTensors) without its torch function mode: the same
    metadata, the same validation, no call through the mode. Guard: with the mode alone, the
    same helpers call through it (so the count can fail)."""
    out = run_python(f"PATCHED = {patched}\n" + METADATA, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "NOT REJECTED" not in out.stdout
    calls = int(out.stdout.split("MODE CALLS")[-1].split()[0])
    if patched:
        assert calls == 0, out.stdout
    else:
        assert calls > 5, out.stdout
