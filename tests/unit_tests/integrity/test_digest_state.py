"""The state digest's properties: the definition, shard-split invariance, bit-flip and swap
sensitivity, CPU == CUDA; and the comparison's rules (what is not compared)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron.integrity.digest import state as sd
from megatron.integrity.mix64 import K_POS, mix_int
from megatron.training_ext.resume_proof import compare

_MASK = (1 << 64) - 1


def reference(t: torch.Tensor) -> int:
    """The definition, in plain Python integers."""
    bits = sd._bits(t.reshape(-1).contiguous()).tolist()
    s = 0
    for g, v in enumerate(bits):
        s = (s + mix_int((v & _MASK) + (g + 1) * K_POS)) & _MASK
    return sd.finish([s], t.numel())


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8,
     torch.bool],
)  # fmt: skip
def test_matches_the_definition(dtype):
    t = (torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(1)) * 10).to(dtype)
    assert sd.tensor_digest(t) == reference(t)


def test_known_value():
    """Pinned: a change of the definition must be a new VERSION."""
    assert sd.tensor_digest(torch.arange(6, dtype=torch.float32).reshape(2, 3)) == reference(
        torch.arange(6, dtype=torch.float32)
    )
    assert f"{sd.tensor_digest(torch.arange(6, dtype=torch.float32)):016x}" == (
        f"{reference(torch.arange(6, dtype=torch.float32)):016x}"
    )


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("ways", [1, 2, 3])
def test_shard_split_invariance(dim, ways):
    t = torch.randn(6, 9, 4, generator=torch.Generator().manual_seed(2))
    full = sd.tensor_digest(t)
    sums, off = [], 0
    for part in torch.tensor_split(t, ways, dim=dim):
        offset = [0, 0, 0]
        offset[dim] = off
        sums.append(sd.block_sum(part.clone(), offset, t.shape))
        off += part.shape[dim]
    random.Random(ways).shuffle(sums)  # the order of the ranks does not matter
    assert sd.finish(sums, t.numel()) == full


def test_grid_split_flat_ranges_and_stacked_layers():
    t = torch.randn(6, 9, 4, generator=torch.Generator().manual_seed(3))
    full = sd.tensor_digest(t)
    # a 2 x 3 grid (TP x another split)
    sums = [
        sd.block_sum(b.clone(), [i * 3, j * 3, 0], t.shape)
        for i, a in enumerate(torch.tensor_split(t, 2, 0))
        for j, b in enumerate(torch.tensor_split(a, 3, 1))
    ]
    assert sd.finish(sums, t.numel()) == full
    # a TP shard split further into flat DP ranges (the distributed optimizer's layout)
    block = t[:, 3:6, :]
    n = block.numel()
    cuts = [0] + sorted(random.Random(4).sample(range(1, n), 5)) + [n]
    sums = [
        sd.range_sum(block, a, b, block.shape, [0, 3, 0], t.shape,
                     values=block.reshape(-1)[a:b].clone())
        for a, b in zip(cuts, cuts[1:])
    ]  # fmt: skip
    sums += [sd.block_sum(t[:, :3], [0, 0, 0], t.shape), sd.block_sum(t[:, 6:], [0, 6, 0], t.shape)]
    assert sd.finish(sums, t.numel()) == full
    # layers stacked along a prepended axis (PP stages hold different layers)
    layers = [torch.randn(4, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    stacked = torch.stack(layers)
    sums = [sd.block_sum(x, [i, 0, 0], stacked.shape) for i, x in enumerate(layers)]
    assert sd.finish(sums, stacked.numel()) == sd.tensor_digest(stacked)


def test_chunk_boundaries(monkeypatch):
    monkeypatch.setattr(sd, "CHUNK", 7)
    monkeypatch.setattr(sd, "_USE_NUMBA", False)  # the torch implementation's chunking
    t = torch.randn(10, 13, generator=torch.Generator().manual_seed(5))
    left, right = t[:, :5], t[:, 5:]  # runs of 5 (< chunk) and 8 (> chunk)
    sums = [sd.block_sum(left, [0, 0], t.shape)] + [
        sd.range_sum(right, a, b, right.shape, [0, 5], t.shape)
        for a, b in ((0, 11), (11, 50), (50, 80))
    ]
    assert sd.finish(sums, t.numel()) == reference(t)


@pytest.mark.skipif(sd._numba_kernel() is None, reason="numba not installed")
def test_numba_kernel_equals_torch_ops(monkeypatch):
    """The CPU kernel and the torch implementation (CUDA, and CPU without numba) agree."""
    t = torch.randn(6, 9, 4, generator=torch.Generator().manual_seed(10))
    cases = [(t, 0, t.numel(), t.shape, (0, 0, 0))]
    block = t[:, 3:6, :].contiguous()
    cases += [(block, a, b, block.shape, (0, 3, 0)) for a, b in ((0, 72), (5, 41), (13, 14))]
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.uint8):
        for x, a, b, lshape, off in cases:
            x = x.to(dtype)
            with_numba = sd.range_sum(x, a, b, lshape, off, t.shape)
            monkeypatch.setattr(sd, "_USE_NUMBA", False)
            assert sd.range_sum(x, a, b, lshape, off, t.shape) == with_numba, (dtype, a, b)
            monkeypatch.setattr(sd, "_USE_NUMBA", True)


def test_every_single_bit_flip_changes_it():
    """A 1 MiB fp32 tensor; 256 (element, bit) flips sampled with a fixed seed."""
    t = torch.randn(256, 1024, generator=torch.Generator().manual_seed(6))
    base = sd.tensor_digest(t)
    rnd = random.Random(7)
    flat = t.view(-1).view(torch.int32)
    for _ in range(256):
        i, bit = rnd.randrange(flat.numel()), rnd.randrange(32)
        old = int(flat[i])
        flat[i] = old ^ (1 << bit) if bit < 31 else old ^ -(1 << 31)
        assert sd.tensor_digest(t) != base, (i, bit)
        flat[i] = old
    assert sd.tensor_digest(t) == base


def test_swapped_elements_and_shapes_change_it():
    t = torch.randn(64, 64, generator=torch.Generator().manual_seed(8))
    base = sd.tensor_digest(t)
    s = t.clone()
    s[3, 5], s[40, 2] = t[40, 2], t[3, 5]
    assert sd.tensor_digest(s) != base
    assert sd.tensor_digest(t.t().contiguous()) != base  # a transposed layout
    assert sd.tensor_digest(t[:-1]) != sd.tensor_digest(t)  # a truncated one


def test_bad_places_are_refused():
    t = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="exceeds global shape"):
        sd.block_sum(t, [2, 0], (5, 4))
    with pytest.raises(ValueError, match="does not match"):
        sd.range_sum(t, 0, 4, (4, 4), (0,), (4, 4))
    with pytest.raises(TypeError, match="not supported"):
        sd.tensor_digest(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_equals_cuda():
    t = torch.randn(333, 77, generator=torch.Generator().manual_seed(9))
    for dtype in (torch.float32, torch.bfloat16):
        x = t.to(dtype)
        assert sd.tensor_digest(x.cuda()) == sd.tensor_digest(x)
        part = x[:, 10:40]
        assert sd.block_sum(part.cuda(), [0, 10], x.shape) == sd.block_sum(part, [0, 10], x.shape)


OPT = "optimizer.state.exp_avg.w"


def _record(**tensors):
    return {
        "layout": {"world_size": 2},
        "rng": [{"torch": "a"}, {"torch": "b"}],
        "scalars": {"iteration": 8, "consumed_train_samples": 32, "optimizer_step": [8.0]},
        "tensors": {
            k: {"digest": d, "shape": s, "dtype": "float32", "kind": kind}
            for k, (d, s, kind) in tensors.items()
        },
    }


def test_compare_rules():
    saved = _record(w=("01", [4], "model"), **{OPT: ("02", [4], "optimizer")})
    same = compare(saved, saved, {})
    assert same.ok and same.equal == 2 and not same.not_compared

    now = _record(w=("01", [4], "model"), **{OPT: ("ff", [4], "optimizer")})
    bad = compare(saved, now, {})
    assert not bad.ok and bad.differ == ["optimizer.state.exp_avg.w"]
    # --no-load-optim: the optimizer state is not compared, never a failure
    skipped = compare(saved, now, {"optimizer": False})
    assert skipped.ok and skipped.equal == 1
    assert "optimizer state (not loaded)" in skipped.not_compared
    # a documented shape change (vocabulary padding at another TP) is reported, not a failure
    padded = _record(w=("77", [8], "model"), **{OPT: ("02", [4], "optimizer")})
    shape = compare(saved, padded, {})
    assert shape.ok and shape.not_compared == ["w: float32[4] saved, float32[8] now"]
    # RNG: compared at the same layout, reported as not compared at another
    rng = dict(saved, rng=[{"torch": "a"}, {"torch": "c"}])
    assert compare(saved, rng, {}).differ == ["RNG state of rank(s) 1 (torch)"]
    other = dict(rng, layout={"world_size": 4}, rng=[{"torch": "a"}] * 4)
    assert compare(saved, other, {}).ok
    # scalars
    later = dict(saved, scalars=dict(saved["scalars"], consumed_train_samples=36))
    assert compare(saved, later, {}).differ == ["consumed_train_samples (32 saved, 36 now)"]
    assert compare(saved, later, {"progress": False}).ok
    # a tensor the load did not rebuild
    missing = _record(**{OPT: ("02", [4], "optimizer")})
    assert compare(saved, missing, {}).differ == ["w (not loaded)"]


def test_a_rank_that_cannot_digest_makes_every_rank_skip_the_digest(monkeypatch):
    """The local work's failure is exchanged with the partial sums, so every rank raises the same
    DigestUnavailable after the collective (none is left waiting in it)."""
    from argparse import Namespace

    from megatron.training import checkpointing

    from megatron.training_ext import resume_proof

    monkeypatch.setattr(checkpointing, "_build_sharded_state_dict_metadata", lambda args: {})

    class Broken(torch.nn.Module):
        def sharded_state_dict(self, **kw):
            raise TypeError("Float8Tensor: no byte view")

    with pytest.raises(resume_proof.DigestUnavailable, match="rank 0: TypeError: Float8Tensor"):
        resume_proof.digest_training_state([Broken()], None, None, Namespace(), 8)
