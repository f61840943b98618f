"""Per-tensor checksums of local (non-persistent) checkpoints: definition, storage format, checks.

Upstream megatron-core writes a per-file SHA-256 manifest for ``torch_dist`` checkpoints
(``dist_checkpointing/validation.py``: ``save_integrity_manifest``); nothing equivalent exists for
the local tier written by NVRx's ``LocalCheckpointManager``. This module defines the per-tensor
checksums that :mod:`megatron.fixes.replication` computes on the rank that owns a shard, carries
with the shard's metadata to every replica, verifies before any file is written, stores in every
local checkpoint file (primary and replica) and verifies again when a file is loaded.

Design notes: ``docs/checksums.md``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from megatron.integrity.checksum import device as device_checksum
from megatron.integrity.tensors import is_quantized
from megatron.overlay.errors import OverlayError

try:
    import xxhash
except ImportError as e:  # pragma: no cover - declared dependency
    raise ImportError(
        "megatron.integrity needs the 'xxhash' package (pip install 'xxhash>=3.4')"
    ) from e

__all__ = [
    "ALGORITHM",
    "ALGORITHMS",
    "CHECKSUM_ATTR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ChecksumMismatchError",
    "Mismatch",
    "attach_record",
    "checksum_bytes",
    "dtype_name",
    "get_record",
    "make_entry",
    "make_record",
    "tensor_byte_view",
    "tensor_checksum",
    "streaming_checksum",
    "tensor_checksum_on_device",
    "to_checksums",
    "verify_record",
    "verify_tensor",
]

ALGORITHM = "xxh3_64"
"""The default (CPU) checksum algorithm; version-1 records name only this one."""
ALGORITHMS = (ALGORITHM, device_checksum.ALGORITHM)
"""Every algorithm a record may name (version 2)."""

FORMAT_NAME = "megatron.integrity.tensor_checksums"
FORMAT_VERSION = 1
FORMAT_VERSIONS = (1, 2)
CHECKSUM_ATTR = "_megatron_integrity"
"""Attribute of a ``TensorAwareStateDict`` that holds its checksum record."""


class ChecksumMismatchError(OverlayError, RuntimeError):
    """A tensor's bytes do not match the checksum computed by the rank that owns it.

    Raised (on every rank of the replication group) when a replica received during a save, or a
    local checkpoint read back from disk or from a peer, differs from what the owner checksummed.
    ``mismatches`` holds the individual :class:`Mismatch` records.
    """

    def __init__(self, message: str, mismatches: Sequence["Mismatch"] = ()):
        super().__init__(message)
        self.mismatches = tuple(mismatches)


@dataclass(frozen=True)
class Mismatch:
    """One tensor that failed verification.

    Attributes:
        key: the tensor's key (``ShardedTensor.key`` or ``tensor[i]``).
        index: position in the state dict's ``tensors``.
        expected: checksum stored by the owner (``None`` if the entry is missing).
        actual: checksum of the bytes at hand (``None`` if the tensor is missing).
        detail: why it failed (checksum, dtype, shape or count mismatch).
    """

    key: str
    index: int
    expected: Optional[int]
    actual: Optional[int]
    detail: str

    def __str__(self) -> str:
        exp = "-" if self.expected is None else f"{self.expected:#018x}"
        act = "-" if self.actual is None else f"{self.actual:#018x}"
        return f"'{self.key}' (tensor #{self.index}): {self.detail} (expected {exp}, got {act})"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form stored in records)."""
    return str(dtype).removeprefix("torch.")


def tensor_byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat ``torch.uint8`` view (no copy) of a dense tensor's bytes, on the tensor's device.

    Args:
        t: a plain (not wrapper-subclass), strided, C-contiguous tensor of any dtype and shape,
            including 0-d and empty tensors.

    Returns:
        1-D ``uint8`` tensor of ``t.nbytes`` elements sharing memory with ``t``.

    Raises:
        ValueError: ``t`` is not contiguous or not strided.
    """
    if t.layout is not torch.strided:
        raise ValueError(f"tensor_byte_view needs a strided tensor, got layout {t.layout}")
    if not t.is_contiguous():
        raise ValueError("tensor_byte_view needs a contiguous tensor; call .contiguous() first")
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def checksum_bytes(data: Any) -> int:
    """XXH3_64 (seed 0) of a bytes-like object (``bytes``, ``memoryview``, C-contiguous numpy
    array).

    Returns:
        int in ``[0, 2**64)``.
    """
    return xxhash.xxh3_64_intdigest(data)


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})"
        )


def _check_plain(t: torch.Tensor, what: str) -> None:
    if is_quantized(t):
        raise TypeError(
            f"{what} got a quantized tensor ({type(t).__name__}); hash its dequantize()"
        )
    if t.device.type == "meta":
        raise ValueError(f"{what}: a meta tensor has no data")
    if t.layout is not torch.strided:
        raise ValueError(f"{what} needs a strided tensor, got layout {t.layout}")


def tensor_checksum(t: torch.Tensor, algorithm: str = ALGORITHM) -> int:
    """Checksum of a tensor's logical bytes; see the module docstring.

    Args:
        t: a plain tensor of any dtype, shape and device. Non-contiguous tensors are hashed in
            row-major element order (a contiguous copy is made).
        algorithm: ``"xxh3_64"`` (tensors not on the CPU are copied to the CPU first; the hash
            runs without holding the GIL) or ``"pmix64"`` (hashed where the tensor lives; a CPU
            tensor is hashed on the current CUDA device when one is present, since the CPU
            implementation runs at about 0.7 GB/s per thread).

    Returns:
        int in ``[0, 2**64)``.

    Raises:
        TypeError: ``t`` is a tensor subclass with its own ``dequantize`` (a quantized tensor):
            hash ``t.dequantize()`` instead, which is what checkpoints store.
        ValueError: ``t`` is not strided (sparse, ...) or is on the ``meta`` device, or
            ``algorithm`` is unknown.
    """
    _check_plain(t, "tensor_checksum")
    t = t.detach()
    if algorithm == device_checksum.ALGORITHM:
        if t.is_cpu and torch.cuda.is_available():
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        return device_checksum.pmix64(t)
    _check_algorithm(algorithm)
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return xxhash.xxh3_64_intdigest(b"")
    # the tensor's own memory as a buffer (no copy, no per-dtype numpy support needed)
    return xxhash.xxh3_64_intdigest((ctypes.c_char * nbytes).from_address(t.data_ptr()))


def streaming_checksum():
    """An ``xxh3_64`` hasher for bytes that arrive in pieces: ``update(buffer)`` with each piece
    in order, then ``intdigest()`` equals :func:`checksum_bytes` of their concatenation (and so
    :func:`tensor_checksum` of the tensor they make up). ``update`` releases the GIL."""
    return xxhash.xxh3_64()


def tensor_checksum_on_device(t: torch.Tensor) -> torch.Tensor:
    """``pmix64`` of a plain tensor, computed on ``t.device`` and left there: a 0-d ``int64``
    tensor (``int(x) % 2**64`` is the checksum), nothing synchronised, no host copy. Many of them
    are read with one copy by :func:`to_checksums`.

    Raises:
        TypeError, ValueError: as :func:`tensor_checksum`.
    """
    _check_plain(t, "tensor_checksum_on_device")
    return device_checksum.pmix64_tensor(t)


def to_checksums(values: Sequence[torch.Tensor]) -> list[int]:
    """Ints in ``[0, 2**64)`` from :func:`tensor_checksum_on_device` results (one device-to-host
    copy of ``8 * len(values)`` bytes)."""
    if not values:
        return []
    return [v & ((1 << 64) - 1) for v in torch.stack(list(values)).cpu().tolist()]


def make_entry(
    index: int,
    key: str,
    t: torch.Tensor,
    checksum: Optional[int] = None,
    global_offset: Optional[Sequence[int]] = None,
    algorithm: str = ALGORITHM,
) -> dict:
    """The record entry of one stored tensor (see the module docstring for the fields).

    Args:
        index: position of the tensor in the state dict's ``tensors``.
        key: its key (``ShardedTensor.key`` or ``tensor[i]``).
        t: the tensor as stored (plain, dequantized); only dtype/shape/nbytes are read unless
            ``checksum`` is ``None``.
        checksum: precomputed :func:`tensor_checksum` of ``t``; computed when ``None``.
        global_offset: ``ShardedTensor.global_offset`` or ``None``.
        algorithm: the record's algorithm (used when ``checksum`` is ``None``).
    """
    return {
        "index": int(index),
        "key": str(key),
        "global_offset": None if global_offset is None else [int(o) for o in global_offset],
        "dtype": dtype_name(t.dtype),
        "shape": [int(s) for s in t.shape],
        "nbytes": int(t.numel() * t.element_size()),
        "checksum": int(tensor_checksum(t, algorithm) if checksum is None else checksum),
    }


def make_record(owner_rank: int, entries: Iterable[Mapping], algorithm: str = ALGORITHM) -> dict:
    """A checksum record (see the module docstring): version 1 for ``xxh3_64``, version 2 for
    another algorithm.

    Args:
        owner_rank: global rank whose shard the record describes.
        entries: from :func:`make_entry`, in ``tensors`` order.
        algorithm: one of :data:`ALGORITHMS`, the algorithm of every entry's checksum.

    Raises:
        ValueError: unknown ``algorithm``.
    """
    _check_algorithm(algorithm)
    return {
        "format": FORMAT_NAME,
        "version": 1 if algorithm == ALGORITHM else 2,
        "algorithm": algorithm,
        "owner_rank": int(owner_rank),
        "entries": [dict(e) for e in entries],
    }


def attach_record(state_dict: Any, record: Optional[Mapping]) -> None:
    """Store ``record`` on a ``TensorAwareStateDict`` (``None`` removes it).

    The record then travels with the object through pickling (``all_gather_object``,
    ``torch.save``).
    """
    if record is None:
        if hasattr(state_dict, CHECKSUM_ATTR):
            delattr(state_dict, CHECKSUM_ATTR)
        return
    setattr(state_dict, CHECKSUM_ATTR, dict(record))


def get_record(state_dict: Any) -> Optional[dict]:
    """The checksum record of a ``TensorAwareStateDict``, or ``None`` if it has none.

    Returns:
        A copy of the record whose entries (copies too) each carry ``"algorithm"``.

    Raises:
        ValueError: the attribute exists but is not a record this version understands (format,
            version 1 or 2, an algorithm of :data:`ALGORITHMS`; version 1 names ``xxh3_64``).
    """
    record = getattr(state_dict, CHECKSUM_ATTR, None)
    if record is None:
        return None
    if (
        not isinstance(record, Mapping)
        or record.get("format") != FORMAT_NAME
        or record.get("algorithm") not in ALGORITHMS
        or not isinstance(record.get("entries"), list)
    ):
        raise ValueError(
            f"unrecognised checksum record on {type(state_dict).__name__}: {record!r:.200}"
        )
    version = record.get("version")
    if version not in FORMAT_VERSIONS or (version == 1 and record["algorithm"] != ALGORITHM):
        raise ValueError(
            f"checksum record version {version} with algorithm {record.get('algorithm')!r} is not "
            f"supported (this code reads version 1 with {ALGORITHM}, version 2 with "
            f"{', '.join(ALGORITHMS)})"
        )
    out = dict(record)
    out["entries"] = [
        dict(e, algorithm=record["algorithm"]) if isinstance(e, Mapping) else e
        for e in record["entries"]
    ]
    return out


def verify_tensor(
    entry: Mapping, t: torch.Tensor, checksum: Optional[int] = None
) -> Optional[Mismatch]:
    """Check one tensor against its record entry.

    Args:
        entry: from :func:`make_entry` or :func:`get_record` (its ``"algorithm"``, default
            ``xxh3_64``, says how to hash ``t``).
        t: the tensor to check (plain, any device).
        checksum: precomputed :func:`tensor_checksum` of ``t`` with the entry's algorithm
            (computed when ``None``).

    Returns:
        ``None`` if dtype, shape and checksum match, else a :class:`Mismatch`.
    """
    key, index = entry["key"], entry["index"]
    if is_quantized(t):
        return Mismatch(
            key,
            index,
            entry["checksum"],
            None,
            f"stored tensor is quantized ({type(t).__name__}), expected a plain tensor",
        )
    if dtype_name(t.dtype) != entry["dtype"] or list(t.shape) != list(entry["shape"]):
        return Mismatch(
            key,
            index,
            entry["checksum"],
            None,
            f"dtype/shape {dtype_name(t.dtype)}{list(t.shape)} differs from the "
            f"owner's {entry['dtype']}{list(entry['shape'])}",
        )
    actual = tensor_checksum(t, entry.get("algorithm", ALGORITHM)) if checksum is None else checksum
    if actual != entry["checksum"]:
        return Mismatch(key, index, entry["checksum"], actual, "checksum mismatch")
    return None


def verify_record(record: Mapping, tensors: Sequence[torch.Tensor]) -> list[Mismatch]:
    """Check every tensor of a state dict against its record.

    Args:
        record: from :func:`get_record`.
        tensors: the state dict's tensors, in ``tensors`` order.

    Returns:
        The mismatches (empty when everything matches), including count mismatches.
    """
    entries = record["entries"]
    out: list[Mismatch] = []
    if len(entries) != len(tensors):
        out.append(
            Mismatch(
                "<state dict>",
                -1,
                None,
                None,
                f"{len(tensors)} tensors, the record lists {len(entries)}",
            )
        )
    default = record.get("algorithm", ALGORITHM)
    for entry, t in zip(entries, tensors):
        m = verify_tensor(entry if "algorithm" in entry else dict(entry, algorithm=default), t)
        if m is not None:
            out.append(m)
    return out
