"""Fix: a dead persistent async checkpoint worker hangs training forever.

NVRx 0.7.0's ``PersistentAsyncCaller`` (the persistent worker of ``--async-save``, the default
``--async-strategy nvrx``) never looks at its worker process once it has started it. When the
worker dies (the OOM killer's ``SIGKILL``, a crash in the writer), a training rank waits forever:
in ``schedule_async_call`` for the staging of the next save (``preload_q.join()``), in a blocking
finalisation for a completion that never comes (``is_current_async_call_done``: ``sleep(0.1)``
in a loop), and the other ranks wait for it in their next collective. A non-blocking finalisation
reports the save as "not done yet" at every iteration (Megatron-LM issue 6970).

The replacements watch the worker:

* the waits poll the worker's liveness (every 0.05-0.1 s): a dead worker ends them;
* the check of the current save, which every rank makes together at each iteration
  (``maybe_finalize_async_save``), all-reduces "dead" next to upstream's "still writing", so every
  rank learns of any rank's dead worker in the same collective; the schedule of a save adds one
  such all-reduce (a staging that found its worker dead);
* then every rank aborts its own worker and stops with one line naming the dead worker (rank,
  pid, how it died) and the unfinished iteration(s), exit status 1. The unfinished save is never
  finalised: it has no ``.metadata`` and no tracker names it, so the next start resumes from the
  newest complete checkpoint (the persistent tier's resume point), and it is overwritten by the
  next save of that iteration. Bound: the next iteration's check (or at once, in a wait).
* A worker found dead while idle (no save pending) is replaced by a fresh one before the next
  save is handed to it: nothing was lost.

Detection of a fixed upstream is by behaviour: upstream's own ``is_current_async_call_done``
(blocking, without collectives) on a stand-in caller whose worker is dead and posted nothing must
raise within 0.3 s instead of waiting.
"""

from __future__ import annotations

import importlib
import logging
import queue as queue_module
import signal
import threading
import time
from typing import Any, Callable, Optional

from megatron.overlay import Fix, Patch, alias_of, value
from megatron.overlay.errors import OverlayError
from megatron.overlay.registry import wraps_upstream

logger = logging.getLogger("megatron.fixes.async_worker_death")

_CORE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
_CKPT = "megatron.training.checkpointing"
#: Exit status of a rank stopped because a checkpoint worker died.
EXIT_STATUS = 1
_POLL_S = 0.05
#: Seconds a healthy worker gets between SIGTERM and SIGKILL when every rank stops.
ABORT_GRACE_S = 2.0
#: The current save's iteration (set by the ``save_checkpoint`` wrapper while it runs).
_SAVING = threading.local()


class AsyncWorkerDied(OverlayError, RuntimeError):
    """A persistent checkpoint worker is dead while a save it was given is unfinished.

    Attributes:
        rank: the training rank whose worker died.
        pid: the worker's process id (``-1`` when unknown).
        exitcode: its exit code (negative: killed by that signal; ``None``: unknown).
    """

    def __init__(self, rank: int, pid: int, exitcode: Optional[int]) -> None:
        self.rank, self.pid, self.exitcode = rank, pid, exitcode
        super().__init__(f"rank {rank}'s checkpoint worker (pid {pid}) died ({how(exitcode)})")


def how(exitcode: Optional[int]) -> str:
    """How a process ended, from its exit code: ``killed by SIGKILL``, ``exit code 3``."""
    if exitcode is None:
        return "gone"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def stop_line(died: AsyncWorkerDied, iterations: list) -> str:
    """The line every rank prints before it exits with :data:`EXIT_STATUS`."""
    its = ", ".join(str(i) for i in iterations) if iterations else "?"
    what = f"iteration{'s' if len(iterations) > 1 else ''} {its}"
    return (
        f"pretrain_gpt.py: rank {died.rank}'s persistent checkpoint worker (pid {died.pid}) "
        f"died ({how(died.exitcode)}) with the async save of {what} unfinished; every rank stops "
        f"(exit status {EXIT_STATUS}). That save is incomplete (no .metadata, no tracker names "
        "it): restarting the job resumes from the newest complete checkpoint"
    )


# ---------------------------------------------------------------------------------------------
# The worker's liveness in the waits
# ---------------------------------------------------------------------------------------------


def _alive(caller: Any) -> bool:
    proc = getattr(caller, "process", None)
    return proc is None or proc.is_alive()


def _died(caller: Any) -> AsyncWorkerDied:
    proc = caller.process
    rank = caller.rank if caller.rank is not None else _rank()
    return AsyncWorkerDied(rank, getattr(proc, "pid", -1) or -1, getattr(proc, "exitcode", None))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class WatchedJoin:
    """The caller's ``preload_q`` for one ``schedule_async_call``: ``join`` waits for the staging
    while the worker lives and raises :class:`AsyncWorkerDied` when it is dead; the rest is the
    queue's."""

    def __init__(self, real: Any, caller: Any) -> None:
        self._real, self._caller = real, caller

    def join(self) -> None:
        done = threading.Event()

        def wait() -> None:
            self._real.join()
            done.set()

        threading.Thread(target=wait, name="async-staging-wait", daemon=True).start()
        while not done.wait(_POLL_S):
            if not _alive(self._caller):
                if done.wait(_POLL_S):  # it staged, then died: the write is checked later
                    return
                raise _died(self._caller)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def wrap_schedule_async_call(upstream: Callable) -> Callable:
    """Factory of the replacement of ``PersistentAsyncCaller.schedule_async_call``: upstream's,
    with the wait for the staging bounded by the worker's life (:class:`WatchedJoin`)."""

    @wraps_upstream(upstream)
    def schedule_async_call(self, async_req):
        """Upstream's; the wait for the worker's staging ends when the worker dies
        (megatron.fixes.async_worker_death)."""
        if async_req.async_fn is None:
            return upstream(self, async_req)
        if self.rank is None:
            self.rank = _rank()
        if self.process is None:
            self._start_worker(self.rank)  # upstream would; the real queue goes to the worker
        real = self.preload_q
        self.preload_q = WatchedJoin(real, self)
        try:
            return upstream(self, async_req)
        finally:
            self.preload_q = real

    return schedule_async_call


def _sync(values: list) -> list:
    """All-reduce (sum) of small integers over the default group; ``values`` without one."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    device = "cpu"
    if torch.cuda.is_available() and dist.get_backend() != "gloo":
        device = torch.cuda.current_device()
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def _agree_on_death(local: Optional[AsyncWorkerDied]) -> Optional[AsyncWorkerDied]:
    """Every rank's :class:`AsyncWorkerDied` (:func:`_who_died`), or ``None`` when no worker
    died; a collective of every rank (two when one died)."""
    (dead,) = _sync([int(local is not None)])
    return _who_died(local) if dead else None


def _who_died(local: Optional[AsyncWorkerDied]) -> AsyncWorkerDied:
    """The dead worker every rank names (the highest rank's when several died), from one
    all-reduce of each rank's (dead, pid, exit code); a collective of every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local or AsyncWorkerDied(-1, -1, None)
    world, me = dist.get_world_size(), dist.get_rank()
    mine = (1, local.pid, _code(local)) if local is not None else (0, 0, 0)
    rows = _sync([v for r in range(world) for v in (mine if r == me else (0, 0, 0))])
    for r in reversed(range(world)):
        flag, pid, code = rows[3 * r : 3 * r + 3]
        if flag:
            return AsyncWorkerDied(r, pid, None if code == _NO_CODE else code)
    return local or AsyncWorkerDied(-1, -1, None)  # pragma: no cover - the sum said one died


_NO_CODE = 1 << 20


def _code(died: AsyncWorkerDied) -> int:
    return _NO_CODE if died.exitcode is None else died.exitcode


def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
    """``PersistentAsyncCaller.is_current_async_call_done`` that looks at the worker: a dead
    worker that posted no completion for the current save raises :class:`AsyncWorkerDied` (with
    collectives, on every rank: "dead" is all-reduced beside upstream's "still writing")
    instead of being waited for (blocking) or reported as still writing at every call
    (megatron.fixes.async_worker_death).

    Returns:
        True when the current save is done on every rank (``no_dist``: on this rank).

    Raises:
        AsyncWorkerDied: a worker (this rank's, or with collectives any rank's) is dead.
    """
    is_alive = False
    dead: Optional[AsyncWorkerDied] = None
    if self.process:
        while self.cur_item is None:
            try:
                self.cur_item = self.comp_q.get_nowait()
            except queue_module.Empty:
                if not self.process.is_alive():
                    try:  # a completion posted just before it died
                        self.cur_item = self.comp_q.get(timeout=0.5)
                    except queue_module.Empty:
                        dead = _died(self)
                        break
                    continue
                if not blocking:
                    is_alive = True
                    break
                time.sleep(0.1)
    if no_dist:
        if dead is not None:
            raise dead
        is_done = not is_alive
    else:
        alive, n_dead = _sync([int(is_alive), int(dead is not None)])
        if n_dead:
            raise _who_died(dead)
        is_done = alive == 0
    if is_done:
        self.cur_item = None
    return is_done


# ---------------------------------------------------------------------------------------------
# The calls queue: which iterations were unfinished, the agreement at schedule, the stop
# ---------------------------------------------------------------------------------------------


def _iterations_of(calls_queue: Any) -> dict:
    got = getattr(calls_queue, "_fix_iterations", None)
    if got is None:
        got = {}
        calls_queue._fix_iterations = got
    return got


def _unfinished(calls_queue: Any, extra: Optional[int] = None) -> list:
    """The iterations of the saves ``calls_queue`` holds unfinalised (and ``extra``)."""
    known = _iterations_of(calls_queue)
    idxs = [c.idx for c in getattr(calls_queue, "async_calls", ())]
    if extra is not None:
        idxs.append(extra)
    return sorted({known[i] for i in idxs if known.get(i) is not None})


def stop_every_rank(
    calls_queue: Any, died: AsyncWorkerDied, extra: Optional[int] = None, agreed: bool = True
):
    """Print :func:`stop_line` (stderr, at once: every rank calls this together, having agreed on
    ``died`` in a collective, and a launcher stops the other ranks as soon as one exits), wait
    until every rank has printed (one all-reduce; only when ``agreed``, i.e. every rank is here),
    abort ``calls_queue`` (this rank's worker terminated, its unfinished saves dropped, the queue
    no longer megatron's), then ``SystemExit(EXIT_STATUS)``."""
    import sys

    print(stop_line(died, _unfinished(calls_queue, extra)), file=sys.stderr, flush=True)
    try:  # no rank leaves before every rank has printed (a launcher stops the rest at the first)
        if agreed:
            _sync([0])
    except Exception as e:  # noqa: BLE001 - the rank stops anyway
        logger.warning("the barrier before stopping failed: %s", e)
    calls_queue.async_calls.clear()
    caller = getattr(calls_queue, "persistent_caller", None)
    if caller is not None:  # a healthy worker gets SIGTERM, then SIGKILL after this long
        caller.sigterm_timeout = min(getattr(caller, "sigterm_timeout", 30.0), ABORT_GRACE_S)
    try:
        calls_queue.close(abort=True)
    except Exception as e:  # noqa: BLE001 - the rank stops anyway; say why the abort failed
        logger.warning("aborting the async calls queue failed: %s", e)
    try:
        au = importlib.import_module("megatron.training.async_utils")
        if au._async_calls_queue is calls_queue:
            au._async_calls_queue = None
    except ImportError:
        pass
    raise SystemExit(EXIT_STATUS)


def _replace_idle_dead_worker(calls_queue: Any) -> None:
    """A persistent worker found dead with no save pending is dropped, so that the next
    schedule starts a fresh one: nothing was lost (one log line)."""
    caller = getattr(calls_queue, "persistent_caller", None)
    proc = getattr(caller, "process", None)
    if proc is None or proc.is_alive() or calls_queue.async_calls:
        return
    proc.join(timeout=1)
    logger.warning(
        "rank %s: the persistent checkpoint worker (pid %s) was found dead while idle (%s); "
        "starting a fresh one (no save was pending)",
        caller.rank,
        proc.pid,
        how(proc.exitcode),
    )
    caller.process = None


def wrap_schedule_async_request(upstream: Callable) -> Callable:
    """Factory of the replacement of ``AsyncCallsQueue.schedule_async_request``: upstream's,
    then every rank agrees whether a worker died staging it (one all-reduce)."""

    @wraps_upstream(upstream)
    def schedule_async_request(self, async_request):
        """Upstream's; a worker that died staging this save stops every rank with one line
        (megatron.fixes.async_worker_death)."""
        if not getattr(self, "persistent", False):
            return upstream(self, async_request)
        _replace_idle_dead_worker(self)
        iteration = getattr(_SAVING, "iteration", None)
        died = None
        try:
            idx = upstream(self, async_request)
        except AsyncWorkerDied as e:
            died, idx = e, self.call_idx
        _iterations_of(self)[idx] = iteration
        agreed = _agree_on_death(died)
        if agreed is not None:
            stop_every_rank(self, agreed, extra=idx)
        return idx

    return schedule_async_request


def wrap_maybe_finalize_async_calls(upstream: Callable) -> Callable:
    """Factory of the replacement of ``AsyncCallsQueue.maybe_finalize_async_calls``: upstream's;
    a dead worker stops every rank with one line (:func:`stop_every_rank`)."""

    @wraps_upstream(upstream)
    def maybe_finalize_async_calls(self, blocking=False, no_dist=False):
        """Upstream's; a dead checkpoint worker stops the rank with one line instead of a wait
        forever (megatron.fixes.async_worker_death)."""
        try:
            done = upstream(self, blocking, no_dist)
        except AsyncWorkerDied as died:
            stop_every_rank(self, died, agreed=not no_dist)
        known = _iterations_of(self)
        for idx in done or ():
            known.pop(idx, None)
        return done

    return maybe_finalize_async_calls


def wrap_save_checkpoint(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.checkpointing.save_checkpoint``:
    upstream's, with its iteration known to the async queue while it runs (for the line that
    names an unfinished save)."""

    @wraps_upstream(upstream)
    def save_checkpoint(iteration, *args, **kwargs):
        """Upstream's; the iteration is recorded for the async save it schedules
        (megatron.fixes.async_worker_death)."""
        before = getattr(_SAVING, "iteration", None)
        _SAVING.iteration = iteration
        try:
            return upstream(iteration, *args, **kwargs)
        finally:
            _SAVING.iteration = before

    return save_checkpoint


# ---------------------------------------------------------------------------------------------
# The probe
# ---------------------------------------------------------------------------------------------


class _DeadProcess:
    pid = -1
    exitcode = -int(signal.SIGKILL)

    def is_alive(self) -> bool:
        return False

    def join(self, timeout=None) -> None:
        pass


def upstream_waits_for_dead_worker(fn: Callable | None = None, wait_s: float = 0.3) -> bool:
    """Whether upstream's ``PersistentAsyncCaller.is_current_async_call_done`` (or ``fn``),
    blocking and without collectives, on a stand-in caller whose worker is dead and posted
    nothing, is still waiting after ``wait_s`` seconds, or returns as if the save were done (the
    defect). The wait is then released (a completion is posted to the stand-in queue), so no
    thread is left behind."""
    core = importlib.import_module(_CORE)
    cls = core.PersistentAsyncCaller
    fn = fn or cls.is_current_async_call_done
    if fn is is_current_async_call_done:
        raise RuntimeError("this fix's replacement is installed: upstream's cannot be probed")
    caller = object.__new__(cls)
    caller.process, caller.comp_q = _DeadProcess(), queue_module.Queue()
    caller.cur_item, caller.rank = None, 0
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["returned"] = fn(caller, blocking=True, no_dist=True)
        except Exception as e:  # noqa: BLE001 - raising is the right behaviour
            outcome["raised"] = e

    t = threading.Thread(target=run, name="probe-async-worker-death", daemon=True)
    t.start()
    t.join(wait_s)
    waiting = t.is_alive()
    if waiting:
        caller.comp_q.put(0)
        t.join(5)
    caller.process = None  # its __del__ closes nothing
    return waiting or "raised" not in outcome


class AsyncWorkerDeathFix(Fix):
    name = "async_worker_death"
    title = (
        "a dead persistent async checkpoint worker stops every rank with one line instead of a hang"
    )
    upstream_refs = (
        "Megatron-LM issue 6970 (an async checkpoint worker that fails is never noticed; the "
        "trainer waits forever)",
    )
    package = "nvidia-resiliency-ext"

    patches = (
        Patch(
            f"{_CORE}.PersistentAsyncCaller.schedule_async_call",
            wrap_schedule_async_call,
            "the wait for the worker's staging (preload_q.join()) never ends when the worker "
            "is dead",
            params=("async_req",),
        ),
        Patch(
            f"{_CORE}.PersistentAsyncCaller.is_current_async_call_done",
            value(is_current_async_call_done),
            "a dead worker's save is waited for forever (blocking) or reported as still "
            "writing at every iteration",
            params=("blocking", "no_dist"),
        ),
        Patch(
            f"{_CORE}.AsyncCallsQueue.schedule_async_request",
            wrap_schedule_async_request,
            "a worker that died staging a save is known to its rank only: every rank agrees",
            params=("async_request",),
        ),
        Patch(
            f"{_CORE}.AsyncCallsQueue.maybe_finalize_async_calls",
            wrap_maybe_finalize_async_calls,
            "a dead worker stops every rank with one line naming it and the unfinished save",
            params=("blocking", "no_dist"),
        ),
        Patch(
            f"{_CKPT}.save_checkpoint",
            wrap_save_checkpoint,
            "the iteration of an async save, to name it when its worker dies",
            params=("iteration",),
        ),
        Patch(
            "megatron.training.training.save_checkpoint",
            alias_of(f"{_CKPT}.save_checkpoint", only_if_same=True),
            "train()'s binding of save_checkpoint",
        ),
    )

    def upstream_behaves(self) -> bool:
        """Upstream's own blocking check on a stand-in caller with a dead worker
        (:func:`upstream_waits_for_dead_worker`): behaves if it raises within 0.3 s."""
        return not upstream_waits_for_dead_worker()


FIX = AsyncWorkerDeathFix()
