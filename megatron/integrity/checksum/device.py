"""``pmix64``: a 64-bit checksum computed where a tensor lives (GPU or CPU), bit-identical on both.

Replication over NCCL hashes each replica on the GPU (no host copy); the record it writes is then
verified on a CPU at load or by the verifier. Definition (version 1), over a tensor's logical bytes
``b`` of length ``n`` (as in :mod:`megatron.integrity.checksum.tensor`), all arithmetic modulo
2**64 (``mix`` and the constants: :mod:`megatron.integrity.mix64`)::

    mix(z)  = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
              z ^ (z >> 31)
    w[i]    = the i-th little-endian 64-bit word of b, zero-padded to a multiple of 8 bytes
    S       = sum over i of mix(w[i] + (i + 1) * 0x9E3779B97F4A7C15)
    pmix64  = mix(S ^ (n * 0xD6E8FEB86659FD93 + 0x2545F4914F6CDD1D))

``mix`` (splitmix64's finaliser) is a bijection: a change of one word (any single-bit flip) always
changes ``S``; the position makes a swap or shift change it (probability 1 - 2**-64); ``n`` makes
truncation visible; the sum is order-free, so chunks and GPU blocks reduce in any order.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from megatron.integrity.mix64 import K_FIN, K_LEN, K_POS, mix_, mix_int, signed

__all__ = [
    "ALGORITHM",
    "BLOCK_WORDS",
    "CHUNK_WORDS",
    "VERSION",
    "pmix64",
    "pmix64_reference",
    "pmix64_tensor",
    "triton_available",
]

ALGORITHM = "pmix64"
VERSION = 1
_MASK = (1 << 64) - 1
#: Words per chunk of the torch implementation: 256 KiB of int64, so the ~12 passes of one chunk
#: stay in a core's L2 cache on the CPU.
CHUNK_WORDS = 1 << 15
#: Words per Triton program (GPU block).
BLOCK_WORDS = 4096


def pmix64_reference(data: bytes) -> int:
    """Plain-Python ``pmix64`` of ``data`` (the definition; slow, for tests and small inputs).

    Returns:
        int in ``[0, 2**64)``.
    """
    n = len(data)
    padded = bytes(data) + b"\0" * (-n % 8)
    s = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        s = (s + mix_int(w + (i + 1) * K_POS)) & _MASK
    return mix_int(s ^ ((n * K_LEN + K_FIN) & _MASK))


@functools.lru_cache(maxsize=4)
def _positions(device: torch.device, words: int) -> torch.Tensor:
    """``(i + 1) * K_POS`` for ``i < words`` (int64, wrapped), cached per device."""
    return torch.arange(1, words + 1, dtype=torch.int64, device=device).mul_(signed(K_POS))


def _finish(s: torch.Tensor, n: int) -> torch.Tensor:
    z = s.reshape(1).bitwise_xor(signed(n * K_LEN + K_FIN))
    return mix_(z, torch.empty_like(z)).reshape(())


def _word_sum_torch(u8: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of the mixed words of the flat ``uint8`` tensor ``u8`` (``n`` bytes), as a 0-d int64
    tensor on its device, chunk by chunk with torch integer ops (exact on CPU and CUDA)."""
    words = -(-n // 8)
    chunk = min(CHUNK_WORDS, max(words, 1))
    pos = _positions(u8.device, CHUNK_WORDS)
    z = torch.empty(chunk, dtype=torch.int64, device=u8.device)
    tmp = torch.empty_like(z)
    total = torch.zeros((), dtype=torch.int64, device=u8.device)
    aligned = u8.data_ptr() % 8 == 0
    for w0 in range(0, words, chunk):
        m = min(chunk, words - w0)
        b0, b1 = 8 * w0, min(n, 8 * (w0 + m))
        zc, tc = z[:m], tmp[:m]
        if aligned and b1 - b0 == 8 * m:
            torch.add(u8[b0:b1].view(torch.int64), pos[:m], out=zc)
        else:  # a tail that is not a whole word, or storage not 8-byte aligned: copy the bytes
            zb = zc.view(torch.uint8)
            zb[b1 - b0 :].zero_()
            zb[: b1 - b0].copy_(u8[b0:b1])
            zc.add_(pos[:m])
        if w0:
            zc.add_(signed(w0 * K_POS))
        total.add_(mix_(zc, tc).sum())
    return total


def triton_available() -> bool:
    """True when the Triton kernel can run: Triton importable and CUDA present (or Triton's
    interpreter requested with ``TRITON_INTERPRET=1``, which runs it on CPU tensors)."""
    return _kernel() is not None and (torch.cuda.is_available() or _interpreted())


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton (CPU-only wheels): torch implementation
        return None

    @triton.jit
    def pmix64_blocks(w_ptr, out_ptr, words, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < words
        w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.uint64, bitcast=True)
        z = w + (offs + 1).to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
        z = z ^ (z >> 30)
        z = z * 0xBF58476D1CE4E5B9
        z = z ^ (z >> 27)
        z = z * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        z = tl.where(mask, z, tl.zeros_like(z))
        tl.store(out_ptr + pid, tl.sum(z, axis=0).to(tl.int64, bitcast=True))

    return pmix64_blocks


def _word_sum_triton(u8: torch.Tensor, n: int) -> torch.Tensor:
    """As :func:`_word_sum_torch`, in one kernel pass (a tensor whose bytes are not whole,
    8-byte-aligned words is first copied into a padded buffer on its device)."""
    words = -(-n // 8)
    if u8.data_ptr() % 8 == 0 and n % 8 == 0:
        w = u8.view(torch.int64)
    else:
        w = torch.zeros(words, dtype=torch.int64, device=u8.device)
        w.view(torch.uint8)[:n].copy_(u8)
    blocks = max(1, -(-words // BLOCK_WORDS))
    partial = torch.empty(blocks, dtype=torch.int64, device=u8.device)
    _kernel()[(blocks,)](w, partial, words, BLOCK=BLOCK_WORDS)
    return partial.sum()


def pmix64_tensor(t: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """``pmix64`` of a tensor's logical bytes, computed on ``t.device`` without a host copy.

    Args:
        t: a plain strided tensor of any dtype, shape and device (non-contiguous: hashed in
            row-major order through a contiguous copy on the same device).
        backend: ``"triton"`` (one kernel pass; CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``"torch"`` (torch integer ops, any device), or ``None``: Triton on CUDA when
            available, else torch.

    Returns:
        0-d ``torch.int64`` tensor on ``t.device`` holding the checksum's two's-complement bits
        (``int(x) % 2**64`` is the checksum); nothing is synchronised.

    Raises:
        ValueError: ``backend`` unknown or ``"triton"`` unavailable.
    """
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    n = t.numel() * t.element_size()
    u8 = (
        t.reshape(-1).view(torch.uint8) if n else torch.empty(0, dtype=torch.uint8, device=t.device)
    )
    if backend is None:
        backend = "triton" if t.is_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError(
                "pmix64: the Triton kernel needs Triton and CUDA (or TRITON_INTERPRET=1)"
            )
        s = _word_sum_triton(u8, n) if n else torch.zeros((), dtype=torch.int64, device=t.device)
    elif backend == "torch":
        s = _word_sum_torch(u8, n) if n else torch.zeros((), dtype=torch.int64, device=t.device)
    else:
        raise ValueError(f"pmix64: unknown backend {backend!r} (triton, torch)")
    return _finish(s, n)


def pmix64(t: torch.Tensor, backend: Optional[str] = None) -> int:
    """``pmix64`` of a tensor's logical bytes as an int in ``[0, 2**64)`` (synchronises once to
    read the 8-byte checksum; see :func:`pmix64_tensor`)."""
    return int(pmix64_tensor(t, backend)) & _MASK
