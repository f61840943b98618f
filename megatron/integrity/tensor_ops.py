"""Tensor primitives of the checks on saved state: bitwise equality (``memcmp``), NaN/Inf counts,
where two tensors differ, deep equality of checkpoint objects, and :func:`fused_scan`, the one pass
over a tensor's bytes (xxh3, ``memcmp``, ``aminmax``) that every local tensor gets, in the offline
verifier (:mod:`megatron.verify`) and in the local tier's load-time checks
(:mod:`megatron.training_ext.local_tier`).

Tensors: plain strided tensors (any device; copied to CPU / made contiguous where needed); no
quantized subclasses (:func:`megatron.integrity.tensors.is_quantized`).
"""

from __future__ import annotations

import ctypes
import io
import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import xxhash

__all__ = [
    "SCAN_BLOCK_BYTES",
    "bytes_equal",
    "count_nonfinite",
    "deep_difference",
    "dense",
    "diff_stats",
    "fused_scan",
]

_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_CHUNK_ELEMS = 1 << 24
SCAN_BLOCK_BYTES = 1 << 20
"""Block size of :func:`fused_scan` (bytes): small enough to stay in a core's L2 cache."""


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU and contiguous (no copy when it already is)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors: same dtype, same shape and identical bytes.

    Args:
        a, b: plain strided tensors (any device; copied to CPU / made contiguous if needed).

    Returns:
        True when ``memcmp`` of their row-major bytes is 0 (``NaN`` payloads compare by bits;
        ``-0.0`` differs from ``0.0``).
    """
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    a, b = dense(a), dense(b)
    n = a.numel() * a.element_size()
    if n == 0:
        return True
    return _memcmp(a.data_ptr(), b.data_ptr(), n) == 0


def _float_view(c: torch.Tensor) -> torch.Tensor:
    if c.is_complex():
        return torch.view_as_real(c)
    return c


def count_nonfinite(t: torch.Tensor) -> Tuple[int, int]:
    """Number of NaN and of +-Inf elements of a tensor.

    Args:
        t: any plain tensor. Integer and bool tensors have none. Complex tensors count their real
            and imaginary parts separately. Dtypes without CPU kernels (``float8_*``) are converted
            to float32 chunk by chunk (``_CHUNK_ELEMS`` elements).

    Returns:
        ``(nan, inf)``. Fast path: ``aminmax`` per chunk (no temporaries); exact counts only for
        chunks whose min or max is not finite.
    """
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return 0, 0
    flat = _float_view(dense(t)).reshape(-1)
    nan = inf = 0
    for s in range(0, flat.numel(), _CHUNK_ELEMS):
        c = flat[s : s + _CHUNK_ELEMS]
        try:
            mn, mx = torch.aminmax(c)
        except (RuntimeError, NotImplementedError):
            c = c.float()
            mn, mx = torch.aminmax(c)
        if math.isfinite(float(mn)) and math.isfinite(float(mx)):
            continue
        nan += int(torch.isnan(c).sum())
        inf += int(torch.isinf(c).sum())
    return nan, inf


def diff_stats(
    a: torch.Tensor, b: torch.Tensor, global_offset: Sequence[int], prepend: int
) -> Dict[str, Any]:
    """Where two same-dtype, same-shape tensors differ: number of differing elements, the first
    differing element's global index, and (floating point) the largest absolute difference among
    differing elements that are finite on both sides."""
    a, b = dense(a), dense(b)
    size = a.element_size()
    fa = a.reshape(-1).view(torch.uint8).view(-1, size) if a.numel() else a.reshape(-1)
    fb = b.reshape(-1).view(torch.uint8).view(-1, size) if b.numel() else b.reshape(-1)
    n_diff, first, max_abs = 0, None, None
    for s in range(0, a.numel(), _CHUNK_ELEMS):
        m = (fa[s : s + _CHUNK_ELEMS] != fb[s : s + _CHUNK_ELEMS]).any(dim=1)
        k = int(m.sum())
        if not k:
            continue
        n_diff += k
        if first is None:
            first = s + int(m.nonzero()[0, 0])
        if a.is_floating_point() or a.is_complex():
            va = a.reshape(-1)[s : s + _CHUNK_ELEMS][m]
            vb = b.reshape(-1)[s : s + _CHUNK_ELEMS][m]
            wide = torch.complex128 if a.is_complex() else torch.float64
            try:
                va, vb = va.to(wide), vb.to(wide)
            except (RuntimeError, TypeError):  # dtypes without a direct cast
                va, vb = va.float().to(wide), vb.float().to(wide)
            fin = torch.isfinite(va) & torch.isfinite(vb)
            if bool(fin.any()):
                d = float((va[fin] - vb[fin]).abs().max())
                max_abs = d if max_abs is None else max(max_abs, d)
    out: Dict[str, Any] = {"differing_elements": n_diff, "elements": a.numel()}
    if first is not None:
        local = []
        rem = first
        for dim in reversed(a.shape):
            local.append(rem % dim)
            rem //= dim
        local.reverse()
        gidx = list(global_offset[:prepend]) + [
            int(o) + int(i) for o, i in zip(global_offset[prepend:], local)
        ]
        out["first_difference_global_index"] = gidx
        out["first_difference_values"] = [
            _scalar(a.reshape(-1)[first]),
            _scalar(b.reshape(-1)[first]),
        ]
    if max_abs is not None:
        out["max_abs_difference"] = max_abs
    return out


def _scalar(x: torch.Tensor) -> Any:
    try:
        v = x.item()
    except (RuntimeError, TypeError):
        v = x.float().item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, complex):
        return str(v)
    return v


def deep_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """First difference between two (nested) checkpoint objects, or ``None`` when they are equal.

    Tensors are compared bitwise (:func:`bytes_equal`), numpy arrays by dtype/shape/bytes,
    ``io.BytesIO`` by content, floats with ``NaN == NaN``, dicts by keys and values, lists/tuples
    element-wise, ``argparse.Namespace`` (and other objects with ``__dict__`` but no ``__eq__``) by
    their attributes, everything else with ``==``.

    Returns:
        A short description naming the path of the first difference (``"['rng_state'][0]: ..."``).
    """
    where = path or "<object>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        return None if bytes_equal(a, b) else f"{where}: tensor bytes differ"
    try:
        import numpy as np

        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
                return f"{where}: ndarray vs other"
            same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
            return None if same else f"{where}: array differs"
    except ImportError:  # pragma: no cover
        pass
    if isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):
        return None if a.getvalue() == b.getvalue() else f"{where}: bytes differ"
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{where}: keys differ ({sorted(map(str, set(a) ^ set(b)))[:5]})"
        for k in a:
            d = deep_difference(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = deep_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float):
        return None if (a == b or (math.isnan(a) and math.isnan(b))) else f"{where}: {a!r} vs {b!r}"
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return deep_difference(vars(a), vars(b), path + ".__dict__")
    try:
        eq = a == b
        if isinstance(eq, bool):
            return None if eq else f"{where}: {a!r:.60} vs {b!r:.60}"
    except Exception:  # noqa: BLE001
        pass
    import pickle

    try:
        return None if pickle.dumps(a) == pickle.dumps(b) else f"{where}: objects differ"
    except Exception:  # noqa: BLE001
        return f"{where}: cannot compare {type(a).__name__}"


def fused_scan(
    t: torch.Tensor,
    ref: Optional[torch.Tensor] = None,
    want_checksum: bool = True,
    check_nonfinite: bool = True,
    block_bytes: int = SCAN_BLOCK_BYTES,
) -> Tuple[Optional[int], Optional[bool], bool]:
    """One pass over a tensor's bytes, block by block (each block stays in cache for all checks):
    xxh3 checksum (streamed; equal to :func:`megatron.integrity.checksum.tensor.tensor_checksum`),
    ``memcmp`` against ``ref`` and a NaN/Inf test (``aminmax`` per block).

    Args:
        t: plain contiguous CPU tensor.
        ref: tensor of the same dtype and shape to compare with, or ``None``.
        want_checksum / check_nonfinite: which checks to run.
        block_bytes: block size in bytes (rounded down to a multiple of the element size).

    Returns:
        ``(checksum or None, equal or None, maybe_nonfinite)``; ``maybe_nonfinite`` is exact
        (True iff some element is NaN or +-Inf); count them with :func:`count_nonfinite`.
    """
    n = t.numel() * t.element_size()
    hasher = xxhash.xxh3_64() if want_checksum else None
    equal: Optional[bool] = None if ref is None else True
    nonfinite = False
    if n == 0:
        return (hasher.intdigest() if hasher else None), equal, False
    es = t.element_size()
    block = max(es, block_bytes - block_bytes % es)
    mv = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if hasher is not None else None
    ptr = t.data_ptr()
    rptr = ref.data_ptr() if ref is not None else 0
    fl = None
    if check_nonfinite and (t.is_floating_point() or t.is_complex()):
        fl = _float_view(t).reshape(-1)
        fes = fl.element_size()
    for s in range(0, n, block):
        m = min(block, n - s)
        if hasher is not None:
            hasher.update(mv[s : s + m])
        if equal and _memcmp(ptr + s, rptr + s, m) != 0:
            equal = False
        if fl is not None and not nonfinite:
            c = fl[s // fes : (s + m) // fes]
            try:
                mn, mx = torch.aminmax(c)
            except (RuntimeError, NotImplementedError):
                mn, mx = torch.aminmax(c.float())
            if not (math.isfinite(float(mn)) and math.isfinite(float(mx))):
                nonfinite = True
    return (hasher.intdigest() if hasher is not None else None), equal, nonfinite
