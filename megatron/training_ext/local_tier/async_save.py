"""Asynchronous local saves (``--async-save`` with ``--non-persistent-ckpt-type local``): the
snapshot of the state into reusable staging buffers is taken by a snapshot thread while the next
iteration's forward and backward run (every optimizer step waits for it: torch's global pre-step
hook); checks, checksums, the state digest, replication and the write run in a writer thread.

Upstream hands a local save request to the persistent checkpoint worker, which cannot take it
(NVRx's request holds a process group: ``TypeError`` at the first save). Here the request never
leaves the process: :func:`route_schedule` keeps it in this module's queue, and
:func:`wrap_maybe_finalize` finalizes it in the training loop once every rank's background work is
done (one all-reduce per iteration while a save is pending), in save order. The background thread
owns gloo process groups created for it on every rank in the same order, so none of its collectives
interleaves with the training loop's. Staging buffers are per storage, in two slots (double
buffering; the second is allocated only when the background falls behind an interval); on CUDA
they are pinned host memory filled by a device-to-host copy that the thread waits for.
"""

from __future__ import annotations

import copy
import queue
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.training_ext.console import rank_line
from megatron.training_ext.local_tier.common import (
    LOG_PREFIX,
    exc_text,
    flag_device,
    gather_objects,
    logger,
)

__all__ = [
    "AsyncJob",
    "AsyncLocalWriter",
    "LocalAsyncRequest",
    "StagingSlot",
    "assign_digest",
    "pending_requests",
    "route_schedule",
    "stop_writer",
    "wrap_maybe_finalize",
]


#: Per-save samples kept for the end-of-run line (the most recent ones).
_SAMPLES = 4096


class StagingSlot:
    """Reusable host buffers holding one snapshot: one byte buffer per distinct storage (so
    views of one storage, e.g. the digest's pieces of a parameter and the state dict's tensor,
    share one copy), or per tensor when a tensor uses less than half of its storage.

    Buffers are taken from the previous snapshot's by size, so a run whose tensors keep their
    sizes allocates them once. ``pinned``: CUDA sources are copied into pinned memory without
    blocking; :meth:`wait` waits for those copies."""

    def __init__(self) -> None:
        self.buffers: List[torch.Tensor] = []
        self.event: Any = None
        self.nbytes = 0

    def _take(self, pool: dict, nbytes: int, pinned: bool) -> torch.Tensor:
        free = pool.get((nbytes, pinned))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def stage(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Copies of ``tensors`` (same dtype, shape and strides, on the CPU) in this slot's
        buffers; the previous snapshot's views become invalid. Tensors without a plain storage
        (quantized wrappers) are cloned. Blocks for the copies on the CPU only. Runs without
        torch function modes (the CPU backend's costs ~50 us per tensor call; the copies need no
        device mapping: every device is the source tensor's own)."""
        from megatron.training_ext.resume_proof.digest import no_torch_function

        with no_torch_function():
            return self._stage(tensors)

    def _stage(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        pool: dict = {}
        for b in self.buffers:
            pool.setdefault((b.numel(), b.is_pinned()), []).append(b)
        storages: dict = {}
        keys: List[Any] = []
        for t in tensors:
            key = None
            try:
                if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
                    st = t.untyped_storage()
                    key = (t.device, st.data_ptr(), st.nbytes())
                    storages.setdefault(key, [st, 0])[1] += t.numel() * t.element_size()
            except (RuntimeError, NotImplementedError):
                key = None
            keys.append(key)
        buffers: List[torch.Tensor] = []
        copied: dict = {}
        out: List[torch.Tensor] = []
        for t, key in zip(tensors, keys):
            if key is None:
                out.append(t.detach().to("cpu", copy=True))
                continue
            st, used = storages[key]
            pinned = t.device.type == "cuda"
            if 2 * used >= st.nbytes():  # copy the storage once, view into it
                if key not in copied:
                    buf = self._take(pool, st.nbytes(), pinned)
                    src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
                    buf.copy_(src, non_blocking=pinned)
                    buffers.append(buf)
                    copied[key] = buf
                buf = copied[key]
                view = torch.empty(0, dtype=t.dtype)
                out.append(
                    view.set_(buf.untyped_storage(), t.storage_offset(), t.size(), t.stride())
                )
            else:  # a small view of a large storage: copy the tensor alone
                nbytes = t.numel() * t.element_size()
                buf = self._take(pool, nbytes, pinned)
                dst = (
                    buf.view(t.dtype).view(t.shape) if nbytes else torch.empty_like(t, device="cpu")
                )
                dst.copy_(t.detach(), non_blocking=pinned)
                buffers.append(buf)
                out.append(dst)
        self.buffers = buffers
        self.nbytes = sum(b.numel() for b in buffers)
        self.event = None
        if any(b.is_pinned() for b in buffers) and torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record()
        return out

    def wait(self) -> None:
        """Wait for the device-to-host copies of the last :meth:`stage` (no-op on the CPU)."""
        if self.event is not None:
            self.event.synchronize()


def assign_digest(digest: Any, saved: List[Any]) -> tuple:
    """Which rank sums each recorded block of a deferred state digest recorded for every replica
    (:func:`~megatron.training_ext.resume_proof.digest.deferred_training_state` with
    ``all_replicas``), so that a rank snapshots only what it saves: a block inside a shard of the
    state dict (the first such shard, in state dict order) and recorded by every replica
    (``replicated``) is summed by the rank that saves that shard, from the snapshot of the shard,
    when the shard is the main replica apart from its DP index; any other block (outside the
    shards, or one not every replica records: the distributed optimizer's per-rank ranges) by its
    main replica, as the live digest does, from the snapshot of a shard this rank saves when it
    lies in one. Every block is summed once over all ranks: the DP group's copies of a shard are
    laid out alike and upstream's distribution saves exactly one of them. Drops the other sums
    from ``digest``.

    Args:
        digest: the :class:`~megatron.training_ext.resume_proof.digest.DeferredDigest`; its
            ``shards`` (:func:`~megatron.training_ext.resume_proof.digest.shard_regions` of the
            save's state dict, taken before upstream's distribution dropped the shards other
            ranks save) say where the shards lie; none: every block goes to its main replica.
        saved: the ``ShardedTensor`` objects this rank saves, in the state dict's ``tensors``
            order.

    Returns:
        ``(extra, bind)``: the tensors to snapshot besides the saved ones (blocks summed outside
        any saved shard), and ``bind(staged_saved, staged_extra)``, which points the kept sums at
        the snapshot.
    """
    from megatron.training_ext.resume_proof.digest import no_torch_function, storage_range

    digest.record()  # a lazy deferred digest records its blocks now
    index = {id(sh): i for i, sh in enumerate(saved)}
    by_storage: dict = {}
    for r in digest.shards or ():
        by_storage.setdefault(r.storage, []).append(r)
    keep: List[bool] = []
    covered: List[tuple] = []
    extra: List[Any] = []
    with no_torch_function():  # reads only: the CPU backend's mode costs ~50 us per call
        places = [storage_range(s.read()) for _, s in digest.recorded]
    for (_, s), where in zip(digest.recorded, places):
        shard = None
        if where is not None and where[2] > where[1]:
            shard = next(
                (r for r in by_storage.get(where[0], ()) if r.lo <= where[1] and where[2] <= r.hi),
                None,
            )
        i = None if shard is None else index.get(id(shard.sharded))
        if shard is not None and s.replicated:
            k = i is not None and shard.main
        else:  # the live digest's rule: e.g. the distributed optimizer's per-rank ranges
            k = bool(s.main)
        if k and i is not None:
            covered.append((s, i, where[1] - shard.lo))
        elif k:
            extra.append(s)
        keep.append(k)
    digest.keep(keep)

    def bind(staged_saved: List[torch.Tensor], staged_extra: List[torch.Tensor]) -> None:
        with no_torch_function():
            for s, i, off in covered:
                t = s.read()
                n = t.numel() * t.element_size()
                flat = staged_saved[i].detach().reshape(-1).view(torch.uint8)
                s.rebind(flat[off : off + n].view(t.dtype).view(t.shape))
        for s, t in zip(extra, staged_extra, strict=True):
            s.rebind(t)

    return [s.read() for s in extra], bind


@dataclass
class AsyncJob:
    """One asynchronous local save: what the training loop snapshotted and what the background
    thread found. ``work`` runs in the thread; ``error`` is this rank's failure text.

    ``sources``: a deferred snapshot (:meth:`AsyncLocalWriter.wait_staged`): the snapshot thread
    calls it for the tensors to copy into ``slot``, then ``stage_done(staged)``, before ``work``;
    ``staged`` is set once the snapshot is taken (at once when the training loop took it)."""

    iteration: int
    slot: StagingSlot
    work: Callable[["AsyncJob"], None]
    payload: dict = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    staged: threading.Event = field(default_factory=threading.Event)
    sources: Optional[Callable[[], List[torch.Tensor]]] = None
    stage_done: Optional[Callable[[List[torch.Tensor]], None]] = None
    error: Optional[str] = None
    seconds: float = 0.0
    stage_seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of the snapshot and writer threads on this job


class LocalAsyncRequest:
    """What ``LocalCheckpointManager.save(..., is_async=True)`` returns: upstream's
    ``save_checkpoint`` adds its finalize functions and schedules it (:func:`route_schedule`
    keeps it here). ``finalize(failed)`` runs on every rank together once every rank's job is
    done (:func:`finalize_pending`)."""

    def __init__(self, job: AsyncJob, finalize: Callable[[AsyncJob, bool], bool]) -> None:
        self.job = job
        self.finalize_fns: List[Callable[[], Any]] = []
        self._finalize = finalize

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Upstream's interface: ``fn`` runs after the save completed on every rank."""
        self.finalize_fns.append(fn)

    def finalize(self, failed: bool) -> None:
        """The manager's finalization; upstream's functions only when the save succeeded."""
        if self._finalize(self.job, failed):
            for fn in self.finalize_fns:
                fn()


class AsyncLocalWriter:
    """The background thread of one manager, its process groups and its two staging slots.

    Built collectively (every rank, in the same order, from the training loop at the first
    asynchronous save): a gloo group of the world (the digest's exchange) and, with replication,
    one gloo group per replication clique (the background copy of the replication strategy).
    """

    def __init__(self, repl_strategy: Any = None) -> None:
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else None
        world = dist.get_world_size()
        self.world_group = dist.new_group(list(range(world)), backend="gloo")
        self.repl_strategy = None
        if repl_strategy is not None:
            from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import (
                GroupWrapper,
            )

            mine = tuple(int(r) for r in repl_strategy.local_group.ranks)
            cliques = sorted({tuple(c) for c in gather_objects(mine)})
            groups = {c: dist.new_group(list(c), backend="gloo") for c in cliques}
            self.repl_strategy = copy.copy(repl_strategy)
            self.repl_strategy.local_group = GroupWrapper(groups[mine])
        self.slots = [StagingSlot()]
        self.slot_jobs: List[Optional[AsyncJob]] = [None]
        self.warned_behind = False
        self.waited_s = 0.0
        self.exchange: Any = None  # the state digest's exchange over world_group (the thread's)
        self._current = 0
        self._last: Optional[AsyncJob] = None
        self.steps = 0  # optimizer steps seen by the pre-step hook
        # per job but the first, the last _SAMPLES: CPU time of the background threads, and wall
        # time of the deferred snapshot (a run saving every iteration for days stays bounded)
        self.jobs_done = 0
        self.first_sample = (0.0, 0.0)
        self.job_cpu: deque = deque(maxlen=_SAMPLES)
        self.job_snapshot: deque = deque(maxlen=_SAMPLES)
        self._steps_at_save: Optional[int] = None
        self._queue: queue.Queue = queue.Queue()
        self._stage_queue: queue.Queue = queue.Queue()
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hook = register_optimizer_step_pre_hook(self._before_step)
        self._stager = threading.Thread(
            target=self._stage_run, name="local-ckpt-stage", daemon=True
        )
        self._thread = threading.Thread(target=self._run, name="local-ckpt-writer", daemon=True)
        self._stager.start()
        self._thread.start()

    def _before_step(self, *_: Any) -> None:
        """Every optimizer's pre-step hook (torch's global one): the last save's snapshot is
        taken before the step changes what it copies."""
        self.steps += 1
        self.wait_staged()

    def wait_staged(self) -> None:
        """Wait until the last submitted save's snapshot is taken (its device-to-host copies
        done); called before anything may change the saved tensors: an optimizer step, a load."""
        job = self._last
        if job is not None and not job.staged.is_set():
            t0 = time.perf_counter()
            job.staged.wait()
            self.waited_s += time.perf_counter() - t0
        if job is not None:
            job.slot.wait()

    def defer_snapshot(self) -> bool:
        """Whether this save's snapshot may be taken by the thread while training goes on: only
        once the pre-step hook has been seen to run between two saves (so an optimizer step
        waits for the snapshot: parameters and optimizer state change only in the step; forward
        and backward write gradients, which a local checkpoint does not hold). The first save,
        and every save of a run whose optimizer steps bypass the hook, snapshot in the loop."""
        seen, self._steps_at_save = self._steps_at_save, self.steps
        return seen is not None and self.steps > seen

    def _stage_run(self) -> None:
        """The snapshot thread: takes deferred snapshots in submission order (so a snapshot never
        waits for an older save's background work), then hands each job to the writer thread."""
        if self.cuda_device is not None:  # a new thread's current device is 0
            torch.cuda.set_device(self.cuda_device)
        while True:
            job = self._stage_queue.get()
            if job is not None and job.sources is not None:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    job.stage_done(job.slot.stage(job.sources()))
                except BaseException as e:  # noqa: BLE001 - reported at finalization
                    job.error = f"snapshot: {exc_text(e)}"
                finally:
                    job.sources = None
                    job.stage_seconds = time.perf_counter() - t0
                    job.cpu_seconds += time.thread_time() - c0
                    job.staged.set()
            self._queue.put(job)
            if job is None:
                return

    def _run(self) -> None:
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)
        while True:
            job = self._queue.get()
            if job is None:
                return
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                if job.error is None:  # else the snapshot failed: nothing to write
                    job.slot.wait()
                    job.work(job)
            except BaseException as e:  # noqa: BLE001 - reported at finalization on every rank
                job.error = job.error or f"{exc_text(e)}"
                logger.warning("async local save of iteration %d failed", job.iteration)
            finally:
                job.seconds = time.perf_counter() - t0
                job.cpu_seconds += time.thread_time() - c0
                self.jobs_done += 1
                if self.jobs_done == 1:  # it also loads the digest's compiled kernels
                    self.first_sample = (job.cpu_seconds, job.stage_seconds)
                else:
                    self.job_cpu.append(job.cpu_seconds)
                    self.job_snapshot.append(job.stage_seconds)
                job.payload.clear()  # release the snapshot's views
                job.done.set()

    def slot_for(self, iteration: int) -> StagingSlot:
        """A slot whose previous snapshot the thread no longer reads: a free one, a second one
        (allocated the first time the background is still busy at a save), else the oldest,
        after waiting for its job (said once: the background fell behind a whole interval)."""
        for i, job in enumerate(self.slot_jobs):
            if job is None or job.done.is_set():
                return self._use(i)
        if len(self.slots) < 2:
            self.slots.append(StagingSlot())
            self.slot_jobs.append(None)
            return self._use(len(self.slots) - 1)
        oldest = min(range(len(self.slots)), key=lambda i: self.slot_jobs[i].iteration)
        t0 = time.perf_counter()
        self.slot_jobs[oldest].done.wait()
        self.waited_s += time.perf_counter() - t0
        if not self.warned_behind:
            self.warned_behind = True
            rank_line(
                LOG_PREFIX,
                f"asynchronous local save of iteration {iteration} waited "
                f"{time.perf_counter() - t0:.2f} s for the background writes of iterations "
                f"{sorted(j.iteration for j in self.slot_jobs)}: the background work of a save "
                "takes longer than the save interval (said once; consider a longer "
                "--non-persistent-save-interval)",
            )
        return self._use(oldest)

    def _use(self, i: int) -> StagingSlot:
        self._current = i
        return self.slots[i]

    def submit(self, job: AsyncJob) -> None:
        """Queue ``job`` for the thread (jobs run one at a time, in submission order on every
        rank, so the thread's collectives match)."""
        self.slot_jobs[self._current] = job
        self._last = job
        if job.sources is None:
            job.staged.set()
        self._stage_queue.put(job)

    def staging_bytes(self) -> int:
        """Bytes of host memory the slots hold."""
        return sum(s.nbytes for s in self.slots)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread after the queued jobs (their requests are not finalized); one line
        on what the background cost: CPU time per save (the competition with training on a
        machine whose cores training uses), the snapshot's time, and how long the training loop
        waited for the background."""
        self._hook.remove()
        if self._thread.is_alive():
            self._stage_queue.put(None)
            self._thread.join(timeout)
        if self.jobs_done:
            cpu = self.job_cpu or [self.first_sample[0]]  # one save: the first's figures
            snap = self.job_snapshot or [self.first_sample[1]]
            rank_line(
                LOG_PREFIX,
                f"asynchronous local saves: {self.jobs_done}; background per save (median, "
                f"the first save apart) {1e3 * statistics.median(cpu):.1f} ms "
                f"CPU, snapshot {1e3 * statistics.median(snap):.1f} ms; the "
                f"training loop waited {self.waited_s:.2f} s for the background in all",
            )


_NONE: deque = deque()  # while the tier is not installed: nothing is pending


def pending_requests() -> deque:
    """The scheduled asynchronous local save requests not finalized yet, oldest first (kept in
    the install's state, ``COMPONENT.state.async_pending``, so a new attempt starts with none)."""
    from megatron.training_ext.local_tier.component import COMPONENT

    st = COMPONENT.state
    return _NONE if st is None else st.async_pending


def finalize_pending(blocking: bool) -> int:
    """Collective (every rank, training loop): finalize the oldest pending requests whose jobs
    are done on every rank, in save order (``blocking``: wait for all). One all-reduce of two
    ints per request considered: (some rank not done, some rank failed). Returns how many."""
    n = 0
    pending = pending_requests()
    while pending:
        request = pending[0]
        if blocking:
            request.job.done.wait()
        done = request.job.done.is_set()
        flags = torch.tensor(
            [0 if done else 1, 1 if done and request.job.error else 0],
            dtype=torch.int32,
            device=flag_device(),
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        not_done, failed = flags.tolist()
        if not_done:
            return n
        pending.popleft()
        request.finalize(bool(failed))
        n += 1
    return n


def stop_writer() -> None:
    """Stop the install's background thread, if any (after its queued jobs); the next
    asynchronous save starts a new one."""
    from megatron.training_ext.local_tier.component import COMPONENT

    st = COMPONENT.state
    writer = None if st is None else st.async_writer
    if writer is not None:
        st.async_writer = None
        writer.close()


def route_schedule(upstream: Any) -> Any:
    """Patch factory for ``megatron.training.checkpointing.schedule_async_save``: an asynchronous
    local save request stays in this process (:func:`pending_requests`); any other goes to
    upstream's queue (the persistent checkpoint worker)."""
    from megatron.overlay import wraps_upstream

    @wraps_upstream(upstream)
    def schedule_async_save(async_request, *a, **kw):
        """Upstream's, except for asynchronous local saves (kept in this process)."""
        if isinstance(async_request, LocalAsyncRequest):
            pending_requests().append(async_request)
            return None
        return upstream(async_request, *a, **kw)

    return schedule_async_save


def wrap_maybe_finalize(upstream: Any) -> Any:
    """Patch factory for ``maybe_finalize_async_save``: upstream's (the persistent worker's
    requests), then the asynchronous local saves done on every rank (all of them with
    ``blocking``); ``terminate`` also stops the background thread."""
    from megatron.overlay import wraps_upstream

    @wraps_upstream(upstream)
    def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False):
        """Upstream's, then this process's asynchronous local saves."""
        result = upstream(blocking=blocking, terminate=terminate)
        if pending_requests() and dist.is_available() and dist.is_initialized():
            finalize_pending(blocking)
        if terminate:
            stop_writer()
        return result

    return maybe_finalize_async_save
