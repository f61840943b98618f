"""Checks of one tensor and of the objects of one local file: stored checksum, NaN/Inf, bitwise
equality with the persistent region (with where and how they differ), and main-replica
``ShardedObject`` s against the persistent ones. Findings go to a
:class:`~megatron.verify.findings.Findings`; nothing is raised for a bad tensor."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from megatron.integrity.checksum import tensor as ck
from megatron.integrity.persistent import PersistentCheckpoint
from megatron.integrity.tensor_ops import (
    count_nonfinite,
    deep_difference,
    dense,
    diff_stats,
    fused_scan,
)
from megatron.integrity.tensors import is_quantized
from megatron.verify.discovery import where
from megatron.verify.findings import Findings
from megatron.verify.opened_local import OpenedLocal
from megatron.verify.options import VerifyOptions
from megatron.verify.persistent_checks import read_failure_kind
from megatron.verify.report import Problem

__all__ = ["check_objects", "check_tensor"]


def _entry(op: OpenedLocal, i: int, info: dict, at: str, part: Findings) -> Optional[dict]:
    """Tensor ``i``'s checksum record entry if it describes this tensor (``info``: its problem
    fields), else ``None`` (a mismatching entry is a ``checksum_mismatch`` problem)."""
    if op.entries is None or i >= len(op.entries):
        return None
    entry, key, offset = op.entries[i], info["key"], info["global_offset"]
    if entry.get("key") != key or (
        offset is not None and entry.get("global_offset") not in (None, offset)
    ):
        op.res.checksums_failed += 1
        part.problems.append(
            Problem(
                "checksum_mismatch",
                f"{where(op.lf)}: {at}: checksum record entry #{i} is for "
                f"'{entry.get('key')}' at {entry.get('global_offset')}",
                **info,
            )
        )
        return None
    if entry.get("dtype") != info["dtype"] or list(entry.get("shape", [])) != info["shape"]:
        op.res.checksums_failed += 1
        part.problems.append(
            Problem(
                "checksum_mismatch",
                f"{where(op.lf)}: {at}: stored as {info['dtype']}{info['shape']}, "
                f"the owner checksummed {entry.get('dtype')}{entry.get('shape')}",
                **info,
            )
        )
        return None
    return entry


def check_tensor(
    op: OpenedLocal,
    i: int,
    region: Union[torch.Tensor, str, None],
    part: Findings,
    opts: VerifyOptions,
) -> None:
    """All checks of tensor ``i`` of an opened local file.

    Args:
        region: the persistent region of the tensor (same shape), a message why it could not be
            read (a ``missing_in_persistent`` problem), or ``None`` (no persistent checkpoint).
    """
    key, t, sh = op.items[i]
    offset = [int(o) for o in sh.global_offset] if sh is not None else None
    if not isinstance(t, torch.Tensor) or is_quantized(t):
        _not_a_tensor(op, key, t, offset, part)
        return
    info = _problem_fields(op, key, t, sh, offset)
    at = f"'{key}'" + (f" at {offset}" if offset is not None else "")
    t = dense(t)
    entry = _entry(op, i, info, at, part)
    ref = _reference(op, t, region, info, at, part)

    # the checksum of the bytes is always computed: it verifies the stored one and, for files
    # without a record, is what their copies are compared by
    checksum, equal, maybe_nonfinite = fused_scan(
        t, ref, want_checksum=True, check_nonfinite=opts.check_nonfinite
    )
    if op.print is not None:
        op.print.tensors.append(
            (
                key,
                None if offset is None else tuple(offset),
                info["dtype"],
                tuple(info["shape"]),
                entry["checksum"] if entry is not None else None,
                checksum,
            )
        )
    # 1. stored checksum
    if entry is not None:
        _check_stored_checksum(op, t, entry, checksum, info, at, part)
    # 2. NaN / Inf
    if opts.check_nonfinite:
        op.res.bytes_scanned += info["nbytes"]
        if maybe_nonfinite:
            _nonfinite_problem(op, t, info, at, part)
    # 3. against the persistent checkpoint
    if ref is not None:
        _compare(op, t, ref, equal, info, at, part)


def _not_a_tensor(
    op: OpenedLocal, key: str, t: Any, offset: Optional[list], part: Findings
) -> None:
    """An ``unreadable`` problem for an item that is not a plain tensor (a quantized tensor, any
    other object), recorded in the copy's print without a checksum."""
    part.problems.append(
        Problem(
            "unreadable",
            f"{where(op.lf)}: '{key}' is a {type(t).__name__}, not a plain tensor",
            **op.base,
            key=key,
        )
    )
    if op.print is not None:
        op.print.tensors.append(
            (key, None if offset is None else tuple(offset), type(t).__name__, (), None, None)
        )


def _problem_fields(
    op: OpenedLocal, key: str, t: torch.Tensor, sh: Any, offset: Optional[list]
) -> dict:
    """The :class:`~megatron.verify.report.Problem` fields naming tensor ``t`` (stored as it is:
    shape, dtype name, bytes) of key ``key`` at global ``offset`` (``sh``: its ``ShardedTensor``
    or ``None``)."""
    return dict(
        op.base,
        key=key,
        global_offset=offset,
        prepend_axis_num=int(sh.prepend_axis_num) if sh is not None else 0,
        shape=list(t.shape),
        dtype=ck.dtype_name(t.dtype),
        nbytes=t.numel() * t.element_size(),
    )


def _reference(
    op: OpenedLocal,
    t: torch.Tensor,
    region: Union[torch.Tensor, str, None],
    info: dict,
    at: str,
    part: Findings,
) -> Optional[torch.Tensor]:
    """The persistent region to compare ``t`` with (dense, ``t``'s shape), or ``None``: no
    persistent checkpoint, or a ``dtype_mismatch`` / ``missing_in_persistent`` problem."""
    if isinstance(region, torch.Tensor):
        if region.dtype == t.dtype:
            return dense(region.reshape(t.shape))
        part.problems.append(
            Problem(
                "dtype_mismatch",
                f"{where(op.lf)}: {at}: local dtype {info['dtype']}, persistent "
                f"{ck.dtype_name(region.dtype)}",
                **info,
            )
        )
    elif isinstance(region, str):
        part.problems.append(
            Problem("missing_in_persistent", f"{where(op.lf)}: {at}: {region}", **info)
        )
    return None


def _check_stored_checksum(
    op: OpenedLocal,
    t: torch.Tensor,
    entry: dict,
    checksum: int,
    info: dict,
    at: str,
    part: Findings,
) -> None:
    """Count ``t``'s ``checksum`` (xxh3 of its bytes; recomputed when the record's ``entry`` names
    another algorithm) against the stored one; a ``checksum_mismatch`` problem when they differ."""
    res = op.res
    if entry.get("algorithm", ck.ALGORITHM) != ck.ALGORITHM:  # e.g. pmix64 (hashed on a GPU)
        checksum = ck.tensor_checksum(t, entry["algorithm"])
    if checksum == entry["checksum"]:
        res.checksums_verified += 1
        return
    res.checksums_failed += 1
    part.problems.append(
        Problem(
            "checksum_mismatch",
            f"{where(op.lf)}: {at}: bytes hash to {checksum:#018x}, the "
            f"file's record says {entry['checksum']:#018x}",
            **info,
            details={"expected_checksum": entry["checksum"], "actual_checksum": checksum},
        )
    )


def _nonfinite_problem(
    op: OpenedLocal, t: torch.Tensor, info: dict, at: str, part: Findings
) -> None:
    """Count ``t`` as holding NaN/Inf; a ``nonfinite`` problem with how many of each."""
    nan, inf = count_nonfinite(t)
    op.res.nonfinite_tensors += 1
    part.problems.append(
        Problem(
            "nonfinite",
            f"{where(op.lf)}: {at} ({info['dtype']}"
            f"{info['shape']}) holds {nan} NaN and {inf} Inf of "
            f"{t.numel()} elements",
            **info,
            details={"nan": nan, "inf": inf},
        )
    )


def _compare(
    op: OpenedLocal,
    t: torch.Tensor,
    ref: torch.Tensor,
    equal: Optional[bool],
    info: dict,
    at: str,
    part: Findings,
) -> None:
    """Count the comparison with the persistent region ``ref``; a ``value_mismatch`` problem
    (where and how they differ) unless ``equal``."""
    res = op.res
    res.tensors_compared += 1
    res.bytes_compared += info["nbytes"]
    if equal:
        res.tensors_equal += 1
        return
    res.tensors_mismatched += 1
    stats = diff_stats(t, ref, info["global_offset"], info["prepend_axis_num"])
    pnan, pinf = count_nonfinite(ref)
    stats["persistent_nan"], stats["persistent_inf"] = pnan, pinf
    msg = (
        f"{where(op.lf)}: {at} ({info['dtype']}{info['shape']}) differs from the persistent "
        f"checkpoint in {stats['differing_elements']} of {t.numel()} elements; first at global "
        f"index {stats.get('first_difference_global_index')} (local "
        f"{stats['first_difference_values'][0]}, persistent "
        f"{stats['first_difference_values'][1]})"
    )
    if "max_abs_difference" in stats:
        msg += f", max |difference| {stats['max_abs_difference']:.6g}"
    part.problems.append(Problem("value_mismatch", msg, **info, details=stats))


def _is_main_replica(replica_id: Any) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def check_objects(op: OpenedLocal, part: Findings, pc: PersistentCheckpoint) -> None:
    """Compare the main-replica ``ShardedObject`` s of an opened local file with the persistent
    ones (deep equality, :func:`~megatron.integrity.tensor_ops.deep_difference`); the
    others are counted as skipped."""
    lf, res, base = op.lf, op.res, op.base
    wanted = []
    for o in op.objs:
        if not _is_main_replica(o.replica_id):
            res.objects_skipped += 1
            continue
        wanted.append(o)
    got = pc.read_objects([o.unique_key for o in wanted])
    for o in wanted:
        info = dict(base, key=o.key, global_offset=[int(x) for x in o.global_offset])
        p = got.get(o.unique_key)
        if isinstance(p, KeyError):
            res.objects_skipped += 1
            part.warnings.append(
                Problem(
                    "object_not_compared",
                    f"{where(lf)}: object '{o.unique_key}' is not in the persistent checkpoint",
                    **info,
                )
            )
            continue
        if isinstance(p, BaseException):
            part.problems.append(
                Problem(
                    read_failure_kind(p),
                    f"persistent object '{o.unique_key}' cannot be read: {type(p).__name__}: {p}",
                    **info,
                )
            )
            continue
        # megatron-core's torch_dist strategy stores a ShardedObject as ``torch.save([data, ...])``
        # of the objects with this unique key on the saving rank (one, or identical duplicates)
        if not isinstance(p, list) or not p:
            part.problems.append(
                Problem(
                    "object_mismatch",
                    f"persistent object '{o.unique_key}' "
                    f"is a {type(p).__name__}, expected a non-empty list",
                    **info,
                )
            )
            continue
        p = p[0]
        res.objects_compared += 1
        d = deep_difference(o.data, p)
        if d is None:
            res.objects_equal += 1
        else:
            part.problems.append(
                Problem(
                    "object_mismatch",
                    f"{where(lf)}: object '{o.unique_key}' differs from the persistent one: {d}",
                    **info,
                )
            )
