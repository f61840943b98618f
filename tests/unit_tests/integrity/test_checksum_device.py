"""Checksum algorithms of local checkpoints: ``xxh3_64`` (CPU) and ``pmix64`` (computed where the
tensor lives): the same value for the same bytes from every implementation (plain Python, torch
ops, the Triton kernel under Triton's interpreter, CUDA when present), every dtype and
non-contiguous inputs; single-bit flips, word swaps and truncation change it; records of both
versions verify."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.integrity.checksum import device as dh
from megatron.integrity.checksum import tensor as ck

ALGORITHMS = ("xxh3_64", "pmix64")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
_REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)


def _random(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    es = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 8 * dh.CHUNK_WORDS + 3])
def test_pmix64_torch_equals_the_definition(n):
    data = _random(torch.uint8, (n,), seed=n)
    assert dh.pmix64(data, "torch") == dh.pmix64_reference(_bytes(data))


def test_pmix64_misaligned_and_chunk_boundaries():
    """Storage not 8-byte aligned (a view at a byte offset) and tensors spanning several chunks."""
    base = _random(torch.uint8, (3 * 8 * dh.CHUNK_WORDS + 40,), seed=5)
    for off, length in ((3, 8 * dh.CHUNK_WORDS + 5), (8, 2 * 8 * dh.CHUNK_WORDS), (1, 17)):
        view = base[off : off + length]
        assert dh.pmix64(view, "torch") == dh.pmix64_reference(_bytes(view)), (off, length)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_non_contiguous(dtype):
    t = _random(dtype, (6, 10), seed=1)
    views = {
        "contiguous": t,
        "strided": t[:, ::3],
        "transposed": t.t(),
        "offset": t.reshape(-1)[3:41],
        "0-d": t[2, 3],
        "empty": t[:0],
    }
    for name, v in views.items():
        want = dh.pmix64_reference(_bytes(v))
        assert dh.pmix64(v, "torch") == want, name
        assert ck.tensor_checksum(v, "pmix64") == want, name
        assert int(ck.tensor_checksum_on_device(v)) & ((1 << 64) - 1) == want, name
        assert ck.tensor_checksum(v, "xxh3_64") == ck.checksum_bytes(_bytes(v)), name


_TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron.integrity.checksum import device as dh
    assert dh.triton_available()
    cases = []
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3 * 8 * dh.BLOCK_WORDS + 21,), dtype=torch.uint8, generator=g)
    for n in (0, 1, 7, 8, 9, 100, 8 * dh.BLOCK_WORDS, 8 * dh.BLOCK_WORDS + 1, """
    """3 * 8 * dh.BLOCK_WORDS + 21):
        cases.append(raw[:n])
    cases.append(raw[3:3 + 8 * dh.BLOCK_WORDS + 9])          # storage not 8-byte aligned
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn, torch.bool):
        t = raw[:8 * 120].view(torch.uint8)
        t = (t % 2).view(torch.bool) if dt == torch.bool else t.view(dt)
        cases += [t, t.reshape(8, -1)[:, ::2]]              # contiguous and non-contiguous
    for i, t in enumerate(cases):
        a, b = dh.pmix64(t, "triton"), dh.pmix64(t, "torch")
        assert a == b, (i, a, b)
    print("TRITON_OK", len(cases))
    """
)


def test_triton_kernel_equals_torch_ops_in_the_interpreter():
    """The GPU kernel, run by Triton's interpreter on CPU tensors, gives the torch implementation's
    value bit for bit (aligned, unaligned, tails, several blocks, dtypes, non-contiguous)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=_REPO)
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and "TRITON_OK" in out.stdout, (
        out.stdout[-2000:] + out.stderr[-3000:]
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_equals_cpu(dtype):
    t = _random(dtype, (257, 33), seed=2)
    for name, v in {"contiguous": t, "strided": t[:, ::2], "offset": t.reshape(-1)[5:]}.items():
        want = dh.pmix64(v, "torch")
        cuda = v.cuda()
        assert dh.pmix64(cuda) == want, name  # Triton kernel
        assert dh.pmix64(cuda, "torch") == want, name  # torch ops on the GPU
        assert ck.tensor_checksum(cuda, "xxh3_64") == ck.tensor_checksum(v, "xxh3_64"), name


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_single_bit_flip_changes_the_checksum(algorithm):
    """1 MiB of random bytes; 256 sampled bit positions (fixed seed) plus the first and last bit:
    each flip changes the checksum. (For pmix64 it is guaranteed: the mix is a bijection.)"""
    data = _random(torch.uint8, (1 << 20,), seed=3).clone()
    base = ck.tensor_checksum(data, algorithm)
    g = torch.Generator().manual_seed(4)
    bits = [0, 8 * data.numel() - 1] + torch.randint(
        0, 8 * data.numel(), (256,), generator=g
    ).tolist()
    for bit in bits:
        data[bit // 8] ^= 1 << (bit % 8)
        assert ck.tensor_checksum(data, algorithm) != base, bit
        data[bit // 8] ^= 1 << (bit % 8)
    assert ck.tensor_checksum(data, algorithm) == base


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_word_swaps_truncation_and_padding_change_the_checksum(algorithm):
    words = _random(torch.int64, (1 << 14,), seed=6).clone()
    base = ck.tensor_checksum(words, algorithm)
    g = torch.Generator().manual_seed(7)
    for i, j in [(0, 1), (0, words.numel() - 1)] + torch.randint(
        0, words.numel(), (32, 2), generator=g
    ).tolist():
        if words[i] == words[j]:
            continue
        swapped = words.clone()
        swapped[i], swapped[j] = words[j], words[i]
        assert ck.tensor_checksum(swapped, algorithm) != base, (i, j)
    u8 = words.view(torch.uint8)
    assert ck.tensor_checksum(u8[:-1], algorithm) != ck.tensor_checksum(u8, algorithm)
    zeros = torch.zeros(16, dtype=torch.uint8)
    assert ck.tensor_checksum(zeros[:15], algorithm) != ck.tensor_checksum(zeros, algorithm)


def test_deterministic_across_processes():
    """The same value in another process (no per-process seed)."""
    t = _random(torch.float32, (1000,), seed=8)
    here = (ck.tensor_checksum(t, "pmix64"), ck.tensor_checksum(t, "xxh3_64"))
    code = (
        "import torch; from megatron.integrity.checksum import tensor as ck; "
        "g = torch.Generator().manual_seed(8); "
        "t = torch.randint(0, 256, (4000,), dtype=torch.uint8, generator=g).view(torch.float32); "
        "print(ck.tensor_checksum(t, 'pmix64'), ck.tensor_checksum(t, 'xxh3_64'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=_REPO),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.stdout.split() == [str(v) for v in here], out.stderr[-2000:]


class _SD:
    """Stands in for a TensorAwareStateDict holding a checksum record."""

    def __init__(self, tensors, record=None):
        self.tensors = tensors
        if record is not None:
            setattr(self, ck.CHECKSUM_ATTR, record)


def test_records_of_both_versions_verify():
    """A version-1 record exactly as files written before device checksums hold it (xxh3_64)
    still verifies; a version-2 record names pmix64 and verifies; a flipped byte fails both; a
    version-1 record naming another algorithm, or an unknown algorithm, is refused."""
    tensors = [_random(torch.bfloat16, (4, 5), seed=9), _random(torch.float32, (7,), seed=10)]
    v1 = {
        "format": "megatron.integrity.tensor_checksums",
        "version": 1,
        "algorithm": "xxh3_64",
        "owner_rank": 1,
        "entries": [
            {
                "index": i,
                "key": f"k{i}",
                "global_offset": None,
                "dtype": ck.dtype_name(t.dtype),
                "shape": list(t.shape),
                "nbytes": t.nbytes,
                "checksum": ck.checksum_bytes(_bytes(t)),
            }
            for i, t in enumerate(tensors)
        ],
    }
    assert (
        ck.make_record(1, v1["entries"]) == v1
    )  # what make_record writes for xxh3_64 is unchanged
    v2 = ck.make_record(
        1,
        [ck.make_entry(i, f"k{i}", t, algorithm="pmix64") for i, t in enumerate(tensors)],
        "pmix64",
    )
    assert (v2["version"], v2["algorithm"]) == (2, "pmix64")
    assert [e["checksum"] for e in v2["entries"]] == [
        dh.pmix64_reference(_bytes(t)) for t in tensors
    ]
    for record in (v1, v2):
        got = ck.get_record(_SD(tensors, record))
        assert all(e["algorithm"] == record["algorithm"] for e in got["entries"])
        assert "algorithm" not in record["entries"][0]  # the stored record is not changed
        assert ck.verify_record(got, tensors) == []
        assert ck.verify_record(record, tensors) == []
        bad = [tensors[0], tensors[1].clone()]
        bad[1].view(torch.uint8)[3] ^= 0x10
        mismatches = ck.verify_record(got, bad)
        assert [m.key for m in mismatches] == ["k1"] and mismatches[0].detail == "checksum mismatch"
    with pytest.raises(ValueError, match="version 1 with algorithm 'pmix64'"):
        ck.get_record(_SD(tensors, dict(v2, version=1)))
    with pytest.raises(ValueError, match="unrecognised checksum record"):
        ck.get_record(_SD(tensors, dict(v2, algorithm="crc32")))
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        ck.tensor_checksum(tensors[0], "crc32")
