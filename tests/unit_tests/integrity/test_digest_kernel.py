"""The state digest's two compiled CPU forms (scalar, vectorized) give the same sum, equal to the
torch implementation's, for every element width and run layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.integrity.digest import state as sd

numba = pytest.importorskip("numba")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_both_forms_equal_the_torch_implementation(dtype, monkeypatch):
    from megatron.integrity.digest import kernel as dk

    t = (torch.randn(37, 23, generator=torch.Generator().manual_seed(11)) * 50).to(dtype)
    gshape = (37, 61)
    cases = [(0, t.numel()), (5, 6), (3, 400), (22, 851), (0, 0)]
    for start, stop in cases:
        monkeypatch.setattr(sd, "_USE_NUMBA", False)
        want = sd.range_sum(t, start, stop, t.shape, (0, 30), gshape)
        monkeypatch.setattr(sd, "_USE_NUMBA", True)
        size = t.element_size()
        flat = t.reshape(-1)[start:stop].contiguous()
        vals = flat.view(sd._VIEW[size]).numpy().view(sd._UNSIGNED[size])
        starts, lens = sd._segments(start, stop, t.shape, (0, 30), gshape)
        if stop > start:
            assert int(dk.segments_sum(vals, starts, lens)) == want, (start, stop)
            assert int(dk.segments_sum_vector(vals, starts, lens)) == want, (start, stop)
        assert sd.range_sum(t, start, stop, t.shape, (0, 30), gshape) == want


def test_the_form_follows_the_cpu_features(monkeypatch):
    from megatron.integrity.digest import kernel as dk

    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+avx512dq,+avx512vl")
    assert dk.vector_multiplies() and dk.kernel() is dk.segments_sum_vector
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,-avx512dq,-avx512vl")
    assert not dk.vector_multiplies() and dk.kernel() is dk.segments_sum
    # long runs: the vectorized body and its remainder
    x = np.arange(1 << 12, dtype=np.uint32) * np.uint32(2654435761)
    starts = np.array([0, 5000, 1 << 40], dtype=np.int64)
    lens = np.array([1001, 2047, (1 << 12) - 3048], dtype=np.int64)
    assert dk.segments_sum(x, starts, lens) == dk.segments_sum_vector(x, starts, lens)
