"""The state digest's CPU kernel (numba): the sum of ``mix(bits + (g + 1) * K_POS)`` over runs of
consecutive global indices, in one fused loop (about 30x the torch implementation on one core).
Imported only when numba is installed; :mod:`megatron.integrity.state_digest` falls back to torch
ops, which give the same values."""

from __future__ import annotations

import numba
import numpy as np

from megatron.integrity.device_hash import K_POS, M1, M2

_K = np.uint64(K_POS)
_M1 = np.uint64(M1)
_M2 = np.uint64(M2)
_ONE = np.uint64(1)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@numba.njit(cache=True, nogil=True)
def segments_sum(vals, starts, lens):  # pragma: no cover - compiled
    """Sum (mod 2**64) over the elements of ``vals`` (unsigned ints of one width, the runs
    concatenated) of ``mix(vals[i] + (g + 1) * K_POS)``, where run ``k`` covers global indices
    ``starts[k] .. starts[k] + lens[k] - 1``. Returns a ``uint64``."""
    s = np.uint64(0)
    i = 0
    for k in range(starts.shape[0]):
        g = np.uint64(starts[k]) + _ONE
        for _ in range(lens[k]):
            z = np.uint64(vals[i]) + g * _K
            z ^= z >> _S30
            z *= _M1
            z ^= z >> _S27
            z *= _M2
            z ^= z >> _S31
            s += z
            g += _ONE
            i += 1
    return s
