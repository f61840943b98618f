""":class:`ValidatedLocalCheckpointManager`: NVRx's ``LocalCheckpointManager`` whose saves carry
finiteness and identity records and whose loads go through the collective resolution
(:mod:`.resolve`).
"""

from __future__ import annotations

import os
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

from megatron.integrity import checksums as ck
from megatron.integrity import local_identity, local_layout
from megatron.training_ext.local_tier import common, reshard
from megatron.training_ext.local_tier.checks import (
    finite_flags,
    header_fingerprint,
    state_tensor_keys,
    verify_state_dict,
)
from megatron.training_ext.local_tier.common import (
    FINITE_ATTR,
    FINITE_FORMAT,
    exc_text,
    gather_objects,
    logger,
    megatron_args,
    process_rank,
    say,
    shorten,
)
from megatron.training_ext.local_tier.markers import clear_marker
from megatron.training_ext.local_tier.resolve import LocalCopy, LocalTierResolution, Resolution


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


class ValidatedLocalCheckpointManager(LocalTierResolution, LocalCheckpointManager):
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
        self._resolution: Optional[Resolution] = None
        self._generation: Optional[str] = None
        self._identity: Optional[tuple] = None
        self._saved = False
        self._loads_served = 0
        self._set_aside: List[tuple] = []  # (iteration, path) this run must not use (resolve)
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
        args = megatron_args()
        st = common.STATE
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
        if not self._saved:
            self._saved = True
            self._resolution = None  # release what the load held
            removed = self._remove_dirty()
            if removed:
                say(
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
                "owner_rank": process_rank(),
                "finite": finite_flags(tensors),
            },
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

    def _skip_failed_save(self, iteration: int, errors: List[str], e: Exception) -> None:
        """Every rank, after a local save that some rank could not write (NVRx removed the files of
        ``iteration`` everywhere; the previous local checkpoint is intact): one line, training goes
        on with the persistent tier as the fallback until a local save succeeds."""
        say(
            f"local save of iteration {iteration} skipped on every rank: "
            + "; ".join(errors[:4])
            + (f" (and {len(errors) - 4} more)" if len(errors) > 4 else "")
            + f"; training continues (until a local save succeeds, a restart resumes from the "
            f"newest complete local or persistent checkpoint) [{exc_text(e)}]"
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
            return super()._save(state_dict, ckpt_id)
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

    def _cleanup(self, iteration):
        """After the local save of ``iteration`` completed: NVRx removes the older files; then the
        files set aside at start go (:meth:`drop_set_aside`), and the bad-tier marker."""
        result = super()._cleanup(iteration)
        self.drop_set_aside(iteration)
        clear_marker(self, iteration)
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
            or common.STATE is None
            or not (dist.is_available() and dist.is_initialized())
        ):
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
        st = common.STATE
        st.manager = self
        st.local_load_iteration = res.iteration
        self._loads_served += 1
        sd, cid = res.state_dict, res.ckpt_id
        if self._loads_served >= 2:  # upstream reads twice (arguments, then the state)
            res.state_dict = None
        return sd, cid

    def _inspect(
        self, run_id: str, settings: dict, topo: dict
    ) -> tuple[List[LocalCopy], dict, List[str]]:
        """This rank's local files: the header of every copy (memory-mapped, no tensor data read),
        and the own primary of the newest iteration fully loaded and verified (checksums,
        finiteness). Returns (copies, {ckpt_id: (state dict, summary)}, leftovers removed)."""
        me = process_rank()
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
            c = self._inspect_file(it, owner, path, me, run_id, settings, topo)
            copies.append(c)
            if c.problem is None and c.foreign is None and owner == me and it == speculative:
                self._verify_own(c, loaded)
        # files in the other rank directories of this host: after a restart at another DP size
        # rank numbers move between nodes (used only to reshard, see reshard.py)
        rescan = all(c.saved_topology is not None for c in copies)  # no file of this topology
        for sub in _sibling_dirs(d) if rescan else ():
            for p in sub.iterdir():
                parsed = local_layout.parse_local_name(p.name)
                if parsed is None or parsed[2] or not p.is_file():
                    continue
                c = self._inspect_file(parsed[0], parsed[1], p, me, run_id, settings, topo)
                if c.saved_topology is not None:
                    c.sibling = True
                    copies.append(c)
        return copies, loaded, leftovers

    def _inspect_file(self, it, owner, path, me, run_id, settings, topo) -> LocalCopy:
        """One local file's header judged against this run (no tensor data read)."""
        dir_rank = int(path.parent.name) if path.parent.name.isdigit() else None
        c = LocalCopy(it, owner, me, None, path=str(path), dir_rank=dir_rank)
        try:
            try:
                header = local_identity.read_header(path)
            except Exception:  # noqa: BLE001 - let torch tell what is wrong with the file
                header = torch.load(path, mmap=True, weights_only=False)
            rec = local_identity.get_identity(header)
        except Exception as e:  # noqa: BLE001 - a truncated/unreadable file is this copy's problem
            c.problem = f"unreadable: {exc_text(e)}"
            return c
        problems = local_identity.identity_problems(rec, run_id, settings, topo, it, owner)
        if rec is not None:
            c.run_id, c.token = rec.get("run_id"), rec.get("save_token")
            if c.run_id != run_id:  # decided collectively against the agreed run id
                c.foreign, problems = problems[0], problems[1:]
            saved = rec.get("topology")
            if problems and reshard.dp_only_change(saved, topo) is None:
                rest = local_identity.identity_problems(rec, run_id, settings, saved, it, owner)
                if c.foreign is not None:
                    rest = rest[1:]
                if not rest:
                    c.saved_topology = dict(saved)
        c.problem = "; ".join(problems) or None
        c.fingerprint = header_fingerprint(header)
        return c

    def _verify_own(self, c: LocalCopy, loaded: dict) -> None:
        """Load this rank's primary ``c`` as upstream does and check it against its checksums and
        finiteness record; sets ``c.problem`` or stores it in ``loaded``."""
        cid = self._ckpt_id(c.iteration)
        t0 = time.perf_counter()
        try:
            sd = self._load(cid)  # host tensors as stored: verified before they go to the device
            errors, summary = verify_state_dict(
                sd, f"rank {c.holder}'s primary", check_checksums=True
            )
            sd.restore_tensor_device(non_blocking=False)
        except Exception as e:  # noqa: BLE001
            errors, summary = [f"unreadable: {exc_text(e)}"], ""
        self.timings["own_primary"] = (
            self.timings.get("own_primary", 0.0) + time.perf_counter() - t0
        )
        c.bytes_verified = True
        if errors:
            c.problem = shorten("; ".join(errors), 400)
        else:
            loaded[cid] = (sd, summary)


def _sibling_dirs(own: Path) -> List[Path]:
    """The other ``<rank>/`` directories next to this rank's local checkpoint directory."""
    root = own.parent
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and p.name != own.name),
        key=lambda p: int(p.name),
    )
