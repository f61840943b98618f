"""Deterministic, test-only fault injection for the training loop (functional tests of the local and
persistent checkpoint tiers). Only the test entrypoint
``tests/functional_tests/pretrain_gpt_faults.py`` installs it (:func:`install_from_env`, after this
fork's training hooks); ``pretrain_gpt.py`` never does.

Environment variables (none set: nothing is installed):

* ``MEGATRON_TEST_FAULT``: a rank crashes before an iteration (:func:`parse_fault`);
* ``MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD=K``: NaN weights after a local-tier resume, and
  ``MEGATRON_TEST_ABORT_ASYNC_SAVE=K``: abort async checkpointing (:func:`install_from_env`);
* ``MEGATRON_TEST_KILL_IN_LOCAL_SAVE``: ``SIGKILL`` during a local save
  (:func:`parse_local_save_kill`, :func:`install_local_save_kill`);
* ``MEGATRON_TEST_LOCAL_DISK_FULL="rank=R,iteration=K"``: rank ``R``'s local disk is full from
  its local save of ``K`` on (:func:`install_local_disk_full`);
* ``MEGATRON_TEST_PERTURB_AFTER_LOAD=1``: after a resume, every rank changes one model value just
  before the first training step; ``MEGATRON_TEST_RNG_LOG=PATH``: each rank appends the digest of
  torch's CPU generator state as each iteration begins to ``PATH.<rank>``
  (:func:`install_step_probes`).
* ``MEGATRON_TEST_FS_TRACE``: record the file-system operations of one save, or ``SIGKILL`` the
  launch right before one (:mod:`tests.helpers.fs_trace`, :func:`install_fs_trace`).

Every replacement goes through :mod:`megatron.overlay.registry` (owner ``fault_injection``);
:func:`uninstall` restores them. Messages are printed as ``[fault-injection] ...`` lines.
"""

from __future__ import annotations

import inspect
import io
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from megatron.overlay.registry import Patcher, wraps_upstream
from megatron.training_ext.console import write_line
from tests.helpers import fs_trace

ENV_FAULT = "MEGATRON_TEST_FAULT"
ENV_NAN = "MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD"
ENV_KILL_LOCAL_SAVE = "MEGATRON_TEST_KILL_IN_LOCAL_SAVE"
ENV_ABORT_ASYNC = "MEGATRON_TEST_ABORT_ASYNC_SAVE"
ENV_DISK_FULL = "MEGATRON_TEST_LOCAL_DISK_FULL"
ENV_PERTURB = "MEGATRON_TEST_PERTURB_AFTER_LOAD"
ENV_RNG_LOG = "MEGATRON_TEST_RNG_LOG"
#: Moments of a local save at which ``MEGATRON_TEST_KILL_IN_LOCAL_SAVE`` can kill, in save order.
LOCAL_SAVE_MOMENTS = ("replicate", "write", "rename", "cleanup")
DEFAULT_WRITE_FRACTION = 0.5

#: The hooks installed in this process: ``train_step``, ``abort_async``, ``local_manager`` -> the
#: attribute each replaced.
_installed: dict = {}
_PATCHER = Patcher("fault_injection")


def parse_faults(spec: str) -> list:
    """Parse ``MEGATRON_TEST_FAULT``: one or more :func:`parse_fault` specs separated by ``;``
    (several faults in one run, e.g. one per attempt of an in-process restart)."""
    return [parse_fault(part) for part in spec.split(";") if part.strip()]


def parse_fault(spec: str) -> dict:
    """Parse ``MEGATRON_TEST_FAULT="rank=R,iteration=K[,wipe_local=1][,corrupt=PATH][,once=PATH]
    [,raise=1]"``.

    When global rank ``R`` is about to run iteration ``K + 1`` (iteration ``K`` and every
    checkpoint saved at ``K`` are complete), it deletes its own local checkpoint directory
    (``wipe_local=1``: ``<--non-persistent-local-ckpt-dir>/<rank>``, the node's local storage is
    lost), flips one byte of the ``torch.save`` file ``PATH`` (``corrupt=PATH``, see
    :func:`flip_byte_in_largest_storage`), then leaves with ``os._exit(1)``, like a crashed process.
    ``once=PATH``: the fault fires only if ``PATH`` does not exist, and creates it (an in-job
    restart runs iteration ``K + 1`` again; without it the fault would fire on every restart).
    ``raise=1``: instead of leaving, the rank raises ``RuntimeError`` (an exception on one rank,
    which in-process restart handles in the same process).

    Returns:
        dict with int ``rank``, ``iteration``, bool ``wipe_local``, ``raise``, optional str
        ``corrupt``, ``once``.

    Raises:
        ValueError: unknown key, missing ``rank``/``iteration``, or a non-integer value.
    """
    out: dict = {"wipe_local": False, "corrupt": None, "once": None, "raise": False}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{ENV_FAULT}: '{part}' is not key=value")
        if key in ("rank", "iteration"):
            out[key] = int(value)
        elif key in ("wipe_local", "raise"):
            out[key] = value not in ("0", "", "false", "no")
        elif key in ("corrupt", "once"):
            out[key] = value
        else:
            raise ValueError(
                f"{ENV_FAULT}: unknown key '{key}' (rank, iteration, wipe_local, corrupt, once, "
                "raise)"
            )
    if "rank" not in out or "iteration" not in out:
        raise ValueError(f"{ENV_FAULT}: rank= and iteration= are required, got '{spec}'")
    return out


def parse_local_save_kill(spec: str) -> dict:
    """Parse ``MEGATRON_TEST_KILL_IN_LOCAL_SAVE``:
    ``"rank=R,iteration=K,moment=M[,fraction=F][,once=PATH]"``.

    Global rank ``R`` kills itself with ``SIGKILL`` (like ``kill -9``: no handler, no flush, no
    ``finally``) during its local (NVRx ``LocalCheckpointManager``) save of iteration ``K``, at
    moment ``M`` (one of :data:`LOCAL_SAVE_MOMENTS`; what each leaves behind:
    :func:`install_local_save_kill`). ``fraction=F`` (0 < F < 1, default
    :data:`DEFAULT_WRITE_FRACTION`) applies only to ``moment=write``. ``once=PATH``: as for
    :func:`parse_fault` (fires only if ``PATH`` does not exist, and creates it before killing).

    Returns:
        dict with int ``rank``, ``iteration``, str ``moment`` (one of :data:`LOCAL_SAVE_MOMENTS`),
        float ``fraction`` (``moment=write``: given or :data:`DEFAULT_WRITE_FRACTION`; else
        ``None``), optional str ``once``.

    Raises:
        ValueError: a part that is not key=value, an unknown or repeated key, missing ``rank``,
            ``iteration`` or ``moment``, a non-integer rank/iteration (or a negative one), an
            unknown moment, a fraction that is not a number strictly between 0 and 1, or a
            fraction with a moment other than ``write``.
    """
    name = ENV_KILL_LOCAL_SAVE
    out: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ValueError(f"{name}: '{part}' is not key=value")
        if key not in ("rank", "iteration", "moment", "fraction", "once"):
            raise ValueError(
                f"{name}: unknown key '{key}' (rank, iteration, moment, fraction, once)"
            )
        if key in out:
            raise ValueError(f"{name}: '{key}' given twice in '{spec}'")
        if key in ("rank", "iteration"):
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError(f"{name}: {key}={value!r} is not an integer") from None
            if out[key] < 0:
                raise ValueError(f"{name}: {key}={value} must be >= 0")
        elif key == "moment":
            if value not in LOCAL_SAVE_MOMENTS:
                raise ValueError(
                    f"{name}: unknown moment '{value}' (one of {', '.join(LOCAL_SAVE_MOMENTS)})"
                )
            out[key] = value
        elif key == "fraction":
            try:
                fraction = float(value)
            except ValueError:
                raise ValueError(f"{name}: fraction={value!r} is not a number") from None
            if not 0.0 < fraction < 1.0:  # also rejects nan
                raise ValueError(f"{name}: fraction={value} must be strictly between 0 and 1")
            out[key] = fraction
        else:
            if not value:
                raise ValueError(f"{name}: once= needs a path")
            out[key] = value
    missing = [k for k in ("rank", "iteration", "moment") if k not in out]
    if missing:
        raise ValueError(f"{name}: {', '.join(k + '=' for k in missing)} required, got '{spec}'")
    if "fraction" in out and out["moment"] != "write":
        raise ValueError(
            f"{name}: fraction= applies only to moment=write (got moment={out['moment']})"
        )
    if out["moment"] == "write":
        out.setdefault("fraction", DEFAULT_WRITE_FRACTION)
    else:
        out["fraction"] = None
    out.setdefault("once", None)
    return out


def flip_byte_in_largest_storage(path: str) -> int:
    """Flip one bit of the middle byte of the largest tensor storage in a ``torch.save`` zip file
    (a storage fault that only a content checksum can notice: ``torch.load`` does not check the
    zip CRC).

    Returns:
        The file offset of the flipped byte.

    Raises:
        ValueError: the file holds no tensor storage.
    """
    from megatron.integrity.torch_save import storage_records  # the one record parser

    storages = [r for r in storage_records(path) if r.nbytes > 0]
    if not storages:
        raise ValueError(f"{path}: no tensor storage in this file")
    largest = max(storages, key=lambda r: r.nbytes)
    pos = largest.offset + largest.nbytes // 2
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    return pos


def _at() -> str:
    """``(at T)``: the wall-clock time of a fault, seconds since the epoch (``time.time()``; read
    by ``tools/bench_restart.py``)."""
    return f"(at {time.time():.3f})"


def _say(message: str) -> None:
    write_line(f"[fault-injection] {message}")


def install_from_env(args) -> None:
    """Install the hooks whose variables are set; idempotent; no-op when none is set.

    ``MEGATRON_TEST_FAULT`` (:func:`parse_fault`) and ``MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD=K``
    wrap ``megatron.training.training.train_step`` (outside the local tier's wrapper). With the
    latter, in a process that resumed from the local checkpoint tier (the local tier validated
    it), every rank fills its model's first parameter with NaN just before iteration ``K`` runs: a
    local tier whose values pass every check but make training diverge.

    ``MEGATRON_TEST_ABORT_ASYNC_SAVE=K`` (needs ``--async-save``) wraps ``train_step`` too: when
    every rank is about to run iteration ``K + 1`` (the async save of ``K`` scheduled, not yet
    finalised), each rank waits until its checkpoint worker has posted the write results of that
    save, then calls upstream's abort of async checkpointing,
    ``megatron.training.async_utils.reset_persistent_async_worker`` (what upstream's in-process
    restart calls, ``AbortCheckpoint``): the save of ``K`` is never finalised; training goes on.

    ``MEGATRON_TEST_KILL_IN_LOCAL_SAVE``: :func:`install_local_save_kill`.

    Raises:
        ValueError: (every rank, before training) ``MEGATRON_TEST_FAULT``,
            ``MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD`` or ``MEGATRON_TEST_KILL_IN_LOCAL_SAVE`` is
            malformed (nothing is installed then), or ``MEGATRON_TEST_ABORT_ASYNC_SAVE`` is not an
            iteration number or is set without ``--async-save`` (checked after the others).
    """
    fault_spec, nan_spec = os.environ.get(ENV_FAULT), os.environ.get(ENV_NAN)
    kill_spec = os.environ.get(ENV_KILL_LOCAL_SAVE)
    faults = parse_faults(fault_spec) if fault_spec else []
    nan_at: Optional[int] = int(nan_spec) if nan_spec else None
    kill = parse_local_save_kill(kill_spec) if kill_spec else None
    if (faults or nan_at is not None) and "train_step" not in _installed:
        _install_train_step(args, faults, nan_at)
    if kill is not None and "local_manager" not in _installed:
        install_local_save_kill(kill)
    full_spec = os.environ.get(ENV_DISK_FULL)
    if full_spec and "local_disk_full" not in _installed:
        full = parse_fault(full_spec)
        install_local_disk_full(full["rank"], full["iteration"])
    perturb, rng_log = os.environ.get(ENV_PERTURB), os.environ.get(ENV_RNG_LOG)
    if (perturb or rng_log) and "step_probes" not in _installed:
        install_step_probes(bool(perturb), rng_log)
    if fs_trace.config() is not None and "fs_trace" not in _installed:
        install_fs_trace()
    abort_spec = os.environ.get(ENV_ABORT_ASYNC)
    if abort_spec and "abort_async" not in _installed:
        if not abort_spec.isdigit() or not getattr(args, "async_save", False):
            raise ValueError(
                f"{ENV_ABORT_ASYNC}={abort_spec!r}: needs an iteration number and --async-save"
            )
        _install_async_abort(int(abort_spec), args.async_strategy)


def uninstall() -> None:
    """Undo every installed hook (the registry restores what each replaced)."""
    _PATCHER.restore()
    _installed.clear()
    _kill_state.clear()


def _fire(fault: dict, rank: int, iteration: int, local_root: Optional[str]) -> None:
    """Fire ``fault`` (:func:`parse_fault`) on this rank before iteration ``iteration + 1``."""
    once = fault["once"]
    if once and os.path.exists(once):
        return
    if once:
        Path(once).touch()
    if fault["wipe_local"] and local_root:
        shutil.rmtree(os.path.join(local_root, str(rank)), ignore_errors=True)
        _say(f"rank {rank}: deleted its local checkpoint directory {local_root}/{rank}")
    if fault["corrupt"]:
        pos = flip_byte_in_largest_storage(fault["corrupt"])
        _say(f"rank {rank}: flipped a byte at offset {pos} of {fault['corrupt']}")
    if fault["raise"]:
        _say(f"rank {rank}: raising RuntimeError before iteration {iteration + 1} {_at()}")
        raise RuntimeError(f"injected fault: rank {rank} before iteration {iteration + 1}")
    _say(f"rank {rank}: crashing (os._exit(1)) before iteration {iteration + 1} {_at()}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _install_train_step(args, faults: list, nan_at: Optional[int]) -> None:
    local_root = getattr(args, "non_persistent_local_ckpt_dir", None)

    import megatron.training.training as training
    import torch
    import torch.distributed as dist

    from megatron.training_ext import local_tier

    upstream = training.train_step
    sig = inspect.signature(upstream)

    @wraps_upstream(upstream)
    def train_step_with_faults(*a, **kw):
        """Test-only: ``train_step``, after the crash or NaN that ``MEGATRON_TEST_FAULT`` /
        ``MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD`` schedule for this iteration."""
        bound = sig.bind(*a, **kw).arguments
        iteration = bound.get("iteration")
        rank = dist.get_rank() if dist.is_initialized() else 0
        for fault in faults:
            if iteration == fault["iteration"] and rank == fault["rank"]:
                _fire(fault, rank, iteration, local_root)
        if (
            nan_at is not None
            and iteration is not None
            and iteration + 1 == nan_at
            and local_tier.loaded_local_iteration() is not None
        ):
            model = bound.get("model")
            with torch.no_grad():
                p = next(model[0].parameters())
                p.data.fill_(float("nan"))
            _say(
                f"rank {rank}: filled a parameter with NaN before iteration {nan_at} (resumed "
                f"from local iteration {local_tier.loaded_local_iteration()})"
            )
        return upstream(*a, **kw)

    _PATCHER.replace(
        training,
        "train_step",
        train_step_with_faults,
        "test-only: crash a chosen rank before a chosen iteration "
        f"({ENV_FAULT}) or fill a parameter with NaN after a local-tier resume "
        f"({ENV_NAN}).",
    )
    _installed["train_step"] = upstream


def rng_digest() -> str:
    """SHA-256 (hex) of torch's global CPU generator state."""
    import hashlib

    import torch

    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def install_step_probes(perturb: bool, rng_log: Optional[str]) -> None:
    """Wrap ``megatron.training.training.train_step`` (outside this fork's wrappers, so before the
    resume proof's check at the first step): with ``perturb``, in a process whose first step
    resumes a checkpoint (``iteration`` > 0), every rank adds 1.0 to the first element of its
    model's first parameter before that step (a change between the load and the first step);
    with ``rng_log``, every rank appends ``{"iteration": K, "torch": rng_digest()}`` as iteration
    ``K`` begins, one JSON line, to ``<rng_log>.<rank>``."""
    import json

    import megatron.training.training as training
    import torch
    import torch.distributed as dist

    upstream = training.train_step
    sig = inspect.signature(upstream)
    first = [True]

    @wraps_upstream(upstream)
    def train_step_with_probes(*a, **kw):
        """Test-only: ``train_step``, after the probes ``MEGATRON_TEST_PERTURB_AFTER_LOAD`` /
        ``MEGATRON_TEST_RNG_LOG`` ask for."""
        bound = sig.bind(*a, **kw).arguments
        iteration = int(bound.get("iteration") or 0)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rng_log:
            with open(f"{rng_log}.{rank}", "a") as f:
                f.write(json.dumps({"iteration": iteration + 1, "torch": rng_digest()}) + "\n")
        if perturb and first[0] and iteration > 0:
            with torch.no_grad():
                next(bound["model"][0].parameters()).view(-1)[0] += 1.0
            _say(f"rank {rank}: changed a model value after the load of {iteration}")
        first[0] = False
        return upstream(*a, **kw)

    _PATCHER.replace(
        training,
        "train_step",
        train_step_with_probes,
        f"test-only: change a model value after a load ({ENV_PERTURB}) or log the CPU "
        f"generator as each iteration begins ({ENV_RNG_LOG}).",
    )
    _installed["step_probes"] = upstream


def _install_async_abort(at: int, strategy: str, timeout: float = 300.0) -> None:
    import time

    import megatron.training.training as training
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

    upstream = training.train_step
    sig = inspect.signature(upstream)
    fs_module = sys.modules[get_async_strategy(strategy)[1]["FileSystemWriterAsync"].__module__]

    @wraps_upstream(upstream)
    def train_step_with_async_abort(*a, **kw):
        """Test-only: ``train_step``, after aborting async checkpointing before iteration
        ``MEGATRON_TEST_ABORT_ASYNC_SAVE + 1``."""
        if sig.bind(*a, **kw).arguments.get("iteration") == at:
            from megatron.training import async_utils  # through the module: the fixes patch it

            rank = dist.get_rank()
            pending = async_utils._async_calls_queue.get_num_unfinalized_calls()
            deadline = time.monotonic() + timeout
            while pending and (
                fs_module._results_queue is None or fs_module._results_queue.qsize() < 1
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{ENV_ABORT_ASYNC}: the worker posted no write results "
                        f"of the save of iteration {at} within {timeout:.0f} s"
                    )
                time.sleep(0.05)
            queue = fs_module._results_queue
            posted = queue.qsize() if queue is not None else 0
            dist.barrier()
            async_utils.reset_persistent_async_worker(strategy)
            _say(
                f"rank {rank}: aborted async checkpointing before iteration {at + 1}: "
                f"{pending} save(s) not finalised, {posted} write result(s) posted by the worker"
            )
        return upstream(*a, **kw)

    _PATCHER.replace(
        training,
        "train_step",
        train_step_with_async_abort,
        "test-only: abort async checkpointing with upstream's "
        "reset_persistent_async_worker after the worker wrote a save and before it "
        f"is finalised ({ENV_ABORT_ASYNC}).",
    )
    _installed["abort_async"] = upstream


# ---------------------------------------------------------------------------------------------
# MEGATRON_TEST_KILL_IN_LOCAL_SAVE
# ---------------------------------------------------------------------------------------------

#: Per-process state of the local-save kill: ``files`` = ``_save`` calls seen for the target.
_kill_state: dict = {}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _sigkill(message: str) -> None:
    """One ``[fault-injection]`` line, then ``SIGKILL`` to this process (never returns)."""
    _say(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - SIGKILL is delivered before this matters
        signal.pause()


def _claim(kill: dict) -> bool:
    """True if the kill may fire now (``once`` absent; then creates it), else False."""
    once = kill["once"]
    if once and os.path.exists(once):
        return False
    if once:
        Path(once).touch()
    return True


def _serialized(upstream_save, obj, *args, **kwargs) -> bytes:
    """What ``torch.save(obj, f, ...)`` would write."""
    buf = io.BytesIO()
    upstream_save(obj, buf, *args, **kwargs)
    return buf.getvalue()


def _write_prefix(f, data: bytes, n: int) -> None:
    """Write the first ``n`` bytes of ``data`` to ``f`` (a path or an open binary stream)."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "wb") as out:
            out.write(data[:n])
    else:
        f.write(data[:n])
        f.flush()


def _is_dirty_target(f) -> Optional[str]:
    """The path of ``f`` (a path or a file object with ``name``) if it is a ``.dirty`` file."""
    name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
    if isinstance(name, (str, os.PathLike)) and ".dirty" in Path(name).name:
        return os.fspath(name)
    return None


def install_local_save_kill(kill: dict) -> type:
    """Replace ``local_manager.LocalCheckpointManager`` (whatever class it is now: NVRx's own, or
    the local tier's subclass) by a subclass that kills rank ``kill['rank']`` at
    ``kill['moment']`` of its local save of ``kill['iteration']`` (:func:`parse_local_save_kill`).
    ``pretrain()`` imports the class by name when it builds the manager. Moments:

    * ``replicate``: start of ``save()``, before the replication exchange and before any file of
      ``K`` is written (the other ranks of its clique wait for it in the exchange);
    * ``write``: while the first file this rank writes for ``K`` (a ``*.dirty.pt``: its own shard
      or a replica, whichever ``_save`` gets first) is written, it holds exactly the first
      ``int(F * size)`` bytes (at least 1, at most ``size - 1``) of what ``torch.save`` would have
      written (serialized to memory first, then that prefix goes through the file object or path
      ``torch.save`` was given);
    * ``rename``: right after this rank's first ``*.dirty.pt -> *.pt`` rename of ``K``
      (``os.rename`` / ``os.replace``, which ``Path.rename`` / ``Path.replace`` use); should
      ``_save`` rename in another way, the kill happens when that first ``_save`` returns;
    * ``cleanup``: start of ``_cleanup(K)``: every file of ``K`` complete on every rank, older
      ones not removed yet.

    ``write`` and ``rename`` act in the process that runs ``_save`` (the training process for
    synchronous local saves). Returns the new class."""
    import torch
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager

    base = local_manager.LocalCheckpointManager
    rank_k, iter_k, moment = kill["rank"], kill["iteration"], kill["moment"]
    where = f"during its local save of iteration {iter_k}"
    _kill_state.clear()
    _kill_state["files"] = 0

    def target(iteration) -> bool:
        return iteration == iter_k and _rank() == rank_k

    class FaultInjectingLocalCheckpointManager(base):
        """Test-only (:mod:`tests.helpers.fault_injection`): ``SIGKILL`` at a moment of
        one local save."""

        def save(self, state_dict, iteration, *a, **kw):
            if moment == "replicate" and target(iteration) and _claim(kill):
                _sigkill(
                    f"rank {_rank()}: SIGKILL {where} (moment replicate: start of save(), "
                    f"before replication and before any file)"
                )
            return super().save(state_dict, iteration, *a, **kw)

        def _save(self, state_dict, ckpt_id, *a, **kw):
            first = False
            if moment in ("write", "rename") and target(ckpt_id[0]):
                _kill_state["files"] += 1
                first = _kill_state["files"] == 1
            if not (first and _claim(kill)):
                return super()._save(state_dict, ckpt_id, *a, **kw)
            if moment == "write":
                return self._save_killed_mid_write(state_dict, ckpt_id, *a, **kw)
            return self._save_killed_after_rename(state_dict, ckpt_id, *a, **kw)

        def _save_killed_mid_write(self, state_dict, ckpt_id, *a, **kw):
            upstream_save = torch.save

            @wraps_upstream(upstream_save)
            def torch_save_prefix_then_kill(obj, f, *sa, **skw):
                """Test-only: ``torch.save``; into a ``.dirty`` file only a prefix, then
                ``SIGKILL``."""
                path = _is_dirty_target(f)
                if path is None:
                    return upstream_save(obj, f, *sa, **skw)
                data = _serialized(upstream_save, obj, *sa, **skw)
                n = min(max(int(kill["fraction"] * len(data)), 1), len(data) - 1)
                _write_prefix(f, data, n)
                _sigkill(
                    f"rank {_rank()}: SIGKILL {where} (moment write: {n} of {len(data)} "
                    f"bytes (fraction {kill['fraction']}) of {path} written)"
                )

            during = Patcher("fault_injection")
            during.replace(
                torch,
                "save",
                torch_save_prefix_then_kill,
                "test-only: the local save writes only a prefix of its first "
                f".dirty.pt file, then the rank is killed ({ENV_KILL_LOCAL_SAVE}, "
                "moment write).",
            )
            try:
                result = super()._save(state_dict, ckpt_id, *a, **kw)
            finally:
                during.restore()
            _sigkill(
                f"rank {_rank()}: SIGKILL {where} (moment write: _save of {ckpt_id} wrote "
                f"no .dirty file through torch.save; killed after it returned)"
            )
            return result  # pragma: no cover

        def _save_killed_after_rename(self, state_dict, ckpt_id, *a, **kw):
            originals = {"rename": os.rename, "replace": os.replace}

            def after(name):
                @wraps_upstream(originals[name])
                def rename_then_kill(src, dst, *ra, **rkw):
                    """Test-only: ``os.rename`` / ``os.replace``; ``SIGKILL`` right after a
                    ``.dirty`` -> final rename."""
                    result = originals[name](src, dst, *ra, **rkw)
                    if ".dirty" in Path(src).name and ".dirty" not in Path(dst).name:
                        _sigkill(
                            f"rank {_rank()}: SIGKILL {where} (moment rename: right after "
                            f"{os.fspath(src)} -> {os.fspath(dst)})"
                        )
                    return result

                return rename_then_kill

            during = Patcher("fault_injection")
            for name in originals:
                during.replace(
                    os,
                    name,
                    after(name),
                    "test-only: the rank is killed right after the local save's first "
                    f".dirty.pt -> .pt rename ({ENV_KILL_LOCAL_SAVE}, moment rename).",
                )
            try:
                result = super()._save(state_dict, ckpt_id, *a, **kw)
            finally:
                during.restore()
            _sigkill(
                f"rank {_rank()}: SIGKILL {where} (moment rename: _save of {ckpt_id} made no "
                f".dirty -> final rename; killed after it returned)"
            )
            return result  # pragma: no cover

        def _cleanup(self, iteration, *a, **kw):
            if moment == "cleanup" and target(iteration) and _claim(kill):
                _sigkill(
                    f"rank {_rank()}: SIGKILL {where} (moment cleanup: start of "
                    f"_cleanup({iteration}), older local checkpoints not removed yet)"
                )
            return super()._cleanup(iteration, *a, **kw)

    FaultInjectingLocalCheckpointManager.__qualname__ = f"FaultInjecting[{base.__qualname__}]"
    _PATCHER.replace(
        local_manager,
        "LocalCheckpointManager",
        FaultInjectingLocalCheckpointManager,
        f"test-only: SIGKILL a chosen rank at a chosen moment of its local save "
        f"({ENV_KILL_LOCAL_SAVE}).",
    )
    _installed["local_manager"] = base
    return FaultInjectingLocalCheckpointManager


def install_local_disk_full(rank_k: int, iter_k: int) -> type:
    """Replace ``local_manager.LocalCheckpointManager`` (whatever class it is now) by a subclass in
    which rank ``rank_k``'s local disk is full from its local save of ``iter_k`` on: in every
    ``_save`` of an iteration >= ``iter_k`` there, ``torch.save`` into the ``.dirty`` file writes
    half of its bytes, then raises ``OSError(ENOSPC)``, as a full file system does. Returns the
    new class."""
    import errno

    import torch
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager

    base = local_manager.LocalCheckpointManager

    class DiskFullLocalCheckpointManager(base):
        """Test-only (:mod:`tests.helpers.fault_injection`): a full local disk on one rank."""

        def _save(self, state_dict, ckpt_id, *a, **kw):
            if not (ckpt_id[0] >= iter_k and _rank() == rank_k):
                return super()._save(state_dict, ckpt_id, *a, **kw)
            upstream_save = torch.save

            @wraps_upstream(upstream_save)
            def torch_save_disk_full(obj, f, *sa, **skw):
                """Test-only: ``torch.save`` into a ``.dirty`` file on a full disk."""
                path = _is_dirty_target(f)
                if path is None:
                    return upstream_save(obj, f, *sa, **skw)
                data = _serialized(upstream_save, obj, *sa, **skw)
                _write_prefix(f, data, len(data) // 2)
                write_line(f"[fault-injection] rank {_rank()}: disk full writing {path}")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

            during = Patcher("fault_injection")
            during.replace(
                torch,
                "save",
                torch_save_disk_full,
                f"test-only: the local disk of rank {rank_k} is full ({ENV_DISK_FULL}).",
            )
            try:
                return super()._save(state_dict, ckpt_id, *a, **kw)
            finally:
                during.restore()

    DiskFullLocalCheckpointManager.__qualname__ = f"DiskFull[{base.__qualname__}]"
    _PATCHER.replace(
        local_manager,
        "LocalCheckpointManager",
        DiskFullLocalCheckpointManager,
        f"test-only: a full local disk on one rank ({ENV_DISK_FULL}).",
    )
    _installed["local_disk_full"] = base
    return DiskFullLocalCheckpointManager


# ---------------------------------------------------------------------------------------------
# MEGATRON_TEST_KILL_ASYNC_WORKER (armed in the persistent checkpoint worker itself)
# ---------------------------------------------------------------------------------------------

ENV_KILL_ASYNC_WORKER = "MEGATRON_TEST_KILL_ASYNC_WORKER"
#: Moments of an async save at which ``MEGATRON_TEST_KILL_ASYNC_WORKER`` kills the worker.
ASYNC_WORKER_MOMENTS = ("preload", "write")


def parse_async_worker_kill(spec: str) -> dict:
    """Parse ``MEGATRON_TEST_KILL_ASYNC_WORKER="rank=R,iteration=K[,moment=M]"`` (``M`` one of
    :data:`ASYNC_WORKER_MOMENTS`, default ``write``).

    Returns:
        dict with int ``rank``, ``iteration`` and str ``moment``.

    Raises:
        ValueError: a part that is not key=value, an unknown key, a missing ``rank`` or
            ``iteration``, a value that is not a non-negative integer, an unknown moment.
    """
    name = ENV_KILL_ASYNC_WORKER
    out: dict = {"moment": "write"}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep:
            raise ValueError(f"{name}: '{part}' is not key=value")
        if key in ("rank", "iteration"):
            if not value.isdigit():
                raise ValueError(f"{name}: {key}={value!r} is not a non-negative integer")
            out[key] = int(value)
        elif key == "moment":
            if value not in ASYNC_WORKER_MOMENTS:
                raise ValueError(
                    f"{name}: unknown moment '{value}' (one of {', '.join(ASYNC_WORKER_MOMENTS)})"
                )
            out[key] = value
        else:
            raise ValueError(f"{name}: unknown key '{key}' (rank, iteration, moment)")
    if "rank" not in out or "iteration" not in out:
        raise ValueError(f"{name}: rank= and iteration= are required, got '{spec}'")
    return out


def install_async_worker_kill_from_env() -> Optional[dict]:
    """In a spawned persistent checkpoint worker (the test entrypoint run as ``__mp_main__``):
    when ``MEGATRON_TEST_KILL_ASYNC_WORKER`` names this worker's rank (``$RANK``, inherited from
    its training rank), the worker kills itself with ``SIGKILL`` (as the OOM killer does) during
    the async save of the named iteration:

    * ``moment=preload``: when it starts staging that save's tensors (its training rank waits in
      ``schedule_async_request`` for the staging to finish; no data file written);
    * ``moment=write``: while it writes the first data file (``__R_*.distcp``) of that save, after
      half of the first chunk is on disk (the staging is done; its training rank trains on).

    The worker resolves both functions when it unpickles the save request, by module attribute
    (``FileSystemWriterAsync.preload_tensors``, and the writer's ``open``, which the persistent
    tier sets to ``megatron.integrity.checksum.written.hashing_open``), so replacing them here,
    before any request arrives, reaches them. Returns the parsed spec when armed, else ``None``.
    """
    spec = os.environ.get(ENV_KILL_ASYNC_WORKER)
    if not spec:
        return None
    kill = parse_async_worker_kill(spec)
    if int(os.environ.get("RANK", "-1")) != kill["rank"]:
        return None
    marker = f"iter_{kill['iteration']:07d}"
    worker = os.getpid()
    where = f"rank {kill['rank']}'s checkpoint worker (pid {worker}): SIGKILL"

    def kill_worker(message: str) -> None:
        import time

        _say(f"{where} {message} (at unix time {time.time():.3f})")
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(worker, signal.SIGKILL)
        while True:  # pragma: no cover - SIGKILL is delivered before this matters
            signal.pause()

    if kill["moment"] == "preload":
        from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fsa

        upstream = fsa.FileSystemWriterAsync.preload_tensors

        @wraps_upstream(upstream)
        def preload_tensors_then_kill(resolved_plan_data, *a, **kw):
            """Test-only: the worker dies as it starts staging the named save."""
            if marker in str(resolved_plan_data[0]):
                kill_worker(f"as it starts staging the save of iteration {kill['iteration']}")
            return upstream(resolved_plan_data, *a, **kw)

        _PATCHER.replace(
            fsa.FileSystemWriterAsync,
            "preload_tensors",
            staticmethod(preload_tensors_then_kill),
            f"test-only: the checkpoint worker dies while staging a save ({ENV_KILL_ASYNC_WORKER})",
        )
        return kill
    from megatron.integrity.checksum import written

    upstream_open = written.hashing_open

    @wraps_upstream(upstream_open)
    def open_then_kill(file, mode="r", *a, **kw):
        """Test-only: the checkpoint writer's ``open``; the first data file of the named save
        gets half of its first chunk, then the worker dies."""
        f = upstream_open(file, mode, *a, **kw)
        path = os.fspath(file)
        if mode != "wb" or marker not in path or not path.endswith(".distcp"):
            return f
        return _KillingFile(f, kill_worker, path, kill["iteration"])

    _PATCHER.replace(
        written,
        "hashing_open",
        open_then_kill,
        f"test-only: the checkpoint worker dies while writing a save ({ENV_KILL_ASYNC_WORKER})",
    )
    return kill


class _KillingFile:
    """Test-only: a writable file whose first ``write`` writes half of its data, flushes, then
    calls ``kill`` (which never returns); anything else goes to the file."""

    def __init__(self, f, kill, path: str, iteration: int):
        self._f, self._kill, self._path, self._iteration = f, kill, path, iteration

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        half = max(1, len(view) // 2)
        self._f.write(view[:half])
        self._f.flush()
        self._kill(
            f"while writing {self._path} of the save of iteration {self._iteration} "
            f"({half} of {len(view)} bytes of its first chunk written)"
        )
        return half  # pragma: no cover

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def install_fs_trace() -> None:
    """Install :mod:`tests.helpers.fs_trace` in this rank and open its window where
    ``MEGATRON_TEST_FS_TRACE`` says: ``save:K`` when ``save_checkpoint`` of iteration ``K`` is
    entered (wraps ``megatron.training.training.save_checkpoint``, the name the training loop and
    the final save call); ``load`` closes at the first training step (wraps ``train_step``)."""
    import megatron.training.training as training

    cfg = fs_trace.install(main=True)
    window = cfg["window"]
    if window.startswith("save:"):
        at = int(window.split(":", 1)[1])
        upstream = training.save_checkpoint

        @wraps_upstream(upstream)
        def save_checkpoint_traced(iteration, *a, **kw):
            """Test-only: ``save_checkpoint``; the trace window opens at iteration ``K``."""
            if iteration == at:
                fs_trace.open_window()
            return upstream(iteration, *a, **kw)

        _PATCHER.replace(
            training,
            "save_checkpoint",
            save_checkpoint_traced,
            "test-only: open the file-system trace window at the save of one iteration "
            f"({fs_trace.ENV}).",
        )
    else:
        upstream = training.train_step

        @wraps_upstream(upstream)
        def train_step_traced(*a, **kw):
            """Test-only: ``train_step``; the trace window (the start) closes at the first step."""
            fs_trace.close_window()
            return upstream(*a, **kw)

        _PATCHER.replace(
            training,
            "train_step",
            train_step_traced,
            f"test-only: close the file-system trace window at the first step ({fs_trace.ENV}).",
        )
    _installed["fs_trace"] = True
