""":class:`ValidatedLocalCheckpointManager`: NVRx's ``LocalCheckpointManager`` whose saves carry
finiteness and identity records and whose loads are decided at the start as inventory
(:mod:`.inventory`, every rank alone), one gather, plan (:mod:`.plan`, a pure function) and
execution (:mod:`.execute`, the collectives the plan needs).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import time
import uuid
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
    CheckpointingException,
)
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)

from megatron.integrity import local_identity, local_layout, torch_save, unpickle
from megatron.integrity.checksum import tensor as ck
from megatron.training_ext.console import process_rank, rank_line
from megatron.training_ext.local_tier.checks import finite_flags, state_tensor_keys
from megatron.training_ext.local_tier.common import (
    FINITE_ATTR,
    FINITE_FORMAT,
    LOG_PREFIX,
    exc_text,
    gather_objects,
    logger,
    megatron_args,
)
from megatron.training_ext.local_tier.component import COMPONENT
from megatron.training_ext.local_tier.execute import Resolution, execute, world_clique
from megatron.training_ext.local_tier.inventory import RankDir, remove_dirty, take_inventory
from megatron.training_ext.local_tier.markers import clear_marker


def _is_write_failure(e: RuntimeError) -> bool:
    """torch.save's writer reports a failed write (ENOSPC, EIO) as a RuntimeError
    (``[enforce fail at inline_container.cc] . unexpected pos ...``, ``file write failed``)."""
    text = str(e)
    return "inline_container" in text or "write failed" in text or "unexpected pos" in text


def _write_error_text(directory, ckpt_id, state_dict, e: Exception) -> str:
    """``rank R could not write DIR (what): about N MB needed, M MB free``."""
    import errno
    import shutil

    try:
        need = sum(t.numel() * t.element_size() for t in state_dict.tensors)
    except Exception:  # noqa: BLE001 - hollow or foreign state dict: size unknown
        need = 0
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    what = (
        os.strerror(e.errno)
        if isinstance(e, OSError) and e.errno
        else "No space left on device"
        if free is not None and need and free < need
        else exc_text(e)
    )
    room = f"about {need / 1e6:.1f} MB needed" if need else "size unknown"
    room += f", {free / 1e6:.1f} MB free" if free is not None else ""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        what = "No space left on device"
    return f"rank {process_rank()} could not write {directory} ({what}: {room})"


def _no_host_clone(state_dict) -> None:
    """A synchronous save writes the tensors before it returns, so NVRx's
    ``copy_tensors_to_cpu`` need not clone the host tensors first (a copy of the whole shard per
    save; it keeps the device-to-host copy of device tensors). Each host tensor that spans its
    whole storage is replaced by a plain tensor sharing its memory (``detach()``) and marked as a
    copy already. Not the ``nn.Parameter`` itself: pickling a parameter pickles its attributes,
    e.g. ``main_grad``, a view of DDP's whole gradient buffer, which ``torch.save`` then writes
    whole (a 78 MB shard became a 130 MB file). A view of part of a larger storage is left to
    NVRx's clone (``torch.save`` writes a view's whole storage)."""
    try:
        sharded = list(state_dict._sharded_tensors)
    except AttributeError:  # not an MCoreTensorAwareStateDict: NVRx clones as before
        return
    for sh in sharded:
        t = sh.data
        if t is None or t.device.type != "cpu" or type(t) not in (torch.Tensor, torch.nn.Parameter):
            continue
        nbytes = t.numel() * t.element_size()
        if t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == nbytes:
            sh.data = t.detach()
            sh.orig_device = "cpu"


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
    * ``find_latest`` (first call of a process, i.e. the load): the start described in
      ``docs/local-tier.md`` (:meth:`_resolve`); returns the local iteration to load, or -1 to
      make upstream load the persistent tier. Later calls (save finalization) are upstream's.
    * ``load``: returns the state dict the resolution verified (and repaired), without reading
      the files again.

    Raises (``find_latest``/``load``): nothing of its own for bad local files (they are rejected
    collectively, with one ``[local-tier]`` line per rank); ``CheckpointingException`` when
    ``load`` is called before ``find_latest`` (as upstream).
    """

    def __init__(self, root_local_ckpt_dir, session_id: str = "", repl_strategy=None):
        super().__init__(root_local_ckpt_dir, session_id=session_id, repl_strategy=repl_strategy)
        self._resolution: Optional[Resolution] = None
        self._generation: Optional[str] = None
        self._identity: Optional[tuple] = None
        self._saved = False
        self._loads_served = 0
        self._set_aside: List[tuple] = []  # (iteration, path) this run must not use (the start)
        self.timings: dict[
            str, float
        ] = {}  # seconds of the start: total, headers, own_primary, agree, repair, identity

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_resolution"] = None  # never ship the loaded state dict to a worker
        return state

    def _identity_parts(self) -> tuple[str, str, dict, dict]:
        """(run id, its source, run settings, topology): the agreed values once a collective
        settled them, else this rank's own (rank 0 creates the run token in ``--save``)."""
        if self._identity is not None:
            return self._identity
        st = COMPONENT.state
        args = megatron_args(st)
        try:
            token = local_identity.run_token(
                getattr(args, "save", None), create=process_rank() == 0
            )
        except local_identity.RunTokenError:
            if process_rank() == 0:  # checked at start; damaged since: never a new identity
                raise
            token = None  # rank 0's identity is the one every rank agrees on

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
            gen, ident = gather_objects((uuid.uuid4().hex, self._identity_parts()))[0]
            self._generation, self._identity = gen, tuple(ident)
        return self._generation

    def save(self, state_dict, iteration, is_async=False):
        generation = self._agree_generation()
        self._first_save()
        if is_async:
            return self._save_async(state_dict, iteration, generation)
        self._mark(state_dict, finite_flags(list(state_dict.tensors)), iteration, generation)
        _no_host_clone(state_dict)
        self._write_error = None
        self._saving_iteration = iteration
        try:
            return super().save(state_dict, iteration, is_async)
        except CheckpointingException as e:  # raised by the finalization on every rank together
            errors = [w for w in gather_objects(self._write_error) if w is not None]
            if not errors:
                raise
            self._skip_failed_save(iteration, errors, e)
            return None

    def _first_save(self) -> None:
        """Before the first save of this process: release what the load held, remove leftovers
        of an interrupted save."""
        if not self._saved:
            self._saved = True
            self._resolution = None  # release what the load held
            removed = remove_dirty(Path(self.local_ckpt_dir))
            if removed:
                rank_line(
                    LOG_PREFIX,
                    f"removed {len(removed)} leftover(s) of an interrupted save: "
                    f"{', '.join(removed)}",
                )

    def _mark(self, state_dict, finite: list, iteration: int, generation: str) -> None:
        """Attach the finiteness flags and the identity record (both travel to every replica)."""
        setattr(
            state_dict,
            FINITE_ATTR,
            {"format": FINITE_FORMAT, "version": 1, "owner_rank": process_rank(), "finite": finite},
        )
        run_id, source, settings, topo = self._identity_parts()
        setattr(
            state_dict,
            local_identity.IDENTITY_ATTR,
            local_identity.make_identity(
                run_id,
                source,
                settings,
                topo,
                iteration,
                process_rank(),
                generation,
                socket.gethostname(),
            ),
        )

    def _save_async(self, state_dict, iteration: int, generation: str):
        """``--async-save``: snapshot the tensors (and those the state digest reads) into a
        staging slot and the rest of the state dict (pickled), queue the background work
        (:meth:`_write_async`), return the request upstream schedules
        (:class:`~.async_save.LocalAsyncRequest`). The tensors are copied here at the first save;
        from the second on (once an optimizer step was seen to wait for it:
        :meth:`~.async_save.AsyncLocalWriter.defer_snapshot`), by the snapshot thread while the
        next iteration's forward and backward run; not while the state dict holds a tensor
        subclass (a quantized weight)."""
        from megatron.training_ext.local_tier import async_save
        from megatron.training_ext.resume_proof.digest import no_torch_function
        from megatron.training_ext.resume_proof.hooks import take_deferred_digest

        t0 = time.perf_counter()
        tier = COMPONENT.state
        if tier.async_writer is None:  # collective: every rank's first asynchronous save
            tier.async_writer = async_save.AsyncLocalWriter(self.repl_strategy)
        writer = tier.async_writer
        digest = take_deferred_digest()
        saved = list(state_dict._sharded_tensors)
        tensors = [sh.data for sh in saved]
        n = len(tensors)
        payload = {"digest": digest, "generation": generation, "writer": writer}
        binding: list = [None]

        def sources() -> List[torch.Tensor]:
            """What to snapshot: the saved tensors, and the blocks the digest sums outside them
            (which rank sums what: :func:`~.async_save.assign_digest`)."""
            if digest is None:
                return tensors
            extra, binding[0] = async_save.assign_digest(digest, saved)
            return tensors + extra

        def stage_done(staged: List[torch.Tensor]) -> None:
            if binding[0] is not None:  # the kept digest sums read the snapshot
                binding[0](staged[:n], staged[n:])
            payload["tensors"] = staged[:n]

        t1 = time.perf_counter()
        slot = writer.slot_for(iteration)
        t2 = time.perf_counter()
        plain = (torch.Tensor, torch.nn.Parameter)
        # a quantized wrapper (Transformer Engine's FP8 weights) may change in a forward pass
        deferred = writer.defer_snapshot() and all(type(t) in plain for t in tensors)
        if not deferred:
            stage_done(slot.stage(sources()))
        t3 = time.perf_counter()
        with no_torch_function():  # moves references: the CPU backend's mode costs per call
            state_dict.pop_tensors()
        # the common state holds live objects (``args``, whose sample counters training moves on):
        # pickled now; the hollow's ShardedTensors are this save's own (upstream drops them)
        payload["common"] = pickle.dumps(state_dict.common, protocol=pickle.HIGHEST_PROTOCOL)
        payload["hollow"] = state_dict
        job = async_save.AsyncJob(iteration, slot, self._write_async, payload=payload)
        if deferred:  # taken by the snapshot thread; the next optimizer step waits for it
            job.sources, job.stage_done = sources, stage_done
        writer.submit(job)
        t4 = time.perf_counter()
        if logger.isEnabledFor(10):  # DEBUG
            logger.debug(
                f"async save {iteration}: setup {1e3 * (t1 - t0):.1f} ms, "
                f"slot {1e3 * (t2 - t1):.1f} ms, "
                + (
                    "snapshot deferred"
                    if deferred
                    else f"stage {1e3 * (t3 - t2):.1f} ms ({slot.nbytes / 1e6:.1f} MB)"
                )
                + f", hollow {1e3 * (t4 - t3):.1f} ms",
            )
        return async_save.LocalAsyncRequest(job, self._finalize_async)

    def _write_async(self, job) -> None:
        """Background thread: the state digest (exchanged over the writer's gloo group), the
        finiteness flags and checksums of the snapshot, replication (over the writer's gloo
        cliques), the write. A failure is left in ``job.error`` for the finalization."""
        from megatron.training_ext.resume_proof.digest import finish_deferred, no_torch_function
        from megatron.training_ext.resume_proof.exchange import DigestExchange, DigestUnavailable
        from megatron.training_ext.resume_proof.hooks import STATE_KEY

        p, it = job.payload, job.iteration
        writer = p["writer"]
        marks = [("start", time.perf_counter() - job.stage_seconds, 0.0)]
        marks.append(("snapshot", time.perf_counter(), time.thread_time()))
        state_dict = p["hollow"]
        state_dict.common = pickle.loads(p["common"])
        state_dict.insert_tensors(p["tensors"])
        if p["digest"] is not None:
            if getattr(writer, "exchange", None) is None:
                writer.exchange = DigestExchange(group=writer.world_group)
            try:
                record = finish_deferred(p["digest"], writer.exchange)
                record.pop("seconds", None)
                state_dict.common[STATE_KEY] = json.dumps(record)
            except DigestUnavailable as e:  # saved without a digest: its load is not proven
                rank_line("[resume-proof]", f"iteration {it}: no state digest for this save ({e})")
        marks.append(("digest", time.perf_counter(), time.thread_time()))
        with no_torch_function():  # host snapshots: the CPU backend's mode only adds cost
            finite = finite_flags(p["tensors"])
        self._mark(state_dict, finite, it, p["generation"])
        marks.append(("finite", time.perf_counter(), time.thread_time()))
        ckpt_id = self._ckpt_id(it)
        if writer.repl_strategy is not None:
            hollows, ids = writer.repl_strategy.replicate(state_dict, ckpt_id)
            items = list(zip(ids, hollows))
            marks.append(("replicate", time.perf_counter(), time.thread_time()))
        else:
            items = [(ckpt_id, state_dict)]
        self._write_error = None
        for cid, sd in items:
            self._save(sd, cid)
            marks.append(("write", time.perf_counter(), time.thread_time()))
            if self._write_error is not None:
                job.error = self._write_error
                return
        if logger.isEnabledFor(10):  # DEBUG
            logger.debug(
                f"async save {it} background: "
                + ", ".join(
                    f"{name} {1e3 * (t - marks[i][1]):.1f} ms"
                    + (f" ({1e3 * (c - marks[i][2]):.1f} CPU)" if i else "")
                    for i, (name, t, c) in enumerate(marks[1:])
                )
            )

    def _finalize_async(self, job, failed: bool) -> bool:
        """Every rank, training loop, once every rank's background work of ``job`` is done (in
        save order). Success: the older local checkpoints go (:meth:`_cleanup`). Failure on any
        rank: every rank removes its files of the iteration and says so as a synchronous save
        does; the previous local checkpoint stays. Returns whether the save succeeded."""
        it = job.iteration
        if failed:
            errors = [e for e in gather_objects(job.error) if e]
            self._cleanup_failed_save(it)
            self._skip_failed_save(
                it,
                errors,
                CheckpointingException(
                    f"Failure during saving local checkpoint from iteration {it} (asynchronous)"
                ),
            )
            return False
        self._cleanup(it)
        self.latest_iteration = it
        logger.debug("asynchronous local save of iteration %d: background %.3f s", it, job.seconds)
        return True

    def _skip_failed_save(self, iteration: int, errors: List[str], e: Exception) -> None:
        """Every rank, after a local save that some rank could not write (NVRx removed the files of
        ``iteration`` everywhere; the previous local checkpoint is intact): one line, training goes
        on with the persistent tier as the fallback until a local save succeeds."""
        rank_line(
            LOG_PREFIX,
            f"local save of iteration {iteration} skipped on every rank: "
            + "; ".join(errors[:4])
            + (f" (and {len(errors) - 4} more)" if len(errors) > 4 else "")
            + f"; training continues (until a local save succeeds, a restart resumes from the "
            f"newest complete local or persistent checkpoint) [{exc_text(e)}]",
        )

    def _save(self, state_dict, ckpt_id):
        if self.repl_strategy is None:
            try:
                has_record = ck.get_record(state_dict) is not None
            except ValueError:
                has_record = True  # leave a foreign record alone; load reports it
            if not has_record:
                try:
                    tensors = list(state_dict.tensors)
                    names = state_tensor_keys(state_dict, len(tensors))
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
        try:
            return self._write_archive(state_dict, ckpt_id)
        except (OSError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not _is_write_failure(e):
                raise
            # a full or failing local disk: not raised, or this rank would leave the others in
            # the save's barrier; the finalization (find_latest -> _withdraw_failed_save) then
            # fails the save on every rank, and save() above names this rank's error
            stale.unlink(missing_ok=True)
            self._write_error = _write_error_text(self.local_ckpt_dir, ckpt_id, state_dict, e)
            logger.warning("local checkpoint %s not written: %s", ckpt_id, self._write_error)
            return None

    _write_error: Optional[str] = None

    def _write_archive(self, state_dict, ckpt_id) -> None:
        """NVRx's ``LocalCheckpointManager._save`` (the file created exclusively under its
        ``.dirty`` name, written, renamed; ``SameMachineReplicationException`` if it exists), with
        the archive written by :func:`megatron.integrity.torch_save.save_archive`: no CRC-32 of
        the tensor records, which ``torch.load`` never checks and every tensor's XXH3 checksum
        replaces (42 of 65 ms for a 78 MB file); the pickle keeps its CRC-32."""
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
            SameMachineReplicationException,
        )

        self._ensure_dir()
        save_path = self._local_ckpt_path_from_id(ckpt_id, True)
        try:
            with open(save_path, "bx+") as f:
                torch_save.save_archive(state_dict, f)
        except FileExistsError as e:
            raise SameMachineReplicationException(ckpt_id) from e
        save_path.rename(self._local_ckpt_path_from_id(ckpt_id, False))

    def _load(self, ckpt_id):
        """NVRx's ``_load`` (``torch.load(weights_only=False)``) restricted to the allowlist of
        :mod:`megatron.integrity.unpickle`: a file naming any other global raises
        :class:`~megatron.integrity.unpickle.UnsafeCheckpointError` (the start treats it as a bad
        copy) and nothing it names is imported. ``CheckpointingException`` for a missing file, as
        NVRx."""
        path = self._local_ckpt_path_from_id(ckpt_id)
        try:
            return unpickle.torch_load(path)
        except FileNotFoundError as e:
            raise CheckpointingException(f"File {path} does not exist!") from e

    def _cleanup(self, iteration):
        """After the local save of ``iteration`` completed: NVRx removes the older files; then the
        files set aside at start go (:meth:`drop_set_aside`), and the bad-tier marker."""
        result = super()._cleanup(iteration)
        self.drop_set_aside(iteration)
        clear_marker(self, iteration)
        return result

    def _withdraw_failed_save(self) -> None:
        """Collective, in the finalization of a local save (NVRx's ``find_latest``): when any rank
        could not write a file of the iteration being saved (:attr:`_write_error`, or its own shard
        missing, as after a failed ``--async-save`` write), every rank removes its files of that
        iteration, so the save counts as failed everywhere and the previous local checkpoint, with
        all its copies, is kept (NVRx alone would count a shard held only as another rank's replica
        as saved and remove the previous checkpoint)."""
        iteration = self._saving_iteration
        if iteration is None:
            return
        self._saving_iteration = None
        own = self._local_ckpt_path_from_id(self._ckpt_id(iteration), False)
        own_missing = not own.exists()
        if not any(gather_objects(self._write_error is not None or own_missing)):
            return
        for ckpt_id in self._my_ckpt_ids():
            if ckpt_id[0] == iteration:
                self._local_ckpt_path_from_id(ckpt_id, False).unlink(missing_ok=True)
        if self._write_error is None and own_missing:
            self._write_error = f"rank {self.rank}: its own shard {own} is missing after the save"

    _saving_iteration: Optional[int] = None

    def _my_ckpt_ids(self):
        """NVRx's, without the shards of ranks beyond this world (files of a larger DP size, set
        aside at start): NVRx counts an iteration complete only when its shards are exactly this
        world's ranks, so such a file left next to a new save of the same iteration made that
        save fail (``Failure during saving local checkpoint ... (last valid iteration is -1)``)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return [id_ for id_ in super()._my_ckpt_ids() if id_[1] < world]

    def find_latest(self):
        if self._saved and self.latest_iteration == -1:
            self._withdraw_failed_save()
        if (
            self._saved
            or COMPONENT.state is None
            or not (dist.is_available() and dist.is_initialized())
        ):
            return super().find_latest()
        if self._resolution is None:
            self._resolution = self._resolve()
        self.latest_iteration = self._resolution.iteration
        return self._resolution.iteration

    def load(self):
        writer = None if COMPONENT.state is None else COMPONENT.state.async_writer
        if writer is not None:  # the load overwrites what a deferred snapshot may still copy
            writer.wait_staged()
        res = self._resolution
        if res is None or res.iteration == -1 or res.state_dict is None:
            if self.latest_iteration == -1:
                raise CheckpointingException(
                    "The 'find_latest' method must be called before invoking the 'load' function."
                )
            return super().load()
        st = COMPONENT.state
        st.manager = self
        st.local_load_iteration = res.iteration
        self._loads_served += 1
        sd, cid = res.state_dict, res.ckpt_id
        if self._loads_served >= 2:  # upstream reads twice (arguments, then the state)
            res.state_dict = None
        return sd, cid

    def _resolve(self) -> Resolution:
        """Collective: what this load uses. Every rank takes its inventory (no collective), the
        inventories are gathered once, and every rank carries out the plan decided from them
        (``docs/local-tier.md``)."""
        tier = COMPONENT.state
        tier.manager = self
        t0 = time.perf_counter()
        rank_dir = RankDir(Path(self.local_ckpt_dir), self.session_id, self.rank, self._load)
        identity = self._identity_parts()
        can_repair = self.repl_strategy is not None or world_clique() is not None
        taken = take_inventory(rank_dir, identity, megatron_args(tier), can_repair)
        t_gather = time.perf_counter()
        timings = {
            "own_primary": taken.own_primary_s,
            "headers": t_gather - t0 - taken.own_primary_s,
        }
        inventories = gather_objects(taken.inventory)
        timings["agree"] = time.perf_counter() - t_gather
        self._generation, self._identity = inventories[0].generation, tuple(inventories[0].identity)
        if identity[0] != self._identity[0]:
            logger.debug(
                "rank %d derives run id %s, rank 0 %s: using rank 0's",
                rank_dir.rank,
                identity[0],
                self._identity[0],
            )
        self.globally_available_ids = [
            [(c.iteration, c.owner, self.session_id) for c in inv.copies if not c.sibling]
            for inv in inventories
        ]
        outcome = execute(
            rank_dir,
            inventories,
            taken.loaded,
            tier=tier,
            repl_strategy=self.repl_strategy,
            timings=timings,
            t0=t0,
        )
        self._set_aside, self.timings = outcome.set_aside, outcome.timings
        return outcome.resolution

    def drop_set_aside(self, saved_iteration: int) -> int:
        """After the local save of ``saved_iteration`` completed on every rank: delete the files
        the start set aside (not those the save just rewrote under the same name; a shard of a
        rank beyond this world, written at a larger DP size, is never rewritten). Returns how
        many."""
        dropped = 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        for it, p in self._set_aside:
            parsed = local_layout.parse_local_name(p.name)
            if it != saved_iteration or (parsed is not None and parsed[1] >= world):
                try:
                    p.unlink()
                    dropped += 1
                except FileNotFoundError:
                    pass
        self._set_aside = []
        return dropped
