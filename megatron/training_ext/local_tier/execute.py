"""Carrying out the plan of a local-tier start (:mod:`.plan`): the collectives it needs
(verifying primaries of an older iteration, the exchange of replicas, the reshard's write), the
files set aside, and the one ``[local-tier]`` line of every rank.

:func:`execute` alternates :func:`.plan.decide` and one step of its plan until a step resolves
the start; a step that finds what no inventory could see returns it as facts, and the plan is
decided again with them (on every rank the same).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch.distributed as dist

from megatron.integrity import local_identity, local_layout
from megatron.overlay.collective import summarize
from megatron.training_ext.console import rank_line
from megatron.training_ext.local_tier import plan as plans
from megatron.training_ext.local_tier import reshard
from megatron.training_ext.local_tier.checks import strategy_verifies, verify_state_dict
from megatron.training_ext.local_tier.common import (
    LOG_PREFIX,
    TierState,
    exc_text,
    gather_objects,
    logger,
    megatron_args,
    shorten,
)
from megatron.training_ext.local_tier.inventory import Inventory, LocalCopy, RankDir, verify_primary

__all__ = ["Outcome", "Resolution", "execute", "world_clique"]


@dataclass
class Resolution:
    """What a load uses: the local iteration (-1: not the local tier) and, when it is one,
    this rank's verified state dict and ckpt id; ``line``: what the rank printed."""

    iteration: int
    state_dict: Any = None
    ckpt_id: Any = None
    line: str = ""


@dataclass
class Outcome:
    """The result of a start: the resolution, the files set aside ((iteration, path) each:
    deleted once this run's first local save completes) and the timings (seconds)."""

    resolution: Resolution
    set_aside: List[tuple] = field(default_factory=list)
    timings: Dict[str, float] = field(default_factory=dict)


def world_clique() -> Any:
    """A clique of every rank for the repair, of the class NVRx's name binds now (the replication
    fix's subclass when that fix is active, so replicas are checksum-verified on receipt); ``None``
    without NVRx's replication module. Builds no process group (the world group is wrapped)."""
    try:
        from nvidia_resiliency_ext.checkpointing.local.replication import strategies
    except ImportError:  # pragma: no cover - NVRx without replication
        return None
    return strategies.CliqueReplicationStrategy(dist.group.WORLD, target_device="cpu")


def execute(
    rank_dir: RankDir,
    inventories: Sequence[Inventory],
    loaded: Dict[tuple, tuple],
    *,
    tier: TierState,
    repl_strategy: Any,
    timings: Dict[str, float],
    t0: float,
) -> Outcome:
    """Collective: decide the start's plan and carry it out.

    Args:
        rank_dir: this rank's local directory.
        inventories: every rank's inventory (gathered).
        loaded: ckpt id -> (state dict, summary) of the primaries this rank verified.
        tier: the installed tier's state (its fallback flags are set here).
        repl_strategy: the run's replication strategy (``None``: none).
        timings: the start's timings so far (headers, own primary, agree).
        t0: when the start began (``time.perf_counter``).
    """
    run = _Run(rank_dir, inventories, dict(loaded), tier, repl_strategy, dict(timings), t0)
    facts: List[plans.Fact] = []
    while True:
        step = run.step(plans.decide(inventories, facts))
        if isinstance(step, Outcome):
            return step
        facts += step


class _Run:
    """One start being carried out on this rank: the state dicts it holds and its timings."""

    def __init__(self, rank_dir, inventories, loaded, tier, repl_strategy, timings, t0):
        self.dir = rank_dir
        self.me = rank_dir.rank
        self.inventories = inventories
        self.loaded = loaded
        self.tier = tier
        self.repl_strategy = repl_strategy
        self.timings = timings
        self.t0 = t0
        mine = inventories[self.me]
        self.load_dir = getattr(megatron_args(tier), "load", None)
        self.persistent = inventories[0].persistent
        self.notes = (
            [
                f"removed {len(mine.leftovers)} leftover(s) of an interrupted save "
                f"({', '.join(mine.leftovers)})"
            ]
            if mine.leftovers
            else []
        )

    def step(self, plan: plans.Plan) -> Union[Outcome, List[plans.Fact]]:
        """Carry out ``plan``: the outcome, or the facts it found (decide again)."""
        if isinstance(plan, plans.Fallback):
            return self.fall_back(plan.reason)
        if isinstance(plan, plans.PersistentNewer):
            self.say(
                f"{plan.reason} in {self.load_dir}: loading the persistent one"
                + "".join(f"; {n}" for n in self.notes)
            )
            return Outcome(Resolution(plan.iteration), timings=self.timings)
        if isinstance(plan, plans.PersistentResharded):
            aside = self.set_aside()
            self.say(
                f"{plan.reason}: the persistent checkpoint of the same iteration in "
                f"{self.load_dir} is loaded (resharded)"
            )
            return Outcome(Resolution(-1), aside, self.timings)
        if isinstance(plan, plans.Verify):
            return self.verify(plan)
        if isinstance(plan, plans.Use):
            sd, summary = self.loaded[self.dir.ckpt_id(plan.iteration)]
            it = plan.iteration
            line = (
                f"local checkpoint at iteration {it} verified on all ranks: own primary ({summary})"
                if self.me == 0
                else f"local checkpoint at iteration {it}: own primary verified ({summary})"
            )
            return self.resolved(plan, sd, line)
        if isinstance(plan, plans.Repair):
            t_repair = time.perf_counter()
            try:
                return self.repair(plan)
            finally:
                self.timings["repair"] = (
                    self.timings.get("repair", 0.0) + time.perf_counter() - t_repair
                )
        return self.reshard(plan)

    def say(self, line: str) -> None:
        rank_line(LOG_PREFIX, line)

    # -- the steps --------------------------------------------------------------------------------
    def verify(self, plan: plans.Verify) -> List[plans.Fact]:
        """Collective: the holders verify the primaries ``plan`` names."""
        results = []
        for c in self.copies(plan.iteration):
            if c.owner in plan.owners and c.holder == c.owner == self.me:
                judged, verified, seconds = verify_primary(self.dir, c)
                self.timings["own_primary"] = self.timings.get("own_primary", 0.0) + seconds
                if verified is not None:
                    self.loaded[self.dir.ckpt_id(plan.iteration)] = verified
                results.append((c.owner, judged.problem))
        gathered = gather_objects(results)
        return [plans.PrimariesVerified(plan.iteration, tuple(r for rs in gathered for r in rs))]

    def copies(self, iteration: int) -> List[LocalCopy]:
        """This rank's own copies of ``iteration`` as its inventory holds them."""
        return [
            c
            for c in self.inventories[self.me].copies
            if c.iteration == iteration and not c.sibling
        ]

    def repair(self, plan: plans.Repair) -> Union[Outcome, List[plans.Fact]]:
        """Collective: one round of the exchange of replicas ``plan`` describes."""
        it, me = plan.iteration, self.me
        # every rank in one clique: a verified copy is used wherever it is, whatever replication
        # settings wrote it (the run's own cliques reach only the ranks of its groups)
        strategy = world_clique() or self.repl_strategy
        my_id = self.dir.ckpt_id(it)
        world = len(self.inventories)
        clique = list(getattr(strategy.local_group, "ranks", range(world)))
        exchange, errors, sent = None, [], []
        if any(o in clique for o in plan.need):
            available = [[] for _ in range(world)]
            for owner, holder in plan.sources:
                available[holder].append((it, owner, self.dir.session_id))
            try:
                exchange = strategy.retrieve_plan(available, [my_id])
            except Exception as e:  # noqa: BLE001 - same on every rank of the clique
                errors.append(f"no retrieval plan: {exc_text(e)}")
            if exchange is not None:
                sent = self.verify_replicas_to_send(exchange)
        verdicts = gather_objects((sent, errors))
        plan_errors = [e for _, es in verdicts for e in es]
        if plan_errors:
            return [plans.IterationFailed(it, f"iteration {it}: " + "; ".join(plan_errors[:2]))]
        bad = tuple(b for s, _ in verdicts for b in s)
        if bad:
            return [plans.RepairAttemptFailed(it, bad)]
        # every replica to be sent verified: exchange (the fixed strategy verifies again)
        errs, summary, source = self.exchange(strategy, exchange, plan)
        outcome = gather_objects(errs)
        if any(outcome):
            return [
                plans.IterationFailed(it, f"iteration {it}: repair failed: {summarize(outcome)}")
            ]
        sd, summary0 = self.loaded[my_id]
        if me in plan.need:
            own = next(
                (c.problem for c in plan.copies if c.owner == me and c.holder == me), "missing"
            )
            hosts = {inv.rank: inv.host for inv in self.inventories}
            line = (
                f"local checkpoint at iteration {it}: repaired from rank {source}'s replica on "
                f"host {hosts.get(source, '?')} (verified: {summary}); own primary: "
                f"{shorten(own, 300)}"
            )
        else:
            line = (
                f"local checkpoint at iteration {it}"
                f"{' verified on all ranks' if me == 0 else ''}: "
                f"own primary ({summary0}); repaired rank(s) {list(plan.need)} from replicas"
            )
        return self.resolved(plan, sd, line)

    def verify_replicas_to_send(self, exchange: Any) -> List[tuple]:
        """Load and verify each replica this rank sends; (owner, holder, problem) of each that
        fails (the others are kept in ``loaded`` for the exchange)."""
        me, sent = self.me, []
        for entry in exchange.entries:
            if entry.sender == me and entry.receiver != me:
                cid = entry.id_
                try:
                    sd = self.dir.load(cid)  # verified on the host, then to the device
                    errs, _ = verify_state_dict(
                        sd, f"rank {me}'s replica of rank {cid[1]}'s shard", True
                    )
                    sd.restore_tensor_device(non_blocking=False)
                except Exception as e:  # noqa: BLE001
                    sd, errs = None, [f"unreadable: {exc_text(e)}"]
                if errs:
                    sent.append((cid[1], me, shorten("; ".join(errs), 400)))
                else:
                    self.loaded[cid] = (sd, "")
        return sent

    def exchange(self, strategy: Any, exchange: Any, plan: plans.Repair) -> tuple:
        """Collective (the clique): send and receive the shards; a received one is verified.
        Returns (errors, the received shard's summary, its sender)."""
        me, my_id = self.me, self.dir.ckpt_id(plan.iteration)
        received, errs = None, []
        if exchange is not None:
            my_data = {cid: self.loaded[cid][0] for cid in exchange.required_ids()}
            try:
                received = strategy.retrieve_execute(exchange, my_data)
            except Exception as e:  # noqa: BLE001 - ChecksumMismatchError on every clique rank
                errs.append(exc_text(e))
        summary, source = "", None
        if not errs and me in plan.need:
            sd = received.get(my_id) if received else None
            if sd is None:
                errs.append(
                    f"retrieval returned {sorted(received or {}, key=str)}, expected {my_id}"
                )
            else:
                source = next(e.sender for e in exchange.entries if e.receiver == me)
                verify_errs, summary = verify_state_dict(
                    sd,
                    f"rank {me}'s shard received from rank {source}",
                    not strategy_verifies(strategy),
                )
                errs += verify_errs
                self.loaded[my_id] = (sd, summary)
        return errs, summary, source

    def reshard(self, plan: plans.Reshard) -> Union[Outcome, List[plans.Fact]]:
        """Collective: write the local iteration as a persistent ``torch_dist`` checkpoint that
        upstream's load reshards (:mod:`.reshard`)."""
        it = plan.iteration
        paths = {o: p for o, p in plan.paths.items() if plan.loaders[o] == self.me}
        try:
            files, read, seconds, aside = reshard.assemble(
                iteration=it,
                loaders=plan.loaders,
                paths=paths,
                load_and_verify=load_shard,
                target=plan.target,
            )
        except reshard.ReshardError as e:
            if not e.bad:
                return [plans.IterationFailed(it, f"{plan.reason}: {e}", reshard=True)]
            return [plans.ReshardAttemptFailed(it, tuple(tuple(b) for b in e.bad), str(e))]
        args = megatron_args(self.tier)
        if getattr(args, "ckpt_step", None):
            args.ckpt_step = it  # the persistent tier chose an older one before this decision
        set_aside = self.set_aside()
        extra = list(self.notes)
        if aside:
            extra.append(
                f"the incomplete {plan.target} found there (an interrupted save) kept as {aside[0]}"
            )
        if plan.replaced:
            extra.append("other copies used where these failed: " + "; ".join(plan.replaced))
        if set_aside:
            extra.append(
                f"{len(set_aside)} local checkpoint file(s) of this rank set aside (left in place "
                f"until this run's first local save completes)"
            )
        topo = self.inventories[0].identity[3]
        line = (
            f"local checkpoint at iteration {it} written at DP {plan.old_dp} (world size "
            f"{plan.old_world}) resumed at DP {topo.get('data_parallel_size')} (world size "
            f"{topo.get('world_size')}): read {reshard.describe(files, str(self.dir.path.parent))}"
            f"; all {plan.old_world} shards written as the torch_dist checkpoint {plan.target} "
            f"(shards read and verified in {read:.2f} s, written in {seconds - read:.2f} s), "
            f"loaded resharded [{seconds:.2f} s]"
        )
        self.timings["total"] = time.perf_counter() - self.t0
        self.say(line + "".join(f"; {n}" for n in extra))
        return Outcome(Resolution(-1, line=line), set_aside, self.timings)

    # -- the ends ---------------------------------------------------------------------------------
    def resolved(self, plan: Union[plans.Use, plans.Repair], sd: Any, line: str) -> Outcome:
        """Every rank uses ``plan.iteration``: its line, the bad copies it holds set aside."""
        me, it = self.me, plan.iteration
        bad = [c for c in plan.copies if c.holder == me and c.problem is not None]
        replicas = [c for c in bad if c.owner != me]
        extra = list(self.notes)
        if replicas:
            extra.append(
                f"set aside {len(replicas)} bad replica(s) (deleted when this run's first local "
                f"save completes): "
                + "; ".join(f"rank {c.owner}'s shard: {shorten(c.problem, 200)}" for c in replicas)
            )
        tm = self.timings
        tm["total"] = time.perf_counter() - self.t0
        # the checks' own work: headers, decision, quarantine (not the load, the repair, or the
        # wait in the one all_gather_object, where upstream waits in its own collectives)
        tm["identity"] = (
            tm["total"] - tm.get("own_primary", 0.0) - tm.get("repair", 0.0) - tm.get("agree", 0.0)
        )
        logger.info(
            "local tier start: %s",
            ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(tm.items())),
        )
        self.say(line + "".join(f"; {n}" for n in extra) + f" [{tm['total']:.2f} s]")
        set_aside = self.set_aside(keep=it, bad=bad)
        return Outcome(Resolution(it, sd, self.dir.ckpt_id(it), line), set_aside, tm)

    def fall_back(self, reason: Optional[str]) -> Outcome:
        """Every rank: this process does not use the local tier; set aside, say why."""
        set_aside = self.set_aside()
        persistent, load_dir = self.persistent, self.load_dir
        target = (
            f"the newest persistent checkpoint: iteration {persistent} in {load_dir}"
            if persistent
            else f"no persistent checkpoint in {load_dir}: starting from initialization"
            if load_dir
            else "no --load directory: starting from initialization"
        )
        extra = list(self.notes)
        if set_aside:
            extra.append(
                f"{len(set_aside)} local checkpoint file(s) set aside (left in place until this "
                f"run's first local save completes)"
            )
        if reason is None:
            line = f"no local checkpoint in {self.dir.path} -> loading {target}"
        else:
            self.tier.force_persistent, self.tier.rejected_reason = True, reason
            line = f"local checkpoint tier rejected: {reason} -> loading {target}"
        self.say(line + "".join(f"; {n}" for n in extra))
        return Outcome(Resolution(-1, line=line), set_aside, self.timings)

    def set_aside(self, keep: Optional[int] = None, bad: Sequence[LocalCopy] = ()) -> List[tuple]:
        """This rank's local files this run must not use: every file when ``keep`` is None, else
        the files of iterations newer than ``keep`` and the ``bad`` copies of ``keep``. Nothing
        is moved or deleted now: a start that fails or is refused leaves them for the next start
        to consider again; the manager deletes them once this run's first local save has
        completed on every rank. Returns (iteration, path) of each."""
        d = self.dir.path
        if not d.is_dir():
            return []
        bad_names = {Path(str(c.path)).name for c in bad}
        out = []
        for p in d.iterdir():
            parsed = local_layout.parse_local_name(p.name)
            if parsed is None or not p.is_file():
                continue
            if keep is None or parsed[0] > keep or p.name in bad_names:
                out.append((parsed[0], p))
        return out


def load_shard(path: str, old: int) -> Any:
    """One old rank's shard for a reshard, loaded and verified (identity, checksums,
    finiteness).

    Raises:
        ValueError: its identity record does not name ``old``'s shard, or it fails
            verification (naming the problems).
    """
    sd = reshard.loaded_state(path)
    rec = local_identity.get_identity(sd)
    if rec is None or rec.get("owner_rank") != old:
        raise ValueError(f"its identity record does not name rank {old}'s shard")
    errors, _ = verify_state_dict(sd, f"rank {old}'s shard", check_checksums=True)
    if errors:
        raise ValueError(shorten("; ".join(errors), 400))
    return sd
