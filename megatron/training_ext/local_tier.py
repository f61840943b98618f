"""Validated local checkpoint tier with fallback to the persistent tier (issue 6, training path).

Why this module exists
----------------------
With ``--non-persistent-ckpt-type local`` upstream Megatron-LM (megatron-core 0.19.2,
``megatron/training/checkpointing.py``) resumes from the newest *local* checkpoint whenever it is
at least as new as the newest persistent one, and uses whatever it finds: a corrupted local file
(or replica) either crashes the load with an error that differs from rank to rank (so some ranks
hang in the next collective), or, worse, is loaded silently. A local tier that holds bad values
(NaN that slipped into the replicas, a silent data corruption) makes every restart, by
``ft_launcher`` in-job or by a scheduler requeue, resume from the same bad state on the same GPUs:
the job never gets past it. This module makes the local tier *validated*, with the persistent tier
as the fallback. It is on by default whenever local checkpoints are on
(``--no-local-tier-validation`` restores upstream behaviour).

What it does
------------
1. **Save** (``LocalCheckpointManager.save``, NVRx 0.7.0 ``ckpt_managers/base_manager.py``): before
   the state dict is replicated, the owning rank records for each tensor whether all its values are
   finite (attribute :data:`FINITE_ATTR` of the ``TensorAwareStateDict``, builtin types only; it
   travels with the hollow state dict to every replica, so a replica is judged against what its
   *primary* held). Without replication, ``LocalCheckpointManager._save`` also attaches the
   per-tensor checksum record of :mod:`megatron.integrity.checksums` (with replication the
   replication fix, :mod:`megatron.fixes.replication`, already does).
2. **Load** (upstream ``checkpointing._load_non_persistent_base_checkpoint``, local branch): while
   upstream runs, the manager's ``load`` is replaced by :func:`_guarded_load`, which does what
   ``BaseCheckpointManager.load`` does, in stages, with a world-wide agreement after each stage
   (``all_gather_object`` of every rank's error list on the default group):

   a. read the files this rank must hold or send (a truncated or unreadable file is an error of
      that rank, not an exception that would leave the other ranks waiting);
   b. the replication strategy's ``retrieve_execute`` (peer retrieval of lost shards); with the
      replication fix it verifies every loaded and received state dict against its checksums and
      raises :class:`~megatron.integrity.checksums.ChecksumMismatchError` on every rank of the
      clique, which is caught here;
   c. verification of the state dict this rank will use: checksums
      (:func:`megatron.integrity.checksums.verify_record`) unless stage b already did them, and
      finiteness (``isfinite`` of the tensor's sum, see :func:`_all_finite`) for every tensor
      whose primary recorded finite values.

   If any rank reports an error in any stage, *every* rank raises :class:`LocalTierRejected` with
   the same summary, so the decision is collective and no rank hangs.
3. **Fallback** (upstream ``checkpointing._load_base_checkpoint``): :class:`LocalTierRejected` is
   caught there; every rank prints one line (prefix :data:`LOG_PREFIX`) saying why and which
   persistent iteration it loads instead, moves its local checkpoint files into
   ``<local dir>/rejected/`` (so that upstream's next local save cannot collide with them, and
   ``find_latest`` never offers them again) and calls upstream again with the local tier switched
   off (``_get_non_persistent_iteration`` returns -1). Without a persistent checkpoint the run
   starts from initialization, exactly as upstream without a checkpoint (and
   ``--exit-on-missing-checkpoint`` exits).
4. **NaN window** (upstream ``training.train_step``; ``RerunStateMachine.validate_result``): for
   ``--local-tier-nan-window N`` iterations after a resume from the local tier, each iteration
   ends with one all-reduce of a flag: set when a reduced loss or the grad norm is NaN/Inf, when
   the rerun state machine asks to exit after a failed result validation (exit codes 16/17), or
   when a fatal ``validate_result`` rejected a result (in rerun mode ``disabled`` that rejection
   is deferred to the end of the iteration instead of raising on one rank). If any rank sets it,
   every rank writes the marker file :data:`MARKER_NAME` into its local checkpoint directory (JSON:
   iteration, the local iteration resumed from, reason, rank, host, time, exit code) and the
   run leaves through upstream's own exit path (``train()`` breaks, finalizes pending async saves,
   barriers, ``sys.exit``) with :data:`LOCAL_TIER_BAD_EXIT_CODE` (75), *without* saving a
   checkpoint of the bad state. If the failure surfaces as an exception instead (a rank-local
   error whose message names NaN/Inf), that rank writes the marker and leaves with ``os._exit(75)``
   (the other ranks are then stopped by the launcher).
5. **Next start** (``ft_launcher`` in-job restart or a scheduler requeue): before anything is
   loaded the ranks gather their markers; if any rank has one, the local tier is rejected as in 3
   (reason: the marker's content) and the persistent checkpoint is loaded.
6. **Marker lifetime**: a marker stays until a local checkpoint written by a later process is
   complete on all ranks (``LocalCheckpointManager._cleanup``, which upstream calls only after
   ``find_latest`` confirmed the new checkpoint on every rank); then each rank removes its marker
   and its ``rejected/`` directory. A process that found a marker never resumed from the local
   tier, so whatever it saves descends from the persistent checkpoint; the process that wrote a
   marker never clears it (its pending async saves are finalized on the way out). If a rank
   crashes between two ranks' clean-ups, the marker left behind costs one more persistent load
   at the next start, never a wrong load. Markers are written on every rank, so a replaced node
   (whose local directory, marker included, is gone) does not erase the verdict.

Exit code
---------
:data:`LOCAL_TIER_BAD_EXIT_CODE` = 75 (``EX_TEMPFAIL`` in ``sysexits.h``: "temporary failure, try
again"). It is distinct from upstream's rerun codes (16 ``EXIT_CODE_RESUME_TO_DISAMBIGUATE``, 17
``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``) and from NVRx's "do not restart" code (93). Meaning: the
job should be started again (in-job restart or requeue); the next start resumes from the
persistent tier.

Flags (``megatron/training_ext/args.py``)
-----------------------------------------
``--no-local-tier-validation``
    Load local checkpoints as upstream does: no verification, no fallback, markers ignored, no NaN
    window.
``--local-tier-nan-window N``
    Iterations after a resume from the local tier during which a NaN/Inf loss or grad norm marks
    the local tier bad and exits with code 75 (default :data:`DEFAULT_NAN_WINDOW`; 0 disables).

Upstream points wrapped (megatron-core 0.19.2, NVRx 0.7.0)
----------------------------------------------------------
``megatron.training.checkpointing._load_base_checkpoint``, ``._get_non_persistent_iteration``,
``._load_non_persistent_base_checkpoint``; ``megatron.training.training.train_step``;
``megatron.core.rerun_state_machine.RerunStateMachine.validate_result`` (only while deferring);
``nvidia_resiliency_ext...local_manager.LocalCheckpointManager.save``, ``._save``, ``._cleanup``.
All through :class:`megatron.fixes.base.Patcher`; :func:`uninstall` undoes them.

Limits: the checksum record of a non-replicated local save is attached in ``_save``, i.e. in the
process that writes the file; with ``--async-save`` and a *spawned* persistent checkpoint worker
that process does not have these patches, and its files load unverified (with a warning), as files
written before this module existed do. Upstream's ``load_checkpoint`` reads the local tier twice
(``rank0=True`` for the arguments, then the full load); both reads are verified, and should the
second fail where the first passed (the files changed in between) the second falls back alone.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from megatron.fixes.base import Patcher
from megatron.integrity import checksums as ck
from megatron.training_ext.console import write_line

logger = logging.getLogger("megatron.training_ext.local_tier")

__all__ = [
    "DEFAULT_NAN_WINDOW",
    "FINITE_ATTR",
    "LOCAL_TIER_BAD_EXIT_CODE",
    "LOG_PREFIX",
    "MARKER_NAME",
    "QUARANTINE_DIR",
    "LocalTierRejected",
    "install",
    "installed",
    "loaded_local_iteration",
    "read_marker",
    "uninstall",
]

LOCAL_TIER_BAD_EXIT_CODE = 75
"""Exit code of a run that found a NaN/Inf result within the NaN window after resuming from the
local tier (``EX_TEMPFAIL``): start the job again; the next start loads the persistent tier."""

DEFAULT_NAN_WINDOW = 50
"""Default of ``--local-tier-nan-window`` (iterations after a local-tier resume)."""

MARKER_NAME = "LOCAL_TIER_BAD.json"
"""Marker file, one per rank, in the rank's local checkpoint directory (``<root>/<session>/<rank>``)."""

QUARANTINE_DIR = "rejected"
"""Sub-directory of a rank's local checkpoint directory that receives rejected local checkpoint
files (only the most recent rejected set is kept; removed with the marker)."""

FINITE_ATTR = "_megatron_local_tier_finite"
"""Attribute of a saved ``TensorAwareStateDict``: ``{"format", "version", "owner_rank",
"finite": [True | False | None per tensor, in ``tensors`` order]}``."""

FINITE_FORMAT = "megatron.local_tier.finite"
MARKER_FORMAT = "megatron.local_tier.bad_marker"
LOG_PREFIX = "[local-tier]"

_RERUN_EXIT_CODES = (16, 17)  # megatron.core.rerun_state_machine EXIT_CODE_* (checked at install)
_FINITE_CHUNK = 1 << 26  # elements per isfinite() pass in the fallback (bounds the bool temporary)
_LOCAL_FILE = re.compile(r"iter_\d+_\d+_local(\.dirty)?\.pt$")
_NONFINITE_WORDS = re.compile(r"\bnan\b|\binf\b|non-?finite", re.IGNORECASE)


class LocalTierRejected(RuntimeError):
    """The local checkpoint tier failed validation on at least one rank.

    Raised on *every* rank at the same point (the decision is collective), inside upstream's
    ``_load_non_persistent_base_checkpoint``; caught by the ``_load_base_checkpoint`` wrapper,
    which falls back to the persistent tier. ``iteration`` is the rejected local iteration.
    """

    def __init__(self, message: str, iteration: Optional[int] = None):
        super().__init__(message)
        self.iteration = iteration


@dataclass
class _State:
    validation: bool
    nan_window: int
    markers_checked: bool = False
    force_persistent: bool = False
    rejected_reason: Optional[str] = None
    local_load_iteration: Optional[int] = None
    manager: Any = None
    marker_written: bool = False
    deferring: bool = False
    deferred: List[str] = field(default_factory=list)
    warned_unverified: bool = False


_STATE: Optional[_State] = None
_PATCHER = Patcher()
_UP: dict[str, Any] = {}


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _say(message: str) -> None:
    """One log line of this rank (stdout, flushed: it must survive an immediate exit)."""
    write_line(f"{LOG_PREFIX} rank {_rank()}: {message}")


def _gather(obj: Any) -> list:
    """``all_gather_object`` on the default group (world)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _flag_device() -> torch.device:
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _any_rank(flag: bool) -> bool:
    """Collective: True if ``flag`` is set on any rank (one all-reduce of one int)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exc_text(e: BaseException) -> str:
    """``Type: message`` of an exception; for a multi-line message (``ChecksumMismatchError``: a
    header, then one line per problem) the first problem line and a count."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1:
        more = f" (+{len(lines) - 2} more)" if len(lines) > 2 else ""
        return f"{type(e).__name__}: {_short(lines[1], 260)}{more}"
    return f"{type(e).__name__}: {_short(lines[0] if lines else '', 260)}"


def _summarize(gathered: list, limit: int = 3) -> str:
    """``[[errors of rank 0], [errors of rank 1], ...]`` -> one line: each distinct error once,
    with the ranks that reported it."""
    by_text: dict[str, list[int]] = {}
    for r, errs in enumerate(gathered):
        for e in errs or []:
            by_text.setdefault(str(e), []).append(r)
    items = list(by_text.items())
    shown = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {_short(t, 300)}"
                      for t, rs in items[:limit])
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return shown + more


def _agree(my_errors: List[str], iteration: Optional[int], stage: str) -> None:
    """Collective: raise :class:`LocalTierRejected` on every rank if any rank has errors."""
    gathered = _gather(list(my_errors))
    if any(gathered):
        raise LocalTierRejected(
            f"local checkpoint at iteration {iteration} failed {stage}: {_summarize(gathered)}",
            iteration,
        )


def _tensor_keys(state_dict: Any, count: int) -> List[tuple]:
    """(key, global_offset) per tensor of a non-hollow state dict, in ``tensors`` order."""
    try:
        sharded = list(state_dict._sharded_tensors)
        if len(sharded) == count:
            return [(str(s.key), tuple(int(o) for o in s.global_offset)) for s in sharded]
    except Exception:  # noqa: BLE001 - not an MCoreTensorAwareStateDict
        pass
    return [(f"tensor[{i}]", None) for i in range(count)]


def _is_quantized(t: torch.Tensor) -> bool:
    return type(t).dequantize is not torch.Tensor.dequantize


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor (on ``t``'s device, no synchronisation): all values of ``t`` are finite.

    Computed as ``isfinite(sum(t))`` (a NaN or Inf anywhere makes the sum NaN/Inf; half types are
    summed in float32): one streaming pass with no temporary, ~10x faster than
    ``isfinite(t).all()`` on CPU. A finite tensor whose float32 sum overflows (|sum| > 3.4e38)
    reads as not finite: at save time that only means the tensor is not checked at load.
    Dtypes without ``sum`` fall back to ``isfinite(...).all()`` in chunks.
    """
    flat = t.detach().reshape(-1)
    try:
        wide = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None
        return torch.isfinite(flat.sum(dtype=wide))
    except (RuntimeError, TypeError):
        ok = torch.ones((), dtype=torch.bool, device=flat.device)
        for start in range(0, flat.numel(), _FINITE_CHUNK):
            ok = ok & torch.isfinite(flat[start:start + _FINITE_CHUNK]).all()
        return ok


def _finite_flags(tensors: List[torch.Tensor]) -> List[Optional[bool]]:
    """Per tensor: True/False = all values finite or not; None = not determinable (quantized or
    exotic tensors). Integer/bool tensors are True. One host synchronisation in all."""
    flags: List[Optional[bool]] = [None] * len(tensors)
    pending: List[tuple[int, torch.Tensor]] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or _is_quantized(t):
            continue
        if not (t.is_floating_point() or t.is_complex()):
            flags[i] = True
            continue
        try:
            pending.append((i, _all_finite(t)))
        except Exception:  # noqa: BLE001 - leave None
            continue
    if pending:
        dev = pending[0][1].device
        values = torch.stack([ok.to(dev) for _, ok in pending]).cpu().tolist()
        for (i, _), v in zip(pending, values):
            flags[i] = bool(v)
    return flags


def _local_dir(manager: Any) -> Path:
    return Path(manager.local_ckpt_dir)


def _persistent_iteration(load_dir: Optional[str]) -> Optional[str]:
    """The newest persistent iteration per upstream's tracker file (no collectives), as text."""
    if not load_dir:
        return None
    from megatron.training import checkpointing

    try:
        with open(checkpointing.get_checkpoint_tracker_filename(load_dir)) as f:
            return f.read().strip() or None
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# markers
# ---------------------------------------------------------------------------------------------


def read_marker(local_dir: os.PathLike | str) -> Optional[dict]:
    """The marker in one rank's local checkpoint directory, or ``None``.

    An unreadable marker is returned as ``{"reason": "unreadable marker ..."}`` (it still marks
    the tier bad).
    """
    path = Path(local_dir) / MARKER_NAME
    if not path.exists():
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as e:
        return {"reason": f"unreadable marker {path}: {e}"}


def _write_marker(manager: Any, iteration: int, reason: str) -> Path:
    st = _STATE
    local_dir = _local_dir(manager)
    local_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "format": MARKER_FORMAT,
        "version": 1,
        "iteration": int(iteration),
        "local_checkpoint_iteration": st.local_load_iteration,
        "reason": reason,
        "rank": _rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "exit_code": LOCAL_TIER_BAD_EXIT_CODE,
    }
    path = local_dir / MARKER_NAME
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    st.marker_written = True
    return path


def _describe_marker(rank: int, m: dict) -> str:
    if "iteration" in m:
        return (f"rank {rank} marked the local tier bad at iteration {m.get('iteration')} "
                f"(resumed from local iteration {m.get('local_checkpoint_iteration')}, "
                f"{m.get('time', '?')}): {_short(m.get('reason', '?'), 200)}")
    return f"rank {rank}: {m.get('reason')}"


def _check_markers(manager: Any) -> Optional[str]:
    """Collective: the reason to reject the local tier if any rank has a marker, else None."""
    gathered = _gather(read_marker(_local_dir(manager)))
    found = [(r, m) for r, m in enumerate(gathered) if m is not None]
    if not found:
        return None
    first = _describe_marker(*found[0])
    more = f" (markers on ranks {[r for r, _ in found]})" if len(found) > 1 else ""
    return f"bad-tier marker {MARKER_NAME} found: {first}{more}"


def _clear_marker(manager: Any, iteration: int) -> None:
    st = _STATE
    if st is None or st.marker_written:
        return
    local_dir = _local_dir(manager)
    marker = local_dir / MARKER_NAME
    rejected = local_dir / QUARANTINE_DIR
    removed = []
    if marker.exists():
        try:
            marker.unlink()
            removed.append(f"the bad-tier marker {marker}")
        except FileNotFoundError:
            pass
    if rejected.is_dir():
        shutil.rmtree(rejected, ignore_errors=True)
        removed.append(f"the rejected local checkpoints in {rejected}")
    if removed:
        _say(f"local checkpoint at iteration {iteration} is complete on all ranks: removed "
             f"{' and '.join(removed)}")


# ---------------------------------------------------------------------------------------------
# fallback
# ---------------------------------------------------------------------------------------------


def _quarantine(manager: Any) -> tuple[int, Path]:
    """Move this rank's local checkpoint files into ``rejected/`` (replacing an older set)."""
    local_dir = _local_dir(manager)
    rejected = local_dir / QUARANTINE_DIR
    if not local_dir.is_dir():
        return 0, rejected
    files = [p for p in local_dir.iterdir() if p.is_file() and _LOCAL_FILE.fullmatch(p.name)]
    if not files:
        return 0, rejected
    if rejected.exists():
        shutil.rmtree(rejected, ignore_errors=True)
    rejected.mkdir(parents=True, exist_ok=True)
    for p in files:
        os.replace(p, rejected / p.name)
    return len(files), rejected


def _fall_back(manager: Any, reason: str, load_dir: Optional[str]) -> None:
    """Every rank: switch the local tier off for this process, quarantine, say why (one line)."""
    st = _STATE
    st.force_persistent = True
    st.rejected_reason = reason
    st.local_load_iteration = None
    moved, rejected = _quarantine(manager)
    manager.latest_iteration = -1  # upstream caches find_latest(); later saves assert against it
    persistent = _persistent_iteration(load_dir)
    target = (f"the newest persistent checkpoint: iteration {persistent} in {load_dir}" if persistent
              else f"no persistent checkpoint in {load_dir}: starting from initialization")
    moved_text = f"; {moved} local checkpoint file(s) moved to {rejected}" if moved else ""
    _say(f"local checkpoint tier rejected: {reason} -> loading {target}{moved_text}")


# ---------------------------------------------------------------------------------------------
# load path
# ---------------------------------------------------------------------------------------------


def _strategy_verifies(strategy: Any) -> bool:
    """True if the strategy's retrieve_execute is the replication fix's (verifies checksums)."""
    try:
        from megatron.fixes import replication
    except ImportError:  # pragma: no cover
        return False
    fixed = getattr(replication, "fixed_retrieve_execute", None)
    return fixed is not None and getattr(type(strategy), "retrieve_execute", None) is fixed


def _verify(state_dict: Any, what: str, check_checksums: bool) -> tuple[List[str], str]:
    """Checksums (optional) and finiteness of one loaded state dict; (errors, summary)."""
    st = _STATE
    errors: List[str] = []
    tensors = list(state_dict.tensors)
    keys = [k for k, _ in _tensor_keys(state_dict, len(tensors))]
    done = []
    if check_checksums:
        try:
            record = ck.get_record(state_dict)
        except ValueError as e:
            record = None
            errors.append(f"{what}: {e}")
        if record is not None:
            mismatches = ck.verify_record(record, tensors)
            errors += [f"{what}: {m}" for m in mismatches[:3]]
            if len(mismatches) > 3:
                errors.append(f"{what}: ... {len(mismatches) - 3} more checksum mismatches")
            done.append(f"{len(tensors)} checksums")
        elif not errors and not st.warned_unverified:
            st.warned_unverified = True
            logger.warning("%s has no checksum record (written without checksums): checksums not "
                           "verified", what)
    else:
        done.append("checksums verified during retrieval")
    finite = getattr(state_dict, FINITE_ATTR, None)
    if isinstance(finite, dict) and finite.get("format") == FINITE_FORMAT:
        flags = finite.get("finite") or []
        if len(flags) != len(tensors):
            errors.append(f"{what}: finiteness record lists {len(flags)} tensors, the state dict "
                          f"has {len(tensors)}")
        else:
            idx = [i for i, f in enumerate(flags) if f is True]
            now = _finite_flags([tensors[i] for i in idx])
            bad = [keys[i] for i, ok in zip(idx, now) if ok is False]
            if bad:
                errors.append(f"{what}: {len(bad)} tensor(s) hold NaN/Inf where the primary (rank "
                              f"{finite.get('owner_rank')}) saved finite values: {bad[:3]}")
            done.append(f"{len(idx)} tensors finite")
    return errors, ", ".join(done) or "nothing to verify"


def _guarded_load(manager: Any):
    """``BaseCheckpointManager.load`` (NVRx 0.7.0) in stages with a collective verdict after each.

    Same contract as upstream: all ranks call it after ``find_latest``; returns
    ``(state_dict, ckpt_id)`` of this rank's shard of the newest complete local checkpoint.

    Raises:
        LocalTierRejected: on every rank, when any rank cannot read a file it needs, peer retrieval
            fails (e.g. ``ChecksumMismatchError`` from the replication fix), or the state dict a
            rank would use fails its checksums or holds NaN/Inf where its primary was finite.
        CheckpointingException: ``find_latest`` was not called (as upstream; every rank).
    """
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
        CheckpointingException,
    )

    iteration = manager.latest_iteration
    if iteration == -1:
        raise CheckpointingException(
            "The 'find_latest' method must be called before invoking the 'load' function."
        )
    me = _rank()
    ckpt_id = manager._ckpt_id(iteration)
    strategy = manager.repl_strategy
    errors: List[str] = []

    def path_of(cid) -> str:
        try:
            return str(manager._local_ckpt_path_from_id(cid))
        except Exception:  # noqa: BLE001
            return str(cid)

    retrieved = False
    if strategy is not None:
        plan = None
        try:
            plan = strategy.retrieve_plan(manager.globally_available_ids, [ckpt_id])
        except Exception as e:  # noqa: BLE001 - same on every rank of the clique
            errors.append(f"no retrieval plan: {_exc_text(e)}")
        my_data = {}
        if plan is not None:
            for cid in sorted(plan.required_ids(), key=str):
                try:
                    my_data[cid] = manager._load_fn(cid)
                except Exception as e:  # noqa: BLE001 - reported collectively below
                    errors.append(f"cannot read {path_of(cid)}: {_exc_text(e)}")
        _agree(errors, iteration, "reading")
        received = None
        try:
            received = strategy.retrieve_execute(plan, my_data)
        except Exception as e:  # noqa: BLE001 - ChecksumMismatchError on every rank of the clique
            errors.append(_exc_text(e))
        _agree(errors, iteration, "retrieval")
        if set(received) != {ckpt_id}:
            errors.append(f"retrieval returned {sorted(received, key=str)}, expected {ckpt_id}")
            _agree(errors, iteration, "retrieval")
        state_dict = received[ckpt_id]
        retrieved = ckpt_id not in my_data
        check_checksums = not _strategy_verifies(strategy)
    else:
        state_dict = None
        try:
            state_dict = manager._load_fn(ckpt_id)
        except Exception as e:  # noqa: BLE001
            errors.append(f"cannot read {path_of(ckpt_id)}: {_exc_text(e)}")
        _agree(errors, iteration, "reading")
        check_checksums = True
    what = f"rank {me}'s shard" + (" (retrieved from a replica)" if retrieved else "")
    errors, summary = _verify(state_dict, what, check_checksums)
    _agree(errors, iteration, "verification")
    if me == 0:
        _say(f"local checkpoint at iteration {iteration} verified on all ranks ({summary} on rank 0)")
    return state_dict, ckpt_id


def _local_tier_call(sig: inspect.Signature, a: tuple, kw: dict) -> Optional[tuple]:
    """``(bound arguments, LocalCheckpointManager)`` of a call to an upstream load function when
    the validated local tier handles it (validation on, local checkpoints, process group up),
    else None."""
    bound = sig.bind(*a, **kw)
    args = bound.arguments.get("args")
    ctx = bound.arguments.get("checkpointing_context")
    applies = (
        _STATE is not None
        and _STATE.validation
        and getattr(args, "non_persistent_ckpt_type", None) == "local"
        and isinstance(ctx, dict)
        and ctx.get("local_checkpoint_manager") is not None
        and dist.is_available()
        and dist.is_initialized()
    )
    return (bound, ctx["local_checkpoint_manager"]) if applies else None


def _wrap_load_base_checkpoint(upstream):
    sig = inspect.signature(upstream)

    @functools.wraps(upstream)
    def _load_base_checkpoint(*a, **kw):
        call = _local_tier_call(sig, a, kw)
        if call is None:
            return upstream(*a, **kw)
        bound, manager = call
        st = _STATE
        st.manager = manager
        load_dir = bound.arguments.get("load_dir")
        if not st.markers_checked:
            st.markers_checked = True
            reason = _check_markers(manager)
            if reason is not None:
                _fall_back(manager, reason, load_dir)
        if st.force_persistent:
            return upstream(*a, **kw)
        try:
            return upstream(*a, **kw)
        except LocalTierRejected as e:
            _fall_back(manager, str(e), load_dir)
            return upstream(*a, **kw)

    return _load_base_checkpoint


def _wrap_get_non_persistent_iteration(upstream):
    @functools.wraps(upstream)
    def _get_non_persistent_iteration(non_persistent_global_dir, args, checkpointing_context=None):
        st = _STATE
        if (st is not None and st.force_persistent
                and getattr(args, "non_persistent_ckpt_type", None) == "local"):
            return -1
        return upstream(non_persistent_global_dir, args, checkpointing_context)

    return _get_non_persistent_iteration


def _wrap_load_non_persistent(upstream):
    sig = inspect.signature(upstream)

    @functools.wraps(upstream)
    def _load_non_persistent_base_checkpoint(*a, **kw):
        call = _local_tier_call(sig, a, kw)
        if call is None:
            return upstream(*a, **kw)
        bound, manager = call
        manager.load = functools.partial(_guarded_load, manager)  # this call only
        try:
            result = upstream(*a, **kw)
        finally:
            manager.__dict__.pop("load", None)
        st = _STATE
        st.manager = manager
        st.local_load_iteration = int(bound.arguments.get("non_persistent_iteration"))
        return result

    return _load_non_persistent_base_checkpoint


# ---------------------------------------------------------------------------------------------
# save path
# ---------------------------------------------------------------------------------------------


def _wrap_save(upstream):
    @functools.wraps(upstream)
    def save(self, state_dict, iteration, is_async=False):
        tensors = list(state_dict.tensors)
        ck_attr = {"format": FINITE_FORMAT, "version": 1, "owner_rank": _rank(),
                   "finite": _finite_flags(tensors)}
        setattr(state_dict, FINITE_ATTR, ck_attr)
        return upstream(self, state_dict, iteration, is_async)

    return save


def _wrap_file_save(upstream):
    @functools.wraps(upstream)
    def _save(self, state_dict, ckpt_id):
        if self.repl_strategy is None:
            try:
                has_record = ck.get_record(state_dict) is not None
            except ValueError:
                has_record = True  # leave a foreign record alone; load reports it
            if not has_record:
                try:
                    tensors = list(state_dict.tensors)
                    names = _tensor_keys(state_dict, len(tensors))
                    entries = [ck.make_entry(i, k, t, global_offset=o)
                               for i, ((k, o), t) in enumerate(zip(names, tensors))]
                    ck.attach_record(state_dict, ck.make_record(ckpt_id[1], entries))
                except (TypeError, ValueError) as e:  # quantized/meta tensors: save unverified
                    logger.warning("local checkpoint %s saved without checksums: %s", ckpt_id, e)
        return upstream(self, state_dict, ckpt_id)

    return _save


def _wrap_cleanup(upstream):
    @functools.wraps(upstream)
    def _cleanup(self, iteration):
        result = upstream(self, iteration)
        _clear_marker(self, iteration)
        return result

    return _cleanup


# ---------------------------------------------------------------------------------------------
# NaN window
# ---------------------------------------------------------------------------------------------


def _is_finite_value(v: Any) -> bool:
    if v is None:
        return True
    if isinstance(v, torch.Tensor):
        if not (v.is_floating_point() or v.is_complex()):
            return True
        return bool(torch.isfinite(v.detach()).all().item())
    if isinstance(v, (list, tuple)):
        return all(_is_finite_value(x) for x in v)
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return True


def _exit_now(iteration: int, reason: str) -> None:
    """Rank-local failure inside the window: marker on this rank, then ``os._exit(75)`` (the
    other ranks may be blocked in a collective; the launcher stops them)."""
    st = _STATE
    path = _write_marker(st.manager, iteration, reason)
    _say(f"non-finite result at iteration {iteration} after resuming from the local checkpoint at "
         f"iteration {st.local_load_iteration} ({_short(reason, 300)}); wrote {path}; exiting "
         f"with code {LOCAL_TIER_BAD_EXIT_CODE}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LOCAL_TIER_BAD_EXIT_CODE)


def _wrap_train_step(upstream):
    sig = inspect.signature(upstream)

    @functools.wraps(upstream)
    def train_step(*a, **kw):
        st = _STATE
        iteration = sig.bind(*a, **kw).arguments.get("iteration")
        if (st is None or st.nan_window <= 0 or st.local_load_iteration is None
                or st.manager is None or iteration is None
                or not iteration < st.local_load_iteration + st.nan_window):
            return upstream(*a, **kw)
        st.deferred = []
        st.deferring = True
        try:
            out = upstream(*a, **kw)
        except Exception as e:
            st.deferring = False
            if _NONFINITE_WORDS.search(str(e)):
                _exit_now(iteration + 1, f"{type(e).__name__}: {e}")
            raise
        finally:
            st.deferring = False
        reasons = list(st.deferred)
        if not (isinstance(out, tuple) and len(out) >= 6):
            return out
        loss_dict, _, _, should_exit, exit_code, grad_norm = out[:6]
        if should_exit and exit_code in _RERUN_EXIT_CODES:
            reasons.append(f"rerun state machine requested exit code {exit_code} (result validation failed)")
        for key, value in (loss_dict or {}).items():
            if not _is_finite_value(value):
                reasons.append(f"'{key}' is {value}")
        if not _is_finite_value(grad_norm):
            reasons.append(f"grad norm is {grad_norm}")
        if not _any_rank(bool(reasons)):
            return out
        gathered = _gather(reasons)
        reason = f"non-finite training result: {_summarize(gathered)}"
        path = _write_marker(st.manager, iteration + 1, reason)
        _say(f"non-finite result at iteration {iteration + 1}, {iteration + 1 - st.local_load_iteration} "
             f"iteration(s) after resuming from the local checkpoint at iteration "
             f"{st.local_load_iteration}: marked the local tier bad ({path}) and exiting with code "
             f"{LOCAL_TIER_BAD_EXIT_CODE} without saving; the next start loads the persistent "
             f"checkpoint")
        out = list(out)
        out[0], out[2], out[3], out[4] = {}, False, True, LOCAL_TIER_BAD_EXIT_CODE
        return tuple(out)

    return train_step


def _wrap_validate_result(upstream):
    @functools.wraps(upstream)
    def validate_result(self, result, rejection_func, message, comparison_func=None,
                        tolerance=0.0, fatal=True):
        st = _STATE
        if st is not None and st.deferring and fatal:
            from megatron.core.rerun_state_machine import RerunMode

            if bool(rejection_func(result)):
                text = f"{message} (result {_short(result, 60)})"
                if text not in st.deferred:
                    st.deferred.append(text)
                if self.mode == RerunMode.DISABLED:
                    return None  # decided collectively at the end of the iteration
        return upstream(self, result, rejection_func, message, comparison_func, tolerance, fatal)

    return validate_result


# ---------------------------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------------------------


def installed() -> bool:
    return _STATE is not None


def loaded_local_iteration() -> Optional[int]:
    """The local iteration this process resumed from (after validation), else ``None``."""
    return None if _STATE is None else _STATE.local_load_iteration


def install(args: Any) -> None:
    """Install the validated local tier for ``args`` (``install_training_hooks`` calls it).

    Does nothing unless ``args.non_persistent_ckpt_type == 'local'`` and
    ``args.local_tier_validation``. Idempotent: a second call only updates the settings.

    Raises:
        RuntimeError: the upstream functions this module wraps are missing or changed signature
            (a megatron-core other than the pinned 0.19.2), naming the function; raised on every
            rank before any process group exists.
    """
    global _STATE
    if getattr(args, "non_persistent_ckpt_type", None) != "local":
        return
    validation = bool(getattr(args, "local_tier_validation", True))
    if not validation:
        return
    window = getattr(args, "local_tier_nan_window", None)
    window = DEFAULT_NAN_WINDOW if window is None else int(window)
    if _STATE is not None:
        _STATE.validation, _STATE.nan_window = validation, window
        return

    import megatron.core.rerun_state_machine as rsm
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as training
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )

    expected = {
        (checkpointing, "_load_base_checkpoint"): ("load_dir", "args", "checkpointing_context"),
        (checkpointing, "_get_non_persistent_iteration"): ("args", "checkpointing_context"),
        (checkpointing, "_load_non_persistent_base_checkpoint"):
            ("args", "rank0", "non_persistent_iteration", "checkpointing_context"),
        (training, "train_step"): ("iteration",),
    }
    for (mod, name), params in expected.items():
        fn = getattr(mod, name, None)
        if fn is None or not set(params) <= set(inspect.signature(fn).parameters):
            raise RuntimeError(f"local_tier: {mod.__name__}.{name} is missing or has changed "
                               f"(expected parameters {params}); this module targets "
                               f"megatron-core 0.19.2")
    if (rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE, rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION) != _RERUN_EXIT_CODES:
        raise RuntimeError("local_tier: upstream rerun exit codes changed")

    _STATE = _State(validation=validation, nan_window=window)
    for owner, name, wrap in (
        (checkpointing, "_load_base_checkpoint", _wrap_load_base_checkpoint),
        (checkpointing, "_get_non_persistent_iteration", _wrap_get_non_persistent_iteration),
        (checkpointing, "_load_non_persistent_base_checkpoint", _wrap_load_non_persistent),
        (training, "train_step", _wrap_train_step),
        (rsm.RerunStateMachine, "validate_result", _wrap_validate_result),
        (LocalCheckpointManager, "save", _wrap_save),
        (LocalCheckpointManager, "_save", _wrap_file_save),
        (LocalCheckpointManager, "_cleanup", _wrap_cleanup),
    ):
        original = getattr(owner, name)
        _UP[name] = original
        _PATCHER.replace(owner, name, wrap(original))
    logger.info("local_tier: validated local checkpoint tier installed (NaN window %d)", window)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    global _STATE
    _PATCHER.restore()
    _UP.clear()
    _STATE = None
