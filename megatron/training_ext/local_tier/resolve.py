"""The collective decision of a local-tier load: which local iteration every rank uses, which
shards are repaired from verified replicas, or why the tier is rejected for the persistent one.
:class:`LocalTierResolution` is the part of :class:`ValidatedLocalCheckpointManager` that makes it.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

from megatron.integrity import local_identity, local_layout, persistent_dirs
from megatron.training_ext.local_tier import common, reshard
from megatron.training_ext.local_tier.checks import strategy_verifies, verify_state_dict
from megatron.training_ext.local_tier.common import (
    MARKER_NAME,
    exc_text,
    gather_objects,
    logger,
    megatron_args,
    process_rank,
    say,
    shorten,
    summarize,
)
from megatron.training_ext.local_tier.markers import describe_marker, read_marker


@dataclass
class LocalCopy:
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
    path: Optional[str] = None  # where the holder reads it
    dir_rank: Optional[int] = None  # the rank directory it is in (== owner: the primary)
    sibling: bool = False  # in another rank's directory on the holder's host (reshard only)
    saved_topology: Optional[dict] = None  # set when only the DP size differs (reshard.py)


@dataclass
class _Report:
    """What one rank found at the start of a load (gathered to all ranks)."""

    rank: int
    host: str
    identity: tuple  # (run id, source, run settings, topology)
    generation: str
    marker: Optional[dict]
    persistent: Optional[int]
    copies: List[LocalCopy]
    leftovers: List[str]


@dataclass
class Resolution:
    """The collective decision of a load: which local iteration, and where each shard comes from."""

    iteration: int  # -1: not the local tier
    state_dict: Any = None
    ckpt_id: Any = None
    line: str = ""


def _no_verified_copy(owner: int, copies: List[LocalCopy]) -> str:
    """Why no copy of ``owner``'s shard can be used: each copy's holder, role and problem."""
    detail = (
        "; ".join(
            f"rank {c.holder}'s {'primary' if c.holder == owner else 'replica'}: {c.problem}"
            for c in copies
        )
        or "no copy on any rank"
    )
    return f"no verified copy of rank {owner}'s shard ({shorten(detail, 500)})"


def _persistent_iteration(load_dir: Optional[str], args) -> Optional[int]:
    """The persistent iteration upstream's load will use: ``--ckpt-step`` (also as set by the
    persistent tier when the tracker is overruled), else the tracker's (no collectives)."""
    if not load_dir:
        return None
    step = getattr(args, "ckpt_step", None)
    if step:
        return int(step)
    tracker = persistent_dirs.read_tracker(load_dir)
    return None if tracker.release else tracker.iteration


def _markers_reason(reports: List[_Report]) -> Optional[str]:
    found = [(r.rank, r.marker) for r in reports if r.marker is not None]
    if not found:
        return None
    first = describe_marker(*found[0])
    more = f" (markers on ranks {[r for r, _ in found]})" if len(found) > 1 else ""
    return f"bad-tier marker {MARKER_NAME} found: {first}{more}"


class LocalTierResolution:
    """The load-time resolution of :class:`~megatron.training_ext.local_tier.manager.
    ValidatedLocalCheckpointManager` (a mixin: it uses the manager's file helpers, ``_inspect``
    and ``_verify_own``, and NVRx's ``_load``, ``_ckpt_id`` and ``repl_strategy``).

    Rules: ``docs/local-tier.md``. Every method is collective unless it says otherwise.
    """

    def _resolve(self) -> Resolution:
        """Collective: decide what this load uses (see the class docstring)."""
        st = common.STATE
        st.manager = self
        me, world = process_rank(), dist.get_world_size()
        t0 = time.perf_counter()
        identity = self._identity_parts()
        run_id, _, settings, topo = identity
        args = megatron_args()
        load_dir = getattr(args, "load", None)
        copies, loaded, leftovers = self._inspect(run_id, settings, topo)
        mine = _Report(
            me,
            socket.gethostname(),
            identity,
            uuid.uuid4().hex,
            read_marker(self.local_ckpt_dir),
            _persistent_iteration(load_dir, args),
            copies,
            leftovers,
        )
        t_gather = time.perf_counter()
        self.timings["headers"] = t_gather - t0 - self.timings.get("own_primary", 0.0)
        reports: List[_Report] = gather_objects(mine)
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
        pool = [c for r in reports for c in r.copies]  # with other rank directories' files
        for c in pool:  # the agreed run id decides for everyone
            if c.problem is None and c.run_id != agreed_run:
                c.problem = c.foreign or (
                    f"written by another run (run id {c.run_id}, this run "
                    f"{agreed_run}; {local_identity.RUN_ID_FLAG} sets the id "
                    f"explicitly)"
                )
        all_copies = [c for c in pool if not c.sibling]
        self.globally_available_ids = [
            [(c.iteration, c.owner, self.session_id) for c in r.copies if not c.sibling]
            for r in reports
        ]
        iterations = sorted({c.iteration for c in pool}, reverse=True)
        if not iterations:
            return self._fall_back(None, load_dir, persistent, notes)
        if persistent is not None and iterations[0] < persistent:
            say(
                f"local checkpoint at iteration {iterations[0]} is older than the persistent "
                f"checkpoint at iteration {persistent} in {load_dir}: loading the persistent one"
                + "".join(f"; {n}" for n in notes)
            )
            return Resolution(iterations[0])
        hosts = {r.rank: r.host for r in reports}
        why_not: List[str] = []
        resharding = False  # the newest iteration's reason is the reshard's (not a verification)
        for it in iterations:
            if persistent is not None and it < persistent:
                break
            res = self._try_iteration(it, all_copies, hosts, loaded, world, why_not, notes, t0)
            other_dp = [c for c in pool if c.iteration == it and c.saved_topology is not None]
            if res is None and other_dp and it == persistent:
                # e.g. a restart killed after the reshard wrote this iteration: nothing to do
                self._quarantine()
                say(
                    f"local checkpoint at iteration {it} was written at DP "
                    f"{other_dp[0].saved_topology.get('data_parallel_size')}: the persistent "
                    f"checkpoint of the same iteration in {load_dir} is loaded (resharded)"
                )
                return Resolution(-1)
            if res is None and (persistent is None or it > persistent) and other_dp:
                if why_not and why_not[-1].startswith(f"iteration {it}:"):
                    why_not.pop()  # "written under another topology": the reshard says more
                resharding = resharding or it == iterations[0]
                res = self._try_reshard(it, pool, why_not, notes, t0)
                if res is not None:
                    return res
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
        verdict = "cannot be resumed at this DP size" if resharding else "failed verification"
        reason = f"local checkpoint at iteration {iterations[0]} {verdict}: " + "; ".join(why_not)
        return self._fall_back(reason, load_dir, persistent, notes)

    def _try_iteration(
        self,
        it: int,
        all_copies: List[LocalCopy],
        hosts: dict,
        loaded: dict,
        world: int,
        why_not: List[str],
        notes: List[str],
        t0: float,
    ) -> Optional[Resolution]:
        """Collective: use local iteration ``it`` if every shard has a verified copy, repairing
        shards from replicas; None (on every rank) when it cannot be used, reason in ``why_not``."""
        me = process_rank()
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
        by_owner: dict[int, List[LocalCopy]] = {}
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
        my_id = self._ckpt_id(it)
        pending = [
            c for c in copies if c.holder == c.owner and c.problem is None and not c.bytes_verified
        ]
        if pending:  # not the newest own iteration of some rank: verify those primaries now
            for c in pending:
                if c.holder == me:
                    self._verify_own(c, loaded)
            late = gather_objects([(c.owner, c.problem) for c in pending if c.holder == me])
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
        if need and not self._can_repair():
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

    def _can_repair(self) -> bool:
        return self.repl_strategy is not None or _world_clique() is not None

    def _repair_attempts(self, it, by_owner, need, hosts, loaded, why_not, notes, all_copies, t0):
        me = process_rank()
        # every rank in one clique: a verified copy is used wherever it is, whatever replication
        # settings wrote it (the run's own cliques reach only the ranks of its groups)
        strategy = _world_clique() or self.repl_strategy
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
                    errors.append(f"no retrieval plan: {exc_text(e)}")
                if plan is not None:
                    for entry in plan.entries:
                        if entry.sender == me and entry.receiver != me:
                            cid = entry.id_
                            try:
                                sd = self._load(cid)  # verified on the host, then to the device
                                errs, _ = verify_state_dict(
                                    sd, f"rank {me}'s replica of rank {cid[1]}'s shard", True
                                )
                                sd.restore_tensor_device(non_blocking=False)
                            except Exception as e:  # noqa: BLE001
                                sd, errs = None, [f"unreadable: {exc_text(e)}"]
                            if errs:
                                sent.append((cid[1], me, shorten("; ".join(errs), 400)))
                            else:
                                loaded[cid] = (sd, "")
            verdicts = gather_objects((sent, errors))
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
                    errs.append(exc_text(e))
            summary, source = "", None
            if not errs and me in need:
                sd = received.get(my_id) if received else None
                if sd is None:
                    errs.append(
                        f"retrieval returned {sorted(received or {}, key=str)}, expected {my_id}"
                    )
                else:
                    source = next(e.sender for e in plan.entries if e.receiver == me)
                    verify_errs, summary = verify_state_dict(
                        sd,
                        f"rank {me}'s shard received from rank {source}",
                        not strategy_verifies(strategy),
                    )
                    errs += verify_errs
                    loaded[my_id] = (sd, summary)
            outcome = gather_objects(errs)
            if any(outcome):
                why_not.append(f"iteration {it}: repair failed: {summarize(outcome)}")
                return None
            sd, summary0 = loaded[my_id]
            if me in need:
                own = next((c.problem for c in by_owner.get(me, []) if c.holder == me), "missing")
                line = (
                    f"local checkpoint at iteration {it}: repaired from rank {source}'s replica on "
                    f"host {hosts.get(source, '?')} (verified: {summary}); own primary: "
                    f"{shorten(own, 300)}"
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

    def _try_reshard(self, it, pool, why_not, notes, t0) -> Optional[Resolution]:
        """Collective: resume iteration ``it``, written at another DP size, by writing it as a
        persistent ``torch_dist`` checkpoint that upstream's load reshards (:mod:`.reshard`);
        ``None`` (on every rank, reason in ``why_not``) when it cannot."""
        me = process_rank()
        args = megatron_args()
        topo = self._identity_parts()[3]
        cands = [c for c in pool if c.iteration == it and c.saved_topology is not None]
        tokens = Counter(c.token for c in cands).most_common()
        if len(tokens) > 1 and tokens[0][1] == tokens[1][1]:
            why_not.append(
                f"iteration {it}: copies of {len(tokens)} different saves, none in a majority"
            )
            return None
        cands = [c for c in cands if c.token == tokens[0][0]]
        saved = cands[0].saved_topology
        old_world, old_dp = int(saved["world_size"]), saved.get("data_parallel_size")
        what = (
            f"iteration {it}: written at DP {old_dp} (world size {old_world}), this start has "
            f"DP {topo.get('data_parallel_size')} (world size {topo.get('world_size')})"
        )
        # a file of a host may be reported by each rank of the host (other rank directories):
        # each report is a way to read it, and the plan spreads the reading over those ranks
        by_owner: dict[int, List[LocalCopy]] = {}
        for c in cands:
            by_owner.setdefault(c.owner, []).append(c)
        for owner, cs in by_owner.items():  # copies must agree with the primary (or the majority)
            prim = [c.fingerprint for c in cs if c.dir_rank == owner and c.fingerprint]
            fps = Counter(c.fingerprint for c in cs if c.fingerprint).most_common(1)
            ref = prim[0] if prim else fps[0][0] if fps else None
            by_owner[owner] = [c for c in cs if ref is None or c.fingerprint in (ref, None)]
        missing = [o for o in range(old_world) if not by_owner.get(o)]
        if missing:
            why_not.append(
                f"{what}: no copy of the shard of rank(s) {missing} on any rank, cannot reshard"
            )
            return None
        save, load = getattr(args, "save", None), getattr(args, "load", None)
        if not save or (load and os.path.realpath(load) != os.path.realpath(save)):
            why_not.append(
                f"{what}: resharding writes the checkpoint into --save and loads it from there, "
                f"so it needs --save{' equal to --load' if save else ''}"
            )
            return None
        fmt = getattr(args, "ckpt_format", "torch_dist")
        if fmt != "torch_dist" and not getattr(args, "auto_detect_ckpt_format", False):
            why_not.append(
                f"{what}: resharding writes a torch_dist checkpoint, which a run with "
                f"--ckpt-format {fmt} does not load (add --auto-detect-ckpt-format)"
            )
            return None
        target = os.path.join(save, f"iter_{it:07d}")
        replaced: List[str] = []  # copies that failed to load or verify (others were used)
        for _attempt in range(3):
            loaders = reshard.plan_loaders({o: [c.holder for c in by_owner[o]] for o in by_owner})
            paths = {
                o: next(
                    str(c.path)
                    for c in sorted(by_owner[o], key=lambda c: c.dir_rank != o)
                    if c.holder == me
                )
                for o, r in loaders.items()
                if r == me
            }
            try:
                files, read, seconds, aside = reshard.assemble(
                    iteration=it,
                    loaders=loaders,
                    paths=paths,
                    load_and_verify=self._load_for_reshard,
                    target=target,
                )
            except reshard.ReshardError as e:
                if not e.bad:
                    why_not.append(f"{what}: {e}")
                    return None
                replaced.append(shorten(str(e), 400))
                for old, holder in e.bad:
                    by_owner[old] = [c for c in by_owner[old] if c.holder != holder]
                gone = [o for o in by_owner if not by_owner[o]]
                if gone:
                    why_not.append(f"{what}: no verified copy of the shard of rank(s) {gone}: {e}")
                    return None
                continue
            break
        else:
            why_not.append(f"{what}: no copies verified after several attempts")
            return None
        if getattr(args, "ckpt_step", None):
            args.ckpt_step = it  # the persistent tier chose an older one before this decision
        moved = self._quarantine()
        extra = list(notes)
        if aside:
            extra.append(
                f"the incomplete {target} found there (an interrupted save) kept as {aside[0]}"
            )
        if replaced:
            extra.append("other copies used where these failed: " + "; ".join(replaced))
        if moved:
            extra.append(
                f"{moved} local checkpoint file(s) of this rank set aside (left in place until "
                f"this run's first local save completes)"
            )
        line = (
            f"local checkpoint at iteration {it} written at DP {old_dp} (world size {old_world}) "
            f"resumed at DP {topo.get('data_parallel_size')} (world size {topo.get('world_size')}):"
            f" read {reshard.describe(files, str(Path(self.local_ckpt_dir).parent))}; all "
            f"{old_world} shards written as the torch_dist checkpoint {target} (shards read and "
            f"verified in {read:.2f} s, written in {seconds - read:.2f} s), loaded resharded "
            f"[{seconds:.2f} s]"
        )
        self.timings["total"] = time.perf_counter() - t0
        say(line + "".join(f"; {n}" for n in extra))
        return Resolution(-1, line=line)

    def _load_for_reshard(self, path: str, old: int) -> Any:
        """One old rank's shard, loaded and verified (identity, checksums, finiteness)."""
        sd = reshard.loaded_state(path)
        rec = local_identity.get_identity(sd)
        if rec is None or rec.get("owner_rank") != old:
            raise ValueError(f"its identity record does not name rank {old}'s shard")
        errors, _ = verify_state_dict(sd, f"rank {old}'s shard", check_checksums=True)
        if errors:
            raise ValueError(shorten("; ".join(errors), 400))
        return sd

    def _resolved(self, it, sd, cid, line, all_copies, notes, t0) -> Resolution:
        me = process_rank()
        bad = [
            c
            for c in all_copies
            if c.holder == me and c.iteration == it and c.problem is not None and c.owner != me
        ]
        extra = list(notes)
        if bad:
            extra.append(
                f"set aside {len(bad)} bad replica(s) (deleted when this run's first local save "
                f"completes): "
                + "; ".join(f"rank {c.owner}'s shard: {shorten(c.problem, 200)}" for c in bad)
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
        say(line + "".join(f"; {n}" for n in extra) + f" [{tm['total']:.2f} s]")
        return Resolution(it, sd, cid, line)

    def _quarantine(self, keep: Optional[int] = None, bad: Sequence[LocalCopy] = ()) -> int:
        """Set aside this rank's local files that this run must not use: every file when ``keep``
        is None, else the files of iterations newer than ``keep`` and the ``bad`` copies of
        ``keep``. Nothing is moved or deleted now: a start that fails or is refused leaves them
        for the next start to consider again; :meth:`drop_set_aside` deletes them once this
        run's first local save has completed on every rank. Returns how many were set aside."""
        d = Path(self.local_ckpt_dir)
        if not d.is_dir():
            return 0
        bad_names = {self._filename_from_template(c.iteration, c.owner) for c in bad}
        for p in d.iterdir():
            parsed = local_layout.parse_local_name(p.name)
            if parsed is None or not p.is_file():
                continue
            if keep is None or parsed[0] > keep or p.name in bad_names:
                self._set_aside.append((parsed[0], p))
        return len(self._set_aside)

    def drop_set_aside(self, saved_iteration: int) -> int:
        """After the local save of ``saved_iteration`` completed on every rank: delete the files
        :meth:`_quarantine` set aside (not those the save just rewrote under the same name; a
        shard of a rank beyond this world, written at a larger DP size, is never rewritten).
        Returns how many."""
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

    def _fall_back(self, reason: Optional[str], load_dir, persistent, notes) -> Resolution:
        """Every rank: this process does not use the local tier; quarantine, say why (one line)."""
        st = common.STATE
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
                f"{moved} local checkpoint file(s) set aside (left in place until this run's "
                f"first local save completes)"
            )
        if reason is None:
            line = f"no local checkpoint in {self.local_ckpt_dir} -> loading {target}"
        else:
            st.force_persistent, st.rejected_reason = True, reason
            line = f"local checkpoint tier rejected: {reason} -> loading {target}"
        say(line + "".join(f"; {n}" for n in extra))
        return Resolution(-1, line=line)


def _world_clique() -> Any:
    """A clique of every rank for the repair, of the class NVRx's name binds now (the replication
    fix's subclass when that fix is active, so replicas are checksum-verified on receipt); ``None``
    without NVRx's replication module. Builds no process group (the world group is wrapped)."""
    try:
        from nvidia_resiliency_ext.checkpointing.local.replication import strategies
    except ImportError:  # pragma: no cover - NVRx without replication
        return None
    return strategies.CliqueReplicationStrategy(dist.group.WORLD, target_device="cpu")
