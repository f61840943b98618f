"""The 64-bit mixing step shared by the device checksum and the resume proof's state digest.

``mix`` is splitmix64's finaliser, a bijection of 64-bit words, all arithmetic modulo 2**64::

    mix(z) = z ^= z >> 30; z *= M1; z ^= z >> 27; z *= M2; z ^ (z >> 31)

and the constants both sums use: a position term ``(i + 1) * K_POS`` added to each word before it
is mixed, and the length term ``n * K_LEN + K_FIN`` mixed into the total. Both
:mod:`megatron.integrity.checksum.device` (``pmix64`` of a tensor's bytes) and
:mod:`megatron.integrity.digest.state` (the digest of a tensor's values by global index) build on
these, so neither of the two imports the other.
"""

from __future__ import annotations

import torch

__all__ = ["K_FIN", "K_LEN", "K_POS", "M1", "M2", "mix_", "mix_int", "signed"]

_MASK = (1 << 64) - 1
#: Position multiplier: word (or element) ``i`` gets ``(i + 1) * K_POS`` added before ``mix``.
K_POS = 0x9E3779B97F4A7C15
#: The two multipliers of ``mix``.
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
#: Length term: the sum is xor-ed with ``n * K_LEN + K_FIN`` before the final ``mix``.
K_LEN = 0xD6E8FEB86659FD93
K_FIN = 0x2545F4914F6CDD1D


def signed(v: int) -> int:
    """``v`` modulo 2**64 as the int64 value with the same bits (for torch int64 arithmetic)."""
    v &= _MASK
    return v - (1 << 64) if v >= 1 << 63 else v


def mix_int(z: int) -> int:
    """The bijective 64-bit ``mix`` of one Python int (``z`` taken modulo 2**64).

    Returns:
        int in ``[0, 2**64)``.
    """
    z &= _MASK
    z ^= z >> 30
    z = (z * M1) & _MASK
    z ^= z >> 27
    z = (z * M2) & _MASK
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, s: int, tmp: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int64 ``z`` into ``tmp``.

    (Torch shifts signed values arithmetically.)
    """
    torch.bitwise_right_shift(z, s, out=tmp)
    return tmp.bitwise_and_((1 << (64 - s)) - 1)


def mix_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`mix_int` of every element of int64 ``z``, in place (``tmp``: scratch of ``z``'s shape,
    dtype and device); returns ``z``."""
    z.bitwise_xor_(_shr(z, 30, tmp))
    z.mul_(signed(M1))
    z.bitwise_xor_(_shr(z, 27, tmp))
    z.mul_(signed(M2))
    return z.bitwise_xor_(_shr(z, 31, tmp))
