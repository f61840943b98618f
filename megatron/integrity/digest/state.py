"""State digests: one 64-bit value per tensor of the training state, independent of how the
tensor is sharded (TP, PP, EP, DP, the distributed optimizer's flat buffers).

A tensor's digest is a sum over its elements of a term that depends on the element's bits and its
*global* flat index, so every rank adds up the elements it holds as the main replica, and the
partial sums of all ranks add up (modulo 2**64) to the same value whatever the topology. Definition
(version 1), with ``mix`` and the constants of :mod:`megatron.integrity.mix64`::

    v[g]    = the bits of the element at global row-major index g, zero-extended to 64 bits
    S       = sum over g of mix(v[g] + (g + 1) * K_POS)
    digest  = mix(S ^ (N * K_LEN + K_FIN))            N: the tensor's global number of elements

``mix`` is a bijection, so a change of any single element (any bit flip) changes ``S``; a swap of
two elements changes it unless ``mix`` collides (probability 2**-64). All arithmetic is int64 torch
ops that wrap identically on CPU and CUDA. The record a save writes (``state_digest.json``) is
:mod:`megatron.integrity.digest.record`. Design notes: ``docs/resume-proof.md``.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional, Sequence, Tuple

import torch

from megatron.integrity.mix64 import K_FIN, K_LEN, K_POS, mix_, mix_int, signed

__all__ = [
    "ALGORITHM",
    "KERNELS",
    "VERSION",
    "block_sum",
    "finish",
    "range_sum",
    "tensor_digest",
    "warm_up",
]

ALGORITHM = "pmix64-element"
VERSION = 1
_MASK = (1 << 64) - 1
#: Elements per chunk: 1 Mi int64 temporaries (8 MiB each) bound the extra memory.
CHUNK = 1 << 20
_WIDTH_MASK = {4: 0xFFFFFFFF, 2: 0xFFFF, 1: 0xFF}
#: Use the numba kernel on CPU when numba is installed (tests turn it off to compare).
_USE_NUMBA = True
#: The implementations :func:`range_sum` chooses from (its ``kernel`` argument), all giving the
#: same values: ``"auto"`` (on CPU, numba's form for this host when numba is installed, else torch
#: ops), ``"torch"`` (torch integer ops), ``"scalar"`` and ``"vector"`` (numba's two compiled forms,
#: :mod:`megatron.integrity.digest.kernel`). The numba forms apply to CPU values; values on another
#: device are always summed with torch ops.
KERNELS = ("auto", "torch", "scalar", "vector")
_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """The elements of 1-D ``flat`` as zero-extended int64 bit patterns (a new tensor)."""
    size = flat.element_size()
    if flat.is_complex() or size not in _VIEW:
        raise TypeError(f"state digest: dtype {flat.dtype} is not supported")
    v = flat.view(_VIEW[size])
    if size == 8:
        return v.clone()
    return v.to(torch.int64).bitwise_and_(_WIDTH_MASK[size])


@functools.lru_cache(maxsize=8)
def _arange_k(device: torch.device, n: int) -> torch.Tensor:
    """``i * K_POS`` for ``i < n`` (int64, wrapped), cached per device."""
    return torch.arange(n, dtype=torch.int64, device=device).mul_(signed(K_POS))


def _strides(shape: Sequence[int]) -> Tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _term_sum(values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Sum of ``mix(bits(values) + pos)``: 0-d int64 on the values' device."""
    z = _bits(values).add_(pos)
    return mix_(z, torch.empty_like(z)).sum()


def _runs(local_shape: Sequence[int], global_shape: Sequence[int]) -> Tuple[int, int]:
    """``(d, run)``: a block's elements run contiguously in global index over ``run`` elements
    (its trailing dims that span the global ones, and the next dim's local extent), and the
    outer dims ``0 .. d-1`` index those runs (``d == 0``: the block is one contiguous range)."""
    d, run = len(local_shape), 1
    while d > 0 and local_shape[d - 1] == global_shape[d - 1]:
        run *= local_shape[d - 1]
        d -= 1
    if d > 0:
        run *= local_shape[d - 1]
        d -= 1
    return d, run


def _segments(
    start: int,
    stop: int,
    local_shape: Sequence[int],
    global_offset: Sequence[int],
    global_shape: Sequence[int],
) -> Tuple[Any, Any]:
    """The flat range ``start:stop`` of a block as runs of consecutive global indices.

    Returns:
        (global index of each run's first element, run lengths): int64 arrays (numpy).
    """
    import numpy as np

    gstr = _strides(global_shape)
    base = sum(o * s for o, s in zip(global_offset, gstr))
    d, run = _runs(local_shape, global_shape)
    if d == 0 or stop <= start:
        return np.array([base + start], dtype=np.int64), np.array([stop - start], dtype=np.int64)
    outer = list(local_shape[:d])
    lstr = _strides(outer)
    r = np.arange(start // run, (stop - 1) // run + 1, dtype=np.int64)
    g = np.full_like(r, base)
    for j in range(d):
        g += (r // lstr[j] % outer[j]) * gstr[j]
    lens = np.full_like(r, run)
    head = start - r[0] * run  # elements of the first run before `start`
    g[0] += head
    lens[0] -= head
    lens[-1] -= (r[-1] + 1) * run - stop
    return g, lens


@functools.lru_cache(maxsize=1)
def _kernel_module():
    """:mod:`megatron.integrity.digest.kernel`, or None without numba."""
    try:
        from megatron.integrity.digest import kernel as numba_kernel
    except ImportError:
        return None
    return numba_kernel


@functools.lru_cache(maxsize=1)
def _numba_kernel():
    """The fused CPU loop's form for this host (:mod:`megatron.integrity.digest.kernel`), or None
    without numba (the torch implementation gives the same values)."""
    module = _kernel_module()
    return None if module is None else module.kernel()


def _cpu_kernel(kernel: str):
    """The numba function that sums CPU values for ``kernel`` (one of :data:`KERNELS`), or None
    for torch ops.

    Raises:
        ValueError: ``"scalar"`` or ``"vector"`` without numba.
    """
    if kernel == "auto":
        return _numba_kernel() if _USE_NUMBA else None
    if kernel == "torch":
        return None
    module = _kernel_module()
    if module is None:
        raise ValueError(f"state digest: kernel {kernel!r} needs numba")
    return module.segments_sum if kernel == "scalar" else module.segments_sum_vector


_UNSIGNED = {8: "uint64", 4: "uint32", 2: "uint16", 1: "uint8"}


def warm_up() -> None:
    """Import and compile the CPU kernel for every element width (a no-op without numba): a
    process that forks workers calls it once, so they do not each compile it."""
    import numpy as np

    kernel = _numba_kernel()
    if kernel is None:
        return
    one = np.zeros(1, dtype=np.int64)
    for dtype in _UNSIGNED.values():
        kernel(np.zeros(1, dtype=dtype), one, one + 1)


@functools.lru_cache(maxsize=1 << 14)
def _check(
    start: int,
    stop: int,
    local_shape: Tuple[int, ...],
    global_offset: Tuple[int, ...],
    global_shape: Tuple[int, ...],
) -> None:
    """Raise ValueError unless the block and the range fit (cached: a run digests the same places
    at every save; a failure raises, so it is not cached)."""
    if len(local_shape) != len(global_shape) or len(global_offset) != len(global_shape):
        raise ValueError(
            f"state digest: block shape {tuple(local_shape)} at {tuple(global_offset)} "
            f"does not match global shape {tuple(global_shape)}"
        )
    for ls, off, gs in zip(local_shape, global_offset, global_shape):
        if off < 0 or off + ls > gs:
            raise ValueError(
                f"state digest: block {tuple(local_shape)} at {tuple(global_offset)} "
                f"exceeds global shape {tuple(global_shape)}"
            )
    n_local = 1
    for s in local_shape:
        n_local *= s
    if not 0 <= start <= stop <= n_local:
        raise ValueError(f"state digest: range {start}:{stop} outside a block of {n_local}")


@functools.lru_cache(maxsize=1 << 12)
def _cached_segments(
    start: int,
    stop: int,
    local_shape: Tuple[int, ...],
    global_offset: Tuple[int, ...],
    global_shape: Tuple[int, ...],
) -> Tuple[Any, Any]:
    """:func:`_segments`, cached: the arrays are shared, never to be modified (writable, so the
    kernel compiled by :func:`warm_up` takes them)."""
    return _segments(start, stop, local_shape, global_offset, global_shape)


def range_sum(
    local: torch.Tensor,
    start: int,
    stop: int,
    local_shape: Sequence[int],
    global_offset: Sequence[int],
    global_shape: Sequence[int],
    values: Optional[torch.Tensor] = None,
    kernel: str = "auto",
) -> int:
    """Partial digest sum of elements ``start:stop`` (row-major, flat) of a local block.

    The block has shape ``local_shape`` and sits at ``global_offset`` in a tensor of shape
    ``global_shape`` (same rank as ``local_shape``; prepended axes of extent 1 included).

    Args:
        local: the block (its elements ``start:stop`` are digested unless ``values`` is given).
        start, stop: flat range within the block (``0 <= start <= stop <= prod(local_shape)``).
        local_shape, global_offset, global_shape: the block's place (elements).
        values: a 1-D tensor of ``stop - start`` elements to digest instead of
            ``local.reshape(-1)[start:stop]`` (the distributed optimizer keeps a flat range of a
            parameter's state).
        kernel: the implementation, one of :data:`KERNELS` (all give the same value; a benchmark
            compares them).

    Returns:
        int in ``[0, 2**64)``: add the partial sums of every block of the tensor (modulo 2**64),
        then :func:`finish`.

    Raises:
        ValueError: shapes or ranges that do not fit in ``global_shape``; ``kernel`` unknown, or
            a numba form asked for CPU values without numba.
        TypeError: a dtype that is not 1, 2, 4 or 8 bytes wide, or complex.
    """
    if kernel not in KERNELS:
        raise ValueError(f"state digest: unknown kernel {kernel!r} ({', '.join(KERNELS)})")
    local_shape, global_offset, global_shape = (
        tuple(local_shape),
        tuple(global_offset),
        tuple(global_shape),
    )
    _check(start, stop, local_shape, global_offset, global_shape)
    flat = _range_values(local, start, stop, values)
    fused = _cpu_kernel(kernel) if flat.device.type == "cpu" else None
    if fused is not None and flat.numel():
        if flat.is_complex() or flat.element_size() not in _VIEW:
            raise TypeError(f"state digest: dtype {flat.dtype} is not supported")
        size = flat.element_size()
        vals = flat.view(_VIEW[size]).numpy().view(_UNSIGNED[size])
        starts, lens = _cached_segments(start, stop, local_shape, global_offset, global_shape)
        return int(fused(vals, starts, lens)) & _MASK
    gstr = _strides(global_shape)
    base = sum(o * s for o, s in zip(global_offset, gstr))
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    d, run = _runs(local_shape, global_shape)
    if d == 0:  # the whole block is one contiguous global range
        _add_contiguous(total, flat, base + start)
    else:
        _add_runs(total, flat, start, stop, local_shape[:d], gstr, base, run)
    return int(total) & _MASK


def _range_values(
    local: torch.Tensor, start: int, stop: int, values: Optional[torch.Tensor]
) -> torch.Tensor:
    """The ``stop - start`` values :func:`range_sum` digests: ``values`` or elements
    ``start:stop`` of ``local``, detached, 1-D and contiguous.

    Raises:
        ValueError: ``values`` does not hold ``stop - start`` elements.
    """
    flat = (local.detach().reshape(-1)[start:stop] if values is None else values.detach()).reshape(
        -1
    )
    if flat.numel() != stop - start:
        raise ValueError(f"state digest: {flat.numel()} values for range {start}:{stop}")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat


def _add_contiguous(total: torch.Tensor, flat: torch.Tensor, first: int) -> None:
    """Add to ``total`` (0-d int64) the terms of ``flat``, whose elements have the consecutive
    global indices ``first, first + 1, ...`` (torch ops, :data:`CHUNK` elements at a time)."""
    device = flat.device
    n = flat.numel()
    for c0 in range(0, n, CHUNK):
        m = min(CHUNK, n - c0)
        pos = _arange_k(device, CHUNK)[:m] + signed((first + c0 + 1) * K_POS)
        total.add_(_term_sum(flat[c0 : c0 + m], pos))


def _add_runs(
    total: torch.Tensor,
    flat: torch.Tensor,
    start: int,
    stop: int,
    outer_shape: Tuple[int, ...],
    gstr: Tuple[int, ...],
    base: int,
    run: int,
) -> None:
    """Add to ``total`` (0-d int64) the terms of ``flat``, elements ``start:stop`` of a block
    whose elements run contiguously in global index over ``run`` elements (:func:`_runs`).

    The run index ``r`` (over the block's ``outer_shape``, its dims before the runs) maps to a
    global start through the global strides ``gstr`` from ``base`` (the global index of the
    block's first element). Torch ops; groups of runs of at most :data:`CHUNK` elements, or one
    run longer than that chunk by chunk."""
    device = flat.device
    d = len(outer_shape)
    lstr_outer = _strides(outer_shape)
    in_run = _arange_k(device, run) if run <= CHUNK else None
    rows = max(1, CHUNK // run)
    first_run, last_run = start // run, (stop - 1) // run if stop > start else start // run
    for r0 in range(first_run, last_run + 1, rows):
        r1 = min(r0 + rows, last_run + 1)
        r = torch.arange(r0, r1, dtype=torch.int64, device=device)
        gstart = torch.full_like(r, base)
        for j in range(d):
            gstart.add_((r // lstr_outer[j] % outer_shape[j]) * gstr[j])
        lo = max(start, r0 * run) - r0 * run  # offsets within this group of runs
        hi = min(stop, r1 * run) - r0 * run
        v0 = r0 * run + lo - start
        if in_run is not None:
            pos = (gstart.add_(1).mul_(signed(K_POS))[:, None] + in_run[None, :]).reshape(-1)
            total.add_(_term_sum(flat[v0 : v0 + (hi - lo)], pos[lo:hi]))
        else:  # one run longer than a chunk: contiguous within it
            _add_contiguous(total, flat[v0 : v0 + (hi - lo)], int(gstart[0]) + lo)


def block_sum(
    local: torch.Tensor,
    global_offset: Sequence[int] = (),
    global_shape: Optional[Sequence[int]] = None,
    kernel: str = "auto",
) -> int:
    """Partial digest sum of a whole local block (see :func:`range_sum`).

    Args:
        local: the block, any dtype of 1, 2, 4 or 8 bytes, any device.
        global_offset: its offset in the global tensor (default: zeros).
        global_shape: the global tensor's shape (default: ``local``'s, a tensor held whole).
            Leading dims of ``global_shape`` beyond ``local.dim()`` are prepended axes of
            extent 1 (stacked layers).
        kernel: the implementation, one of :data:`KERNELS` (see :func:`range_sum`).
    """
    gshape = tuple(local.shape) if global_shape is None else tuple(global_shape)
    lshape = (1,) * (len(gshape) - local.dim()) + tuple(local.shape)
    offset = tuple(global_offset) if global_offset else (0,) * len(gshape)
    n = local.numel()
    return range_sum(local, 0, n, lshape, offset, gshape, kernel=kernel)


def finish(partial_sums: Iterable[int], global_numel: int) -> int:
    """The digest of a tensor from the partial sums of all its blocks.

    Returns:
        int in ``[0, 2**64)``.
    """
    s = 0
    for p in partial_sums:
        s = (s + p) & _MASK
    return mix_int(s ^ ((global_numel * K_LEN + K_FIN) & _MASK))


def tensor_digest(t: torch.Tensor) -> int:
    """Digest of a tensor held whole (one process, e.g. read from a checkpoint's files)."""
    return finish([block_sum(t)], t.numel())
