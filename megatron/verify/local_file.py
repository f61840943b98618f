"""One local checkpoint file through the verifier: :func:`open_local` loads it (memory-mapped,
the restricted unpickler of :mod:`megatron.integrity.unpickle`, as training does) and reads its
records (identity, iteration, checksum record); :func:`plan_readahead` queues its byte ranges;
:func:`check_opened` runs every check on it, batch by batch. Problems go to a
:class:`~megatron.verify.findings.Findings`.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import torch

# megatron-core: the classes local checkpoint files unpickle to (imported here so that their
# import time is not part of a verification's wall time)
from megatron.core.dist_checkpointing.dict_utils import nested_values as _nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject as _ShardedObject
from megatron.core.dist_checkpointing.tensor_aware_state_dict import (  # noqa: F401
    MCoreTensorAwareStateDict,
)

from megatron.integrity import unpickle
from megatron.integrity.checksum import tensor as ck
from megatron.integrity.local_identity import get_identity
from megatron.integrity.persistent import PersistentCheckpoint
from megatron.integrity.readahead import ReadAhead
from megatron.integrity.torch_save import tensor_file_ranges
from megatron.verify.discovery import LocalFile, where
from megatron.verify.findings import CopyPrint, Findings
from megatron.verify.opened_local import OpenedLocal  # re-exported
from megatron.verify.options import VerifyOptions
from megatron.verify.report import FileResult, Problem
from megatron.verify.tensor_checks import check_objects, check_tensor

__all__ = ["OpenedLocal", "check_opened", "open_local", "plan_readahead", "region_of"]


def _sharded_parts(sd: Any) -> Tuple[Optional[list], list]:
    """ShardedTensors with data and ShardedObjects of an ``MCoreTensorAwareStateDict`` (``None``
    for state dicts of another type)."""
    if not hasattr(type(sd), "_sharded_tensors") or not hasattr(sd, "sharded_state_dict"):
        return None, []
    tensors = list(sd._sharded_tensors)
    objects = [x for x in _nested_values(sd.sharded_state_dict) if isinstance(x, _ShardedObject)]
    return tensors, objects


def region_of(sh: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(global offset, sizes)`` of a ``ShardedTensor``'s data in its global tensor (elements;
    sizes ``(1,) * prepend_axis_num + local_shape``)."""
    return (
        tuple(int(o) for o in sh.global_offset),
        (1,) * sh.prepend_axis_num + tuple(int(s) for s in sh.local_shape),
    )


def _load(op: OpenedLocal, opts: VerifyOptions, part: Findings) -> bool:
    lf = op.lf
    try:
        try:
            op.sd = unpickle.torch_load(lf.path, map_location="cpu", mmap=opts.mmap)
        except RuntimeError:
            if not opts.mmap:
                raise
            # e.g. a file in the legacy (non-zip) format, which cannot be memory-mapped
            op.sd = unpickle.torch_load(lf.path, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        part.problems.append(
            Problem(
                "unsafe_pickle" if isinstance(e, unpickle.UnsafeCheckpointError) else "unreadable",
                f"{where(lf)}: cannot be loaded: {type(e).__name__}: {e}",
                **op.base,
            )
        )
        op.failed = True
        return False
    op.print.loaded = True
    return True


def _read_identity(op: OpenedLocal, part: Findings) -> None:
    lf, sd = op.lf, op.sd
    try:
        ident = get_identity(sd)
    except ValueError as e:
        part.problems.append(
            Problem("identity", f"{where(lf)}: unusable identity record: {e}", **op.base)
        )
        ident = {"unusable": str(e)}
    else:
        if ident is not None and (
            (ident.get("iteration"), ident.get("owner_rank")) != (lf.iteration, lf.owner_rank)
        ):
            part.problems.append(
                Problem(
                    "identity",
                    f"{where(lf)}: its identity record is of rank "
                    f"{ident.get('owner_rank')}'s shard of iteration {ident.get('iteration')}, its "
                    f"name says rank {lf.owner_rank}, iteration {lf.iteration}",
                    **op.base,
                )
            )
    op.res.has_identity = ident is not None
    op.print.identity = ident
    common = getattr(sd, "common", None)
    if isinstance(common, dict):
        args = common.get("args")
        if args is not None:
            op.res.world_size = getattr(args, "world_size", None)
            if getattr(args, "replication", False):
                op.res.replication_factor = getattr(args, "replication_factor", None)
        it = common.get("iteration")
        if isinstance(it, int) and it != lf.iteration:
            part.problems.append(
                Problem(
                    "iteration",
                    f"{where(lf)}: its common state says "
                    f"iteration {it}, its name says {lf.iteration}",
                    **op.base,
                )
            )


def _read_checksum_record(op: OpenedLocal, part: Findings) -> Optional[dict]:
    lf = op.lf
    try:
        record = ck.get_record(op.sd)
    except ValueError as e:
        part.problems.append(
            Problem("checksum_mismatch", f"{where(lf)}: unusable checksum record: {e}", **op.base)
        )
        record = None
    op.res.has_checksum_record = record is not None
    if record is None:
        part.warnings.append(
            Problem(
                "no_checksum_record",
                f"{where(lf)}: no per-tensor checksum "
                "record (saved without the replication fix): stored checksums "
                "not checked",
                **op.base,
            )
        )
    elif record.get("owner_rank") != lf.owner_rank:
        part.problems.append(
            Problem(
                "checksum_mismatch",
                f"{where(lf)}: checksum record is of "
                f"rank {record.get('owner_rank')}'s shard, the file name says "
                f"rank {lf.owner_rank}",
                **op.base,
            )
        )
    return record


def _batches(items: List[Tuple[str, Any, Any]], batch_bytes: int) -> List[List[int]]:
    out: List[List[int]] = []
    batch: List[int] = []
    size = 0
    for i, (_k, t, _sh) in enumerate(items):
        n = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        if batch and size + n > batch_bytes:
            out.append(batch)
            batch, size = [], 0
        batch.append(i)
        size += n
    if batch:
        out.append(batch)
    return out


def open_local(lf: LocalFile, opts: VerifyOptions, part: Findings) -> OpenedLocal:
    """Load (map) a local file and read its metadata; problems go to ``part`` (``failed`` set
    when the file cannot be checked further)."""
    res = FileResult(
        file=lf.rel,
        role=lf.role,
        holder_rank=lf.holder_rank,
        owner_rank=lf.owner_rank,
        iteration=lf.iteration,
        file_bytes=lf.size,
    )
    base = dict(
        file=lf.rel,
        holder_rank=lf.holder_rank,
        owner_rank=lf.owner_rank,
        role=lf.role,
        iteration=lf.iteration,
    )
    op = OpenedLocal(lf, res, base)
    op.print = part.prints[lf.rel] = CopyPrint()
    if not _load(op, opts, part):
        return op
    _read_identity(op, part)
    record = _read_checksum_record(op, part)
    shs, objs = _sharded_parts(op.sd)
    if shs is None:
        # not an MCore tensor-aware state dict: checksums and NaN/Inf only
        sd = op.sd
        tensors = list(getattr(sd, "tensors", []) or [])
        if not tensors and not hasattr(sd, "tensors"):
            part.problems.append(
                Problem(
                    "not_a_local_checkpoint",
                    f"{where(lf)}: holds a {type(sd).__name__}, not a tensor-aware state dict",
                    **base,
                )
            )
            op.failed = True
            return op
        part.warnings.append(
            Problem(
                "not_compared",
                f"{where(lf)}: a {type(sd).__name__}: tensors "
                "have no global position, only checksums and NaN/Inf are "
                "checked",
                **base,
            )
        )
        op.items = [(f"tensor[{i}]", t, None) for i, t in enumerate(tensors)]
    else:
        op.items = [(sh.key, sh.data, sh) for sh in shs]
        op.objs = objs
    op.entries = record["entries"] if record is not None else None
    if op.entries is not None and len(op.entries) != len(op.items):
        part.problems.append(
            Problem(
                "checksum_mismatch",
                f"{where(lf)}: holds {len(op.items)} "
                f"tensors, its checksum record lists {len(op.entries)}",
                **base,
            )
        )
    res.tensors = len(op.items)
    op.batches = _batches(op.items, opts.batch_bytes)
    return op


def plan_readahead(
    op: OpenedLocal, pc: Optional[PersistentCheckpoint], ra: ReadAhead, mapped: bool
) -> None:
    """Queue, batch by batch, each tensor's local bytes (when mapped) and its persistent chunk."""
    if op.failed or not ra.enabled:
        op.batch_tickets = [-1] * len(op.batches)
        return
    tensors = [t for _k, t, _sh in op.items]
    ranges = tensor_file_ranges(op.lf.path, tensors) if mapped else None
    if mapped and ranges is None:
        ra.add(op.lf.path)  # the whole file first
    for b in op.batches:
        ticket = -1
        for i in b:
            _k, t, sh = op.items[i]
            if ranges is not None and ranges[i][1]:
                ticket = ra.add(op.lf.path, *ranges[i])
            if pc is not None and sh is not None:
                r = pc.storage_range(sh.key, region_of(sh)[0])
                if r is not None:
                    ticket = ra.add(*r)
        op.batch_tickets.append(ticket)


def check_opened(
    op: OpenedLocal,
    pc: Optional[PersistentCheckpoint],
    opts: VerifyOptions,
    part: Findings,
    ra: ReadAhead,
    progress: Optional[Callable[[int], None]] = None,
) -> None:
    """All checks of one opened local file, batch by batch (each batch waits for its
    read-ahead); releases the file's tensors when done."""
    lf = op.lf
    part.files.append(op.res)
    part.bytes_read += lf.size
    reported = 0

    def advance(n: int) -> None:
        nonlocal reported
        if progress is not None and n > 0:
            progress(n)
            reported += n

    if not op.failed:
        for b, ticket in zip(op.batches, op.batch_tickets):
            ra.wait(ticket)
            regions: List[Union[torch.Tensor, str, None]] = [None] * len(b)
            if pc is not None and op.items and op.items[0][2] is not None:
                regions = pc.read_regions(
                    [(op.items[i][2].key, *region_of(op.items[i][2])) for i in b]
                )
                part.bytes_read += sum(
                    r.numel() * r.element_size() for r in regions if isinstance(r, torch.Tensor)
                )
            for j, i in enumerate(b):
                _key, t, sh = op.items[i]
                check_tensor(op, i, regions[j], part, opts)
                if isinstance(t, torch.Tensor):
                    advance(t.numel() * t.element_size())
                if sh is not None:
                    reg = region_of(sh)
                    per_key = part.regions.setdefault(sh.key, {})
                    per_key[reg] = per_key.get(reg, 0) + 1
            del regions
        if pc is not None and opts.compare_objects and op.objs:
            check_objects(op, part, pc)
    advance(lf.size - reported)
    op.sd = None
    op.items = []
    op.objs = []
