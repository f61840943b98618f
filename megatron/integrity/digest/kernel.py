"""The state digest's CPU kernel (numba): the sum of ``mix(bits + (g + 1) * K_POS)`` over runs of
consecutive global indices, in one fused loop (about 30x the torch implementation on one core).
Imported only when numba is installed; :mod:`megatron.integrity.digest.state` falls back to
torch ops, which give the same values (its ``kernel`` argument chooses among them).

Two compiled forms of the same sum (:func:`kernel` picks one for the host): on CPUs with 64-bit
vector multiplies (AVX-512DQ) LLVM vectorizes the loop over each run's slice,
:func:`segments_sum_vector` (0.27 ns per element on the 2-core Zen 4 test machine against 1.04 for
the scalar form there); without them the vectorized form emulates the multiplies and is slower
than four interleaved scalar sums, :func:`segments_sum` (0.62 against 0.67 ns per element, the
same machine with code for Haswell)."""

from __future__ import annotations

import numba
import numpy as np

from megatron.integrity.mix64 import K_POS, M1, M2

__all__ = ["kernel", "segments_sum", "segments_sum_vector", "vector_multiplies"]

_K = np.uint64(K_POS)
_M1 = np.uint64(M1)
_M2 = np.uint64(M2)
_ONE = np.uint64(1)
_K2 = np.uint64((2 * K_POS) % 2**64)  # Python ints: numpy warns on a wrapping uint64 product
_K3 = np.uint64((3 * K_POS) % 2**64)
_K4 = np.uint64((4 * K_POS) % 2**64)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@numba.njit(cache=True, inline="always")
def _mix(z):  # pragma: no cover - compiled
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


@numba.njit(cache=True, nogil=True)
def segments_sum(vals, starts, lens):  # pragma: no cover - compiled
    """Sum (mod 2**64) over the elements of ``vals`` (unsigned ints of one width, the runs
    concatenated) of ``mix(vals[i] + (g + 1) * K_POS)``, where run ``k`` covers global indices
    ``starts[k] .. starts[k] + lens[k] - 1``. Returns a ``uint64``.

    Four elements per step into four sums: the mixes are independent, so the CPU overlaps their
    multiplies (about 10% faster than one sum here)."""
    s = np.uint64(0)
    off = 0
    for k in range(starts.shape[0]):
        p = (np.uint64(starts[k]) + _ONE) * _K  # (g + 1) * K_POS of the run's first element
        n = lens[k]
        a0 = a1 = a2 = a3 = np.uint64(0)
        j = 0
        while j + 4 <= n:
            a0 += _mix(np.uint64(vals[off + j]) + p)
            a1 += _mix(np.uint64(vals[off + j + 1]) + p + _K)
            a2 += _mix(np.uint64(vals[off + j + 2]) + p + _K2)
            a3 += _mix(np.uint64(vals[off + j + 3]) + p + _K3)
            p += _K4
            j += 4
        while j < n:
            a0 += _mix(np.uint64(vals[off + j]) + p)
            p += _K
            j += 1
        s += a0 + a1 + a2 + a3
        off += n
    return s


@numba.njit(cache=True, nogil=True)
def segments_sum_vector(vals, starts, lens):  # pragma: no cover - compiled
    """:func:`segments_sum` (same arguments, same value) in the form LLVM vectorizes where the CPU
    has 64-bit vector multiplies: each run is a slice (indexed from 0, so no negative-index
    wraparound turns the loads into gathers)."""
    s = np.uint64(0)
    off = 0
    for k in range(starts.shape[0]):
        p = (np.uint64(starts[k]) + _ONE) * _K
        n = lens[k]
        v = vals[off : off + n]
        a0 = a1 = a2 = a3 = np.uint64(0)
        j = 0
        while j + 4 <= n:
            a0 += _mix(np.uint64(v[j]) + p)
            a1 += _mix(np.uint64(v[j + 1]) + p + _K)
            a2 += _mix(np.uint64(v[j + 2]) + p + _K2)
            a3 += _mix(np.uint64(v[j + 3]) + p + _K3)
            p += _K4
            j += 4
        while j < n:
            a0 += _mix(np.uint64(v[j]) + p)
            p += _K
            j += 1
        s += a0 + a1 + a2 + a3
        off += n
    return s


def vector_multiplies() -> bool:
    """Whether numba compiles for a CPU with 64-bit vector multiplies (AVX-512DQ with VL): the
    host's features, or ``NUMBA_CPU_FEATURES`` where it is set."""
    import os

    named = os.environ.get("NUMBA_CPU_FEATURES")
    if named is not None:
        flags = {f[1:]: f[0] == "+" for f in named.split(",") if f[:1] in "+-" and len(f) > 1}
        return bool(flags.get("avx512dq") and flags.get("avx512vl"))
    try:
        import llvmlite.binding as ll

        features = ll.get_host_cpu_features()
    except Exception:  # noqa: BLE001 - unknown host: the scalar form is right everywhere
        return False
    return bool(features.get("avx512dq") and features.get("avx512vl"))


def kernel():
    """The faster form of the sum for this host: :func:`segments_sum_vector` with 64-bit vector
    multiplies, :func:`segments_sum` otherwise (both give the same ``uint64``)."""
    return segments_sum_vector if vector_multiplies() else segments_sum
