"""The validated local checkpoint tier: local checkpoints are used only when they are the right
run, iteration and topology; a bad copy is repaired from a verified replica; an interrupted save
never blocks a later one; a NaN right after a local resume sends the next start to the persistent
tier.

Upstream (megatron-core 0.19.2 with NVRx 0.7.0) loads whatever local files it finds: another
experiment's, another topology's (an assertion deep in the load, or a hang), a corrupt primary
(rejected wholesale although a replica is good); and a ``*.dirty.pt`` left by a killed save makes
every later save of that iteration fail. :class:`ValidatedLocalCheckpointManager` (the class
``pretrain()`` builds while this is installed) changes that; the rules (identity, topology,
repair, fallback, clean-up, markers, exit code 75) are in ``docs/local-tier.md``.

Flags (``megatron/training_ext/args.py``): ``--no-local-tier-validation`` (upstream behaviour),
``--local-tier-nan-window N``, ``--local-tier-run-id ID``.
"""

from __future__ import annotations

import hashlib
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
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)

from megatron.fixes.registry import Patcher, wraps_upstream
from megatron.integrity import checksums as ck
from megatron.integrity import collective, local_identity, local_layout
from megatron.integrity.tensors import is_quantized
from megatron.training_ext.console import write_line

logger = logging.getLogger("megatron.training_ext.local_tier")

__all__ = [
    "DEFAULT_NAN_WINDOW",
    "FINITE_ATTR",
    "LOCAL_TIER_BAD_EXIT_CODE",
    "LOG_PREFIX",
    "MARKER_NAME",
    "QUARANTINE_DIR",
    "ValidatedLocalCheckpointManager",
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

MARKER_NAME = local_layout.MARKER_NAME
"""Marker file, one per rank, in the rank's local checkpoint directory \
(``<root>/<session>/<rank>``)."""

QUARANTINE_DIR = local_layout.QUARANTINE_DIR
"""Sub-directory of a rank's local checkpoint directory that receives rejected local checkpoint
files (removed with the marker by the next local save complete on all ranks)."""

FINITE_ATTR = "_megatron_local_tier_finite"
"""Attribute of a saved ``TensorAwareStateDict``: ``{"format", "version", "owner_rank",
"finite": [True | False | None per tensor, in ``tensors`` order]}``."""

FINITE_FORMAT = "megatron.local_tier.finite"
MARKER_FORMAT = "megatron.local_tier.bad_marker"
LOG_PREFIX = "[local-tier]"

_RERUN_EXIT_CODES = (16, 17)  # megatron.core.rerun_state_machine EXIT_CODE_* (checked at install)
_FINITE_CHUNK = 1 << 26  # elements per isfinite() pass in the fallback (bounds the bool temporary)
_NONFINITE_WORDS = re.compile(r"\bnan\b|\binf\b|non-?finite", re.IGNORECASE)


@dataclass
class _State:
    validation: bool
    nan_window: int
    args: Any = None
    settings: Optional[dict] = None  # local_identity.run_settings(args) at install
    topology: Optional[dict] = None  # local_identity.topology(args) at install
    force_persistent: bool = False
    rejected_reason: Optional[str] = None
    local_load_iteration: Optional[int] = None
    manager: Any = None
    marker_written: bool = False
    deferring: bool = False
    deferred: List[str] = field(default_factory=list)
    warned_unverified: bool = False


_STATE: Optional[_State] = None
_PATCHER = Patcher("local_tier")
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
    return collective.all_gather_object(obj)


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
    shown = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {_short(t, 300)}"
        for t, rs in items[:limit]
    )
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return shown + more


def _tensor_keys(state_dict: Any, count: int) -> List[tuple]:
    """(key, global_offset) per tensor of a non-hollow state dict, in ``tensors`` order."""
    try:
        sharded = list(state_dict._sharded_tensors)
        if len(sharded) == count:
            return [(str(s.key), tuple(int(o) for o in s.global_offset)) for s in sharded]
    except Exception:  # noqa: BLE001 - not an MCoreTensorAwareStateDict
        pass
    return [(f"tensor[{i}]", None) for i in range(count)]


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
            ok = ok & torch.isfinite(flat[start : start + _FINITE_CHUNK]).all()
        return ok


def _finite_flags(tensors: List[torch.Tensor]) -> List[Optional[bool]]:
    """Per tensor: True/False = all values finite or not; None = not determinable (quantized or
    exotic tensors). Integer/bool tensors are True. One host synchronisation in all."""
    flags: List[Optional[bool]] = [None] * len(tensors)
    pending: List[tuple[int, torch.Tensor]] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or is_quantized(t):
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
        _say(
            f"local checkpoint at iteration {iteration} is complete on all ranks: removed "
            f"{' and '.join(removed)}"
        )


# ---------------------------------------------------------------------------------------------
# the manager: identity on save, validated resolution on load
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
    """Checksums (optional) and finiteness of one loaded state dict, in one pass over each host
    tensor's bytes (:func:`megatron.integrity.verify.fused_scan`); (errors, summary)."""
    from megatron.integrity.verify import fused_scan

    st = _STATE
    errors: List[str] = []
    tensors = list(state_dict.tensors)
    keys = [k for k, _ in _tensor_keys(state_dict, len(tensors))]
    done = []
    entries = None
    if check_checksums:
        try:
            record = ck.get_record(state_dict)
        except ValueError as e:
            record = None
            errors.append(f"{what}: {e}")
        if record is not None:
            entries = record["entries"]
            if len(entries) != len(tensors):
                errors.append(
                    f"ChecksumMismatchError: {what}: {len(tensors)} tensors, the record "
                    f"lists {len(entries)}"
                )
                entries = None
            else:
                done.append(f"{len(tensors)} checksums")
        elif not errors and st is not None and not st.warned_unverified:
            st.warned_unverified = True
            logger.warning(
                "%s has no checksum record (written without checksums): checksums not verified",
                what,
            )
    else:
        done.append("checksums verified in transit")
    flags = None
    finite = getattr(state_dict, FINITE_ATTR, None)
    if isinstance(finite, dict) and finite.get("format") == FINITE_FORMAT:
        flags = finite.get("finite") or []
        if len(flags) != len(tensors):
            errors.append(
                f"{what}: finiteness record lists {len(flags)} tensors, the state dict "
                f"has {len(tensors)}"
            )
            flags = None
    mismatches, bad, slow_finite = [], [], []
    for i, t in enumerate(tensors):
        want_sum, want_fin = entries is not None, flags is not None and flags[i] is True
        if not (want_sum or want_fin):
            continue
        plain = (
            type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.device.type == "cpu"
            and t.is_contiguous()
        )
        if plain:
            # fused_scan hashes with xxh3 only; other algorithms (pmix64) verify_tensor computes
            xxh3 = want_sum and entries[i].get("algorithm", ck.ALGORITHM) == ck.ALGORITHM
            csum, _, nonfinite = fused_scan(t.detach(), None, xxh3, want_fin)
            if want_fin and nonfinite:
                bad.append(keys[i])
        else:
            csum = None
            if want_fin:
                slow_finite.append(i)
        if want_sum:
            m = ck.verify_tensor(entries[i], t, checksum=csum)
            if m is not None:
                mismatches.append(m)
    if slow_finite:
        bad += [
            keys[i]
            for i, ok in zip(slow_finite, _finite_flags([tensors[i] for i in slow_finite]))
            if ok is False
        ]
    errors += [f"ChecksumMismatchError: {what}: {m}" for m in mismatches[:3]]
    if len(mismatches) > 3:
        errors.append(f"{what}: ... {len(mismatches) - 3} more checksum mismatches")
    if flags is not None:
        if bad:
            errors.append(
                f"{what}: {len(bad)} tensor(s) hold NaN/Inf where the primary (rank "
                f"{finite.get('owner_rank')}) saved finite values: {bad[:3]}"
            )
        done.append(f"{sum(1 for f in flags if f is True)} tensors finite")
    return errors, ", ".join(done) or "nothing to verify"


def _fingerprint(state_dict: Any) -> Optional[str]:
    """Digest of a file's stored checksum record (key, offset, dtype, shape, checksum per tensor):
    equal for copies of one shard; ``None`` without a record."""
    try:
        record = ck.get_record(state_dict)
    except ValueError:
        return None
    if record is None:
        return None
    rows = [
        (e.get("key"), e.get("global_offset"), e.get("dtype"), e.get("shape"), e.get("checksum"))
        for e in record.get("entries", [])
    ]
    return hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest()[:16]


@dataclass
class _Copy:
    """One local file of a candidate iteration, as its holder judged it (gathered to all ranks)."""

    iteration: int
    owner: int
    holder: int
    problem: Optional[str]  # why it cannot be used; None: usable so far
    run_id: Optional[str] = None
    token: Optional[str] = None
    fingerprint: Optional[str] = None
    foreign: Optional[str] = None  # why its run id differs from this rank's (which settings)
    bytes_verified: bool = False  # checksums and finiteness checked against the bytes


@dataclass
class _Report:
    """What one rank found at the start of a load (gathered to all ranks)."""

    rank: int
    host: str
    identity: tuple  # (run id, source, run settings, topology)
    generation: str
    marker: Optional[dict]
    persistent: Optional[int]
    copies: List[_Copy]
    leftovers: List[str]


@dataclass
class _Resolution:
    """The collective decision of a load: which local iteration, and where each shard comes from."""

    iteration: int  # -1: not the local tier
    state_dict: Any = None
    ckpt_id: Any = None
    line: str = ""


def _no_verified_copy(owner: int, copies: List[_Copy]) -> str:
    """Why no copy of ``owner``'s shard can be used: each copy's holder, role and problem."""
    detail = (
        "; ".join(
            f"rank {c.holder}'s {'primary' if c.holder == owner else 'replica'}: {c.problem}"
            for c in copies
        )
        or "no copy on any rank"
    )
    return f"no verified copy of rank {owner}'s shard ({_short(detail, 500)})"


def _describe_marker(rank: int, m: dict) -> str:
    if "iteration" in m:
        return (
            f"rank {rank} marked the local tier bad at iteration {m.get('iteration')} "
            f"(resumed from local iteration {m.get('local_checkpoint_iteration')}, "
            f"{m.get('time', '?')}): {_short(m.get('reason', '?'), 200)}"
        )
    return f"rank {rank}: {m.get('reason')}"


def _markers_reason(reports: List[_Report]) -> Optional[str]:
    found = [(r.rank, r.marker) for r in reports if r.marker is not None]
    if not found:
        return None
    first = _describe_marker(*found[0])
    more = f" (markers on ranks {[r for r, _ in found]})" if len(found) > 1 else ""
    return f"bad-tier marker {MARKER_NAME} found: {first}{more}"


def _persistent_iteration(load_dir: Optional[str]) -> Optional[int]:
    """The newest persistent iteration per upstream's tracker file (no collectives)."""
    if not load_dir:
        return None
    from megatron.training import checkpointing

    try:
        with open(checkpointing.get_checkpoint_tracker_filename(load_dir)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _megatron_args() -> Any:
    st = _STATE
    if st is not None and st.args is not None:
        return st.args
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except Exception:  # noqa: BLE001 - not inside pretrain()
        return None


class ValidatedLocalCheckpointManager(LocalCheckpointManager):
    """NVRx ``LocalCheckpointManager`` (0.7.0) whose checkpoints are only used when they are the
    right run, iteration and topology, are repaired from verified replicas, and whose saves are
    never blocked by an interrupted earlier save.

    ``pretrain()`` builds it (it imports ``LocalCheckpointManager`` inside the function; while the
    validated tier is installed that name is this class). Same constructor and contract as upstream.

    * ``save``: records per tensor whether it is finite and the identity of the shard
      (:mod:`megatron.integrity.local_identity`: run id, topology, iteration, owner, save token);
      both travel with the hollow state dict to every replica. Before the first save of a process,
      leftovers of an interrupted save (``*.dirty.pt``) are removed.
    * ``_save``: attaches checksums when there is no replication (the replication fix does with
      replication) and replaces a stale ``.dirty.pt`` instead of failing on it.
    * ``find_latest`` (first call of a process, i.e. the load): the collective resolution
      described in ``docs/local-tier.md``; returns the local iteration to load, or -1 to make
      upstream load the persistent tier. Later calls (save finalization) are upstream's.
    * ``load``: returns the state dict the resolution verified (and repaired), without reading
      the files again.

    Raises (``find_latest``/``load``): nothing of its own for bad local files (they are rejected
    collectively, with one ``[local-tier]`` line per rank); ``CheckpointingException`` when
    ``load`` is called before ``find_latest`` (as upstream).
    """

    def __init__(self, root_local_ckpt_dir, session_id: str = "", repl_strategy=None):
        super().__init__(root_local_ckpt_dir, session_id=session_id, repl_strategy=repl_strategy)
        self._resolution: Optional[_Resolution] = None
        self._generation: Optional[str] = None
        self._identity: Optional[tuple] = None
        self._saved = False
        self._loads_served = 0
        self.timings: dict[
            str, float
        ] = {}  # seconds of the start: total, headers, own_primary, agree, repair, identity

    # -------------------------------------------------------------------- pickling (async save)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_resolution"] = None  # never ship the loaded state dict to a worker
        return state

    # ------------------------------------------------------------------------------- identity

    def _identity_parts(self) -> tuple[str, str, dict, dict]:
        """(run id, its source, run settings, topology): the agreed values once a collective
        settled them, else this rank's own (rank 0 creates the run token in ``--save``)."""
        if self._identity is not None:
            return self._identity
        args = _megatron_args()
        st = _STATE
        token = local_identity.run_token(getattr(args, "save", None), create=_rank() == 0)
        run_id, source, settings = local_identity.run_identity(
            args, token, st.settings if st is not None else None
        )
        topo = (
            st.topology
            if st is not None and st.topology is not None
            else local_identity.topology(args)
        )
        return run_id, source, settings, dict(topo)

    def _agree_generation(self) -> str:
        """Collective (first call only): rank 0's run identity and a token shared by every rank
        of this process generation (the save token of every file it writes)."""
        if self._generation is None:
            gen, ident = _gather((uuid.uuid4().hex, self._identity_parts()))[0]
            self._generation, self._identity = gen, tuple(ident)
        return self._generation

    # ----------------------------------------------------------------------------------- save

    def save(self, state_dict, iteration, is_async=False):
        generation = self._agree_generation()
        if not self._saved:
            self._saved = True
            self._resolution = None  # release what the load held
            removed = self._remove_dirty()
            if removed:
                _say(
                    f"removed {len(removed)} leftover(s) of an interrupted save: "
                    f"{', '.join(removed)}"
                )
        tensors = list(state_dict.tensors)
        setattr(
            state_dict,
            FINITE_ATTR,
            {
                "format": FINITE_FORMAT,
                "version": 1,
                "owner_rank": _rank(),
                "finite": _finite_flags(tensors),
            },
        )
        run_id, source, settings, topo = self._identity_parts()
        setattr(
            state_dict,
            local_identity.IDENTITY_ATTR,
            local_identity.make_identity(
                run_id, source, settings, topo, iteration, _rank(), generation, socket.gethostname()
            ),
        )
        return super().save(state_dict, iteration, is_async)

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
                    entries = [
                        ck.make_entry(i, k, t, global_offset=o)
                        for i, ((k, o), t) in enumerate(zip(names, tensors))
                    ]
                    ck.attach_record(state_dict, ck.make_record(ckpt_id[1], entries))
                except (TypeError, ValueError) as e:  # quantized/meta tensors: save unverified
                    logger.warning("local checkpoint %s saved without checksums: %s", ckpt_id, e)
        stale = self._local_ckpt_path_from_id(ckpt_id, True)
        if stale.exists():  # an interrupted save of this iteration: only this rank writes here
            logger.warning(
                "local checkpoint: replacing the leftover %s of an interrupted save", stale
            )
            stale.unlink(missing_ok=True)
        return super()._save(state_dict, ckpt_id)

    def _cleanup(self, iteration):
        result = super()._cleanup(iteration)
        _clear_marker(self, iteration)
        return result

    def _remove_dirty(self) -> List[str]:
        d = Path(self.local_ckpt_dir)
        removed = []
        if d.is_dir():
            for p in sorted(d.iterdir()):
                parsed = local_layout.parse_local_name(p.name)
                if parsed is not None and parsed[2] and p.is_file():
                    p.unlink(missing_ok=True)
                    removed.append(p.name)
        return removed

    # ----------------------------------------------------------------------------------- load

    def find_latest(self):
        if self._saved or _STATE is None or not (dist.is_available() and dist.is_initialized()):
            return super().find_latest()
        if self._resolution is None:
            self._resolution = self._resolve()
        self.latest_iteration = self._resolution.iteration
        return self._resolution.iteration

    def load(self):
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
            CheckpointingException,
        )

        res = self._resolution
        if res is None or res.iteration == -1 or res.state_dict is None:
            if self.latest_iteration == -1:
                raise CheckpointingException(
                    "The 'find_latest' method must be called before invoking the 'load' function."
                )
            return super().load()
        st = _STATE
        st.manager = self
        st.local_load_iteration = res.iteration
        self._loads_served += 1
        sd, cid = res.state_dict, res.ckpt_id
        if self._loads_served >= 2:  # upstream reads twice (arguments, then the state)
            res.state_dict = None
        return sd, cid

    # --------------------------------------------------------------------------- resolution

    def _inspect(
        self, run_id: str, settings: dict, topo: dict
    ) -> tuple[List[_Copy], dict, List[str]]:
        """This rank's local files: the header of every copy (memory-mapped, no tensor data read),
        and the own primary of the newest iteration fully loaded and verified (checksums,
        finiteness). Returns (copies, {ckpt_id: (state dict, summary)}, leftovers removed)."""
        me = _rank()
        leftovers = self._remove_dirty()
        files = []
        d = Path(self.local_ckpt_dir)
        if d.is_dir():
            for p in d.iterdir():
                parsed = local_layout.parse_local_name(p.name)
                if parsed is not None and not parsed[2] and p.is_file():
                    files.append((parsed[0], parsed[1], p))
        own_iters = [it for it, owner, _ in files if owner == me]
        speculative = max(own_iters) if own_iters else None
        copies, loaded = [], {}
        for it, owner, path in sorted(files, key=lambda x: (-x[0], x[1])):
            c = _Copy(it, owner, me, None)
            copies.append(c)
            try:
                try:
                    header = local_identity.read_header(path)
                except Exception:  # noqa: BLE001 - let torch tell what is wrong with the file
                    header = torch.load(path, mmap=True, weights_only=False)
                rec = local_identity.get_identity(header)
            except Exception as e:  # noqa: BLE001 - a truncated/unreadable file is this copy's problem
                c.problem = f"unreadable: {_exc_text(e)}"
                continue
            problems = local_identity.identity_problems(rec, run_id, settings, topo, it, owner)
            if rec is not None:
                c.run_id, c.token = rec.get("run_id"), rec.get("save_token")
                if c.run_id != run_id:  # decided collectively against the agreed run id
                    c.foreign, problems = problems[0], problems[1:]
            c.problem = "; ".join(problems) or None
            c.fingerprint = _fingerprint(header)
            del header
            if c.problem is None and c.foreign is None and owner == me and it == speculative:
                self._verify_own(c, loaded)
        return copies, loaded, leftovers

    def _verify_own(self, c: _Copy, loaded: dict) -> None:
        """Load this rank's primary ``c`` as upstream does and check it against its checksums and
        finiteness record; sets ``c.problem`` or stores it in ``loaded``."""
        cid = self._ckpt_id(c.iteration)
        t0 = time.perf_counter()
        try:
            sd = self._load(cid)  # host tensors as stored: verified before they go to the device
            errors, summary = _verify(sd, f"rank {c.holder}'s primary", check_checksums=True)
            sd.restore_tensor_device(non_blocking=False)
        except Exception as e:  # noqa: BLE001
            errors, summary = [f"unreadable: {_exc_text(e)}"], ""
        self.timings["own_primary"] = (
            self.timings.get("own_primary", 0.0) + time.perf_counter() - t0
        )
        c.bytes_verified = True
        if errors:
            c.problem = _short("; ".join(errors), 400)
        else:
            loaded[cid] = (sd, summary)

    def _resolve(self) -> _Resolution:
        """Collective: decide what this load uses (see the class docstring)."""
        st = _STATE
        st.manager = self
        me, world = _rank(), dist.get_world_size()
        t0 = time.perf_counter()
        identity = self._identity_parts()
        run_id, _, settings, topo = identity
        args = _megatron_args()
        load_dir = getattr(args, "load", None)
        copies, loaded, leftovers = self._inspect(run_id, settings, topo)
        mine = _Report(
            me,
            socket.gethostname(),
            identity,
            uuid.uuid4().hex,
            read_marker(self.local_ckpt_dir),
            _persistent_iteration(load_dir),
            copies,
            leftovers,
        )
        t_gather = time.perf_counter()
        self.timings["headers"] = t_gather - t0 - self.timings.get("own_primary", 0.0)
        reports: List[_Report] = _gather(mine)
        self.timings["agree"] = time.perf_counter() - t_gather
        self._generation, self._identity = reports[0].generation, tuple(reports[0].identity)
        agreed_run = self._identity[0]
        if run_id != agreed_run:
            logger.info(
                "rank %d derives run id %s, rank 0 %s: using rank 0's", me, run_id, agreed_run
            )
        persistent = reports[0].persistent
        notes = (
            [
                f"removed {len(leftovers)} leftover(s) of an interrupted save "
                f"({', '.join(leftovers)})"
            ]
            if leftovers
            else []
        )

        reason = _markers_reason(reports)
        if reason is not None:
            return self._fall_back(reason, load_dir, persistent, notes)
        all_copies = [c for r in reports for c in r.copies]
        for c in all_copies:  # the agreed run id decides for everyone
            if c.problem is None and c.run_id != agreed_run:
                c.problem = c.foreign or (
                    f"written by another run (run id {c.run_id}, this run "
                    f"{agreed_run}; {local_identity.RUN_ID_FLAG} sets the id "
                    f"explicitly)"
                )
        self.globally_available_ids = [
            [(c.iteration, c.owner, self.session_id) for c in r.copies] for r in reports
        ]
        iterations = sorted({c.iteration for c in all_copies}, reverse=True)
        if not iterations:
            return self._fall_back(None, load_dir, persistent, notes)
        if persistent is not None and iterations[0] < persistent:
            _say(
                f"local checkpoint at iteration {iterations[0]} is older than the persistent "
                f"checkpoint at iteration {persistent} in {load_dir}: loading the persistent one"
                + "".join(f"; {n}" for n in notes)
            )
            return _Resolution(iterations[0])
        hosts = {r.rank: r.host for r in reports}
        why_not: List[str] = []
        for it in iterations:
            if persistent is not None and it < persistent:
                break
            res = self._try_iteration(it, all_copies, hosts, loaded, world, why_not, notes, t0)
            if res is not None:
                self._quarantine(
                    keep=it,
                    bad=[
                        c
                        for c in all_copies
                        if c.holder == me and c.iteration == it and c.problem is not None
                    ],
                )
                return res
            # newer than what can be used: never offered again
        if len(why_not) == 1:
            why_not = [why_not[0].split(": ", 1)[1]]  # the iteration is named in front
        reason = f"local checkpoint at iteration {iterations[0]} failed verification: " + "; ".join(
            why_not
        )
        return self._fall_back(reason, load_dir, persistent, notes)

    def _try_iteration(
        self,
        it: int,
        all_copies: List[_Copy],
        hosts: dict,
        loaded: dict,
        world: int,
        why_not: List[str],
        notes: List[str],
        t0: float,
    ) -> Optional[_Resolution]:
        """Collective: use local iteration ``it`` if every shard has a verified copy, repairing
        shards from replicas; None (on every rank) when it cannot be used, reason in ``why_not``."""
        me = _rank()
        copies = [c for c in all_copies if c.iteration == it]
        # all copies of one save carry its save token: a copy of another save is out-voted
        tokens = Counter(c.token for c in copies if c.problem is None)
        if tokens:
            (best, n), *rest = tokens.most_common()
            if rest and rest[0][1] == n:
                why_not.append(
                    f"iteration {it}: copies of {len(tokens)} different saves, none in a majority"
                )
                return None
            for c in copies:
                if c.problem is None and c.token != best:
                    c.problem = (
                        f"from another save of iteration {it} (save token {c.token}, "
                        f"the others {best})"
                    )
        # cross-check: each shard's copies must agree with its verified primary
        by_owner: dict[int, List[_Copy]] = {}
        for c in copies:
            by_owner.setdefault(c.owner, []).append(c)
        for owner, cs in by_owner.items():
            prim = next((c for c in cs if c.holder == owner and c.problem is None), None)
            good = [c for c in cs if c.problem is None]
            ref = (
                prim.fingerprint
                if prim is not None
                else Counter(c.fingerprint for c in good).most_common(1)[0][0]
                if good
                else None
            )
            for c in good:
                if ref is not None and c.fingerprint is not None and c.fingerprint != ref:
                    c.problem = (
                        f"its checksums differ from "
                        f"{'the primary' if prim is not None else 'the other copies'}"
                        f" of rank {owner}'s shard"
                    )
        distinct = {c.problem for c in copies}
        if copies and None not in distinct and len(distinct) == 1:
            why_not.append(f"iteration {it}: every copy on every rank was {distinct.pop()}")
            return None
        missing = []
        for owner in range(world):
            cs = by_owner.get(owner, [])
            if not any(c.problem is None for c in cs):
                missing.append(_no_verified_copy(owner, cs))
        if missing:
            why_not.append(f"iteration {it}: " + "; ".join(missing))
            return None
        strategy = self.repl_strategy
        my_id = self._ckpt_id(it)
        pending = [
            c for c in copies if c.holder == c.owner and c.problem is None and not c.bytes_verified
        ]
        if pending:  # not the newest own iteration of some rank: verify those primaries now
            for c in pending:
                if c.holder == me:
                    self._verify_own(c, loaded)
            late = _gather([(c.owner, c.problem) for c in pending if c.holder == me])
            for entries in late:
                for owner, problem in entries:
                    for c in by_owner.get(owner, []):
                        if c.holder == owner:
                            c.problem, c.bytes_verified = problem, True
        need = sorted(
            o
            for o in range(world)
            if not any(c.problem is None and c.holder == o for c in by_owner.get(o, []))
        )
        if need and strategy is None:
            why_not.append(
                f"iteration {it}: rank(s) {need} have no usable primary and there is no "
                f"replication to repair from: "
                + "; ".join(
                    f"rank {o}: "
                    f"{next((c.problem for c in by_owner.get(o, []) if c.holder == o), 'missing')}"
                    for o in need
                )
            )
            return None
        if not need:
            sd, summary = loaded[my_id]
            line = (
                f"local checkpoint at iteration {it} verified on all ranks: own primary ({summary})"
                if me == 0
                else f"local checkpoint at iteration {it}: own primary verified ({summary})"
            )
            return self._resolved(it, sd, my_id, line, all_copies, notes, t0)
        return self._repair(it, by_owner, need, hosts, loaded, why_not, notes, all_copies, t0)

    def _repair(self, it, by_owner, need, hosts, loaded, why_not, notes, all_copies, t0):
        """Collective: retrieve the shards of the ranks in ``need`` from verified replicas."""
        t_repair = time.perf_counter()
        try:
            return self._repair_attempts(
                it, by_owner, need, hosts, loaded, why_not, notes, all_copies, t0
            )
        finally:
            self.timings["repair"] = time.perf_counter() - t_repair

    def _repair_attempts(self, it, by_owner, need, hosts, loaded, why_not, notes, all_copies, t0):
        me = _rank()
        strategy = self.repl_strategy
        my_id = self._ckpt_id(it)
        clique = list(getattr(strategy.local_group, "ranks", range(dist.get_world_size())))
        for _attempt in range(4):
            available = [[] for _ in range(dist.get_world_size())]
            for o, cs in by_owner.items():
                for c in cs:
                    if c.problem is None:
                        available[c.holder].append((it, o, self.session_id))
            uncovered = [o for o in need if not any(c.problem is None for c in by_owner.get(o, []))]
            if uncovered:
                why_not.append(
                    f"iteration {it}: "
                    + "; ".join(_no_verified_copy(o, by_owner.get(o, [])) for o in uncovered)
                )
                return None
            plan = None
            errors: List[str] = []
            sent: List[tuple] = []
            if any(o in clique for o in need):
                try:
                    plan = strategy.retrieve_plan(available, [my_id])
                except Exception as e:  # noqa: BLE001 - same on every rank of the clique
                    errors.append(f"no retrieval plan: {_exc_text(e)}")
                if plan is not None:
                    for entry in plan.entries:
                        if entry.sender == me and entry.receiver != me:
                            cid = entry.id_
                            try:
                                sd = self._load(cid)  # verified on the host, then to the device
                                errs, _ = _verify(
                                    sd, f"rank {me}'s replica of rank {cid[1]}'s shard", True
                                )
                                sd.restore_tensor_device(non_blocking=False)
                            except Exception as e:  # noqa: BLE001
                                sd, errs = None, [f"unreadable: {_exc_text(e)}"]
                            if errs:
                                sent.append((cid[1], me, _short("; ".join(errs), 400)))
                            else:
                                loaded[cid] = (sd, "")
            verdicts = _gather((sent, errors))
            bad = [b for s, _ in verdicts for b in s]
            plan_errors = [e for _, es in verdicts for e in es]
            if plan_errors:
                why_not.append(f"iteration {it}: " + "; ".join(plan_errors[:2]))
                return None
            if bad:
                for owner, holder, problem in bad:
                    for c in by_owner.get(owner, []):
                        if c.holder == holder:
                            c.problem = problem
                continue
            # every replica to be sent verified: exchange (the fixed strategy verifies again)
            received, errs = None, []
            if plan is not None:
                my_data = {cid: loaded[cid][0] for cid in plan.required_ids()}
                try:
                    received = strategy.retrieve_execute(plan, my_data)
                except Exception as e:  # noqa: BLE001 - ChecksumMismatchError on every clique rank
                    errs.append(_exc_text(e))
            summary, source = "", None
            if not errs and me in need:
                sd = received.get(my_id) if received else None
                if sd is None:
                    errs.append(
                        f"retrieval returned {sorted(received or {}, key=str)}, expected {my_id}"
                    )
                else:
                    source = next(e.sender for e in plan.entries if e.receiver == me)
                    verify_errs, summary = _verify(
                        sd,
                        f"rank {me}'s shard received from rank {source}",
                        not _strategy_verifies(strategy),
                    )
                    errs += verify_errs
                    loaded[my_id] = (sd, summary)
            outcome = _gather(errs)
            if any(outcome):
                why_not.append(f"iteration {it}: repair failed: {_summarize(outcome)}")
                return None
            sd, summary0 = loaded[my_id]
            if me in need:
                own = next((c.problem for c in by_owner.get(me, []) if c.holder == me), "missing")
                line = (
                    f"local checkpoint at iteration {it}: repaired from rank {source}'s replica on "
                    f"host {hosts.get(source, '?')} (verified: {summary}); own primary: "
                    f"{_short(own, 300)}"
                )
            else:
                line = (
                    f"local checkpoint at iteration {it}"
                    f"{' verified on all ranks' if me == 0 else ''}: "
                    f"own primary ({summary0}); repaired rank(s) {need} from replicas"
                )
            return self._resolved(it, sd, my_id, line, all_copies, notes, t0)
        why_not.append(f"iteration {it}: no replica verified after several attempts")
        return None

    def _resolved(self, it, sd, cid, line, all_copies, notes, t0) -> _Resolution:
        me = _rank()
        bad = [
            c
            for c in all_copies
            if c.holder == me and c.iteration == it and c.problem is not None and c.owner != me
        ]
        extra = list(notes)
        if bad:
            extra.append(
                f"moved {len(bad)} bad replica(s) to {QUARANTINE_DIR}/: "
                + "; ".join(f"rank {c.owner}'s shard: {_short(c.problem, 200)}" for c in bad)
            )
        tm = self.timings
        tm["total"] = time.perf_counter() - t0
        # the checks' own work: headers, decision, quarantine (not the load, the repair, or the
        # wait in the one all_gather_object, where upstream waits in its own collectives)
        tm["identity"] = (
            tm["total"] - tm.get("own_primary", 0.0) - tm.get("repair", 0.0) - tm.get("agree", 0.0)
        )
        logger.info(
            "local tier start: %s",
            ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(tm.items())),
        )
        _say(line + "".join(f"; {n}" for n in extra) + f" [{tm['total']:.2f} s]")
        return _Resolution(it, sd, cid, line)

    def _quarantine(self, keep: Optional[int] = None, bad: Sequence[_Copy] = ()) -> int:
        """Move this rank's local files into ``rejected/``: every file when ``keep`` is None, else
        the files of iterations newer than ``keep`` and the ``bad`` copies of ``keep``."""
        d = Path(self.local_ckpt_dir)
        if not d.is_dir():
            return 0
        bad_names = {self._filename_from_template(c.iteration, c.owner) for c in bad}
        moving = []
        for p in d.iterdir():
            parsed = local_layout.parse_local_name(p.name)
            if parsed is None or not p.is_file():
                continue
            if keep is None or parsed[0] > keep or p.name in bad_names:
                moving.append(p)
        if not moving:
            return 0
        rejected = d / QUARANTINE_DIR
        if rejected.exists() and not self._quarantined_once:
            shutil.rmtree(rejected, ignore_errors=True)
        self._quarantined_once = True
        rejected.mkdir(parents=True, exist_ok=True)
        for p in moving:
            os.replace(p, rejected / p.name)
        return len(moving)

    _quarantined_once = False

    def _fall_back(self, reason: Optional[str], load_dir, persistent, notes) -> _Resolution:
        """Every rank: this process does not use the local tier; quarantine, say why (one line)."""
        st = _STATE
        moved = self._quarantine()
        target = (
            f"the newest persistent checkpoint: iteration {persistent} in {load_dir}"
            if persistent
            else f"no persistent checkpoint in {load_dir}: starting from initialization"
            if load_dir
            else "no --load directory: starting from initialization"
        )
        extra = list(notes)
        if moved:
            extra.append(
                f"{moved} local checkpoint file(s) moved to "
                f"{Path(self.local_ckpt_dir) / QUARANTINE_DIR}"
            )
        if reason is None:
            line = f"no local checkpoint in {self.local_ckpt_dir} -> loading {target}"
        else:
            st.force_persistent, st.rejected_reason = True, reason
            line = f"local checkpoint tier rejected: {reason} -> loading {target}"
        _say(line + "".join(f"; {n}" for n in extra))
        return _Resolution(-1, line=line)


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
    _say(
        f"non-finite result at iteration {iteration} after resuming from the local checkpoint at "
        f"iteration {st.local_load_iteration} ({_short(reason, 300)}); wrote {path}; exiting "
        f"with code {LOCAL_TIER_BAD_EXIT_CODE}"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LOCAL_TIER_BAD_EXIT_CODE)


def _wrap_train_step(upstream):
    sig = inspect.signature(upstream)

    @wraps_upstream(upstream)
    def train_step(*a, **kw):
        """Upstream's ``train_step``; inside the NaN window after a local-tier resume, a
        non-finite loss or grad norm marks the local tier bad and exits."""
        st = _STATE
        iteration = sig.bind(*a, **kw).arguments.get("iteration")
        if (
            st is None
            or st.nan_window <= 0
            or st.local_load_iteration is None
            or st.manager is None
            or iteration is None
            or not iteration < st.local_load_iteration + st.nan_window
        ):
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
            reasons.append(
                f"rerun state machine requested exit code {exit_code} (result validation failed)"
            )
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
        _say(
            f"non-finite result at iteration {iteration + 1}, "
            f"{iteration + 1 - st.local_load_iteration} "
            f"iteration(s) after resuming from the local checkpoint at iteration "
            f"{st.local_load_iteration}: marked the local tier bad ({path}) and exiting with code "
            f"{LOCAL_TIER_BAD_EXIT_CODE} without saving; the next start loads the persistent "
            f"checkpoint"
        )
        out = list(out)
        out[0], out[2], out[3], out[4] = {}, False, True, LOCAL_TIER_BAD_EXIT_CODE
        return tuple(out)

    return train_step


def _wrap_validate_result(upstream):
    @wraps_upstream(upstream)
    def validate_result(
        self, result, rejection_func, message, comparison_func=None, tolerance=0.0, fatal=True
    ):
        """Upstream's ``validate_result``; deferred while the NaN window decides."""
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
    ``args.local_tier_validation``. Makes ``LocalCheckpointManager`` (the name ``pretrain()``
    imports) :class:`ValidatedLocalCheckpointManager` and wraps ``train_step`` and
    ``RerunStateMachine.validate_result`` for the NaN window. Idempotent: a second call (a new
    start of training in the same process: another restart attempt) keeps the patches and starts
    from a fresh decision state, so nothing an earlier attempt decided (a rejected local tier, the
    iteration it resumed from, its NaN window, a marker written) carries over: each attempt
    resolves the local tier afresh, as a new process does.

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
    if _STATE is not None:  # same object (holders keep it), every field as for a new process
        vars(_STATE).update(
            vars(
                _State(
                    validation=validation,
                    nan_window=window,
                    args=args,
                    settings=local_identity.run_settings(args),
                    topology=local_identity.topology(args),
                )
            )
        )
        return

    import megatron.core.rerun_state_machine as rsm
    import megatron.training.training as training
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager

    fn = getattr(training, "train_step", None)
    if fn is None or "iteration" not in inspect.signature(fn).parameters:
        raise RuntimeError(
            "local_tier: megatron.training.training.train_step is missing or has "
            "changed (expected a parameter 'iteration'); this module targets "
            "megatron-core 0.19.2"
        )
    if local_manager.LocalCheckpointManager is not LocalCheckpointManager:
        raise RuntimeError(
            "local_tier: nvidia_resiliency_ext LocalCheckpointManager was already "
            f"replaced by {local_manager.LocalCheckpointManager!r}"
        )
    if (
        rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE,
        rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    ) != _RERUN_EXIT_CODES:
        raise RuntimeError("local_tier: upstream rerun exit codes changed")

    _STATE = _State(
        validation=validation,
        nan_window=window,
        args=args,
        settings=local_identity.run_settings(args),
        topology=local_identity.topology(args),
    )
    _PATCHER.replace(
        local_manager,
        "LocalCheckpointManager",
        ValidatedLocalCheckpointManager,
        "pretrain() builds this class: local files are verified (checksums, identity, "
        "finiteness) and a bad local tier falls back to the persistent checkpoint",
    )
    for owner, name, wrap, why in (
        (
            training,
            "train_step",
            _wrap_train_step,
            "the NaN window after a local-tier resume watches each iteration's loss and grad norm",
        ),
        (
            rsm.RerunStateMachine,
            "validate_result",
            _wrap_validate_result,
            "a NaN/Inf loss inside the NaN window marks the local tier bad instead of a rerun",
        ),
    ):
        original = getattr(owner, name)
        _UP[name] = original
        _PATCHER.replace(owner, name, wrap(original), why)
    logger.info("local_tier: validated local checkpoint tier installed (NaN window %d)", window)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    global _STATE
    _PATCHER.restore()
    _UP.clear()
    _STATE = None
