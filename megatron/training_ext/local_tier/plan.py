"""The decision of a local-tier start, as a pure function of what every rank found.

:func:`decide` takes the gathered :class:`~.inventory.Inventory` of every rank (and the facts
that carrying out an earlier plan found, see below) and returns one plan, the same on every rank:
use a local iteration (:class:`Use`), first verify primaries the inventories did not read
(:class:`Verify`), repair shards from verified replicas (:class:`Repair`), reshard a checkpoint
written at another DP size (:class:`Reshard`), load the persistent checkpoint
(:class:`PersistentNewer`, :class:`PersistentResharded`), or fall back (:class:`Fallback`), each
with its reason. No collective, no file access: the rules are those of ``docs/local-tier.md``
(its decision table is ``tests/unit_tests/training_ext/test_local_tier_plan.py``).

Carrying a plan out (:mod:`.execute`) can find what no inventory could see: a primary of an older
iteration fails verification, a replica fails before it is sent, a repair or a reshard fails.
Each is a fact (:class:`PrimariesVerified`, :class:`RepairAttemptFailed`,
:class:`ReshardAttemptFailed`, :class:`IterationFailed`); the executor decides again with the
facts added.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple, Union

from megatron.integrity.local_identity import RUN_ID_FLAG
from megatron.training_ext.local_tier.common import MARKER_NAME, shorten
from megatron.training_ext.local_tier.inventory import Inventory, LocalCopy, ReshardSettings
from megatron.training_ext.local_tier.markers import describe_marker
from megatron.training_ext.local_tier.reshard import plan_loaders

__all__ = [
    "REPAIR_ATTEMPTS",
    "RESHARD_ATTEMPTS",
    "Fallback",
    "IterationFailed",
    "PersistentNewer",
    "PersistentResharded",
    "PrimariesVerified",
    "Repair",
    "RepairAttemptFailed",
    "Reshard",
    "ReshardAttemptFailed",
    "Use",
    "Verify",
    "decide",
    "reference_fingerprint",
    "save_token_vote",
]

#: Rounds of a repair whose senders' replicas failed verification before it gives up.
REPAIR_ATTEMPTS = 4
#: Rounds of a reshard whose copies failed to load or verify before it gives up.
RESHARD_ATTEMPTS = 3


# -- facts found by carrying a plan out -----------------------------------------------------------
@dataclass(frozen=True)
class PrimariesVerified:
    """The primaries a :class:`Verify` named were verified: (owner, problem or ``None``) each."""

    iteration: int
    results: Tuple[Tuple[int, Optional[str]], ...]


@dataclass(frozen=True)
class RepairAttemptFailed:
    """Replicas failed verification on their senders: (owner, holder, problem) each."""

    iteration: int
    bad: Tuple[Tuple[int, int, str], ...]


@dataclass(frozen=True)
class ReshardAttemptFailed:
    """Copies failed to load or verify in a reshard: (old rank, holder) each, and the error."""

    iteration: int
    bad: Tuple[Tuple[int, int], ...]
    error: str


@dataclass(frozen=True)
class IterationFailed:
    """The iteration cannot be used (``reshard``: cannot be resharded): ``reason`` says why."""

    iteration: int
    reason: str
    reshard: bool = False


Fact = Union[PrimariesVerified, RepairAttemptFailed, ReshardAttemptFailed, IterationFailed]


# -- plans ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Use:
    """Every rank uses its verified primary of ``iteration``; ``copies``: its copies, judged."""

    iteration: int
    copies: Tuple[LocalCopy, ...]
    reason: str


@dataclass(frozen=True)
class Verify:
    """The primaries of ``owners`` (of ``iteration``, older than their holders' newest) must be
    verified by their holders before ``iteration`` can be decided."""

    iteration: int
    owners: Tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Repair:
    """Use ``iteration``; the ranks in ``need`` get their shards from the usable copies
    ``sources`` ((owner, holder) each) through the replication exchange."""

    iteration: int
    copies: Tuple[LocalCopy, ...]
    need: Tuple[int, ...]
    sources: Tuple[Tuple[int, int], ...]
    reason: str


@dataclass(frozen=True)
class Reshard:
    """Write ``iteration`` (written at DP ``old_dp``, world size ``old_world``) as the
    ``torch_dist`` checkpoint ``target``: old rank -> the new rank that loads its shard
    (``loaders``) and the file it reads (``paths``). ``replaced``: errors of copies that failed
    (others are used). ``reason``: what differs (``iteration N: written at DP ...``)."""

    iteration: int
    old_world: int
    old_dp: Optional[int]
    loaders: Dict[int, int]
    paths: Dict[int, str]
    target: str
    reason: str
    replaced: Tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class PersistentResharded:
    """The persistent checkpoint of ``iteration`` exists (a reshard of the local one wrote it)."""

    iteration: int
    old_dp: Optional[int]
    reason: str


@dataclass(frozen=True)
class PersistentNewer:
    """The newest local iteration is older than the persistent one: upstream loads that."""

    iteration: int
    persistent: int
    reason: str


@dataclass(frozen=True)
class Fallback:
    """No local iteration is used; ``reason``: why (``None``: there is no local file)."""

    reason: Optional[str]


Plan = Union[Use, Verify, Repair, Reshard, PersistentResharded, PersistentNewer, Fallback]


# -- the rules ------------------------------------------------------------------------------------
def save_token_vote(tokens: Sequence[Optional[str]]) -> Tuple[Optional[str], Optional[str]]:
    """All copies of one save carry its save token: the token of the majority of ``tokens`` wins.

    Returns:
        (the winning token, ``None``), or (``None``, why) when two saves tie (no majority), or
        (``None``, ``None``) when there is no token.
    """
    counts = Counter(tokens).most_common()
    if not counts:
        return None, None
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return None, f"copies of {len(counts)} different saves, none in a majority"
    return counts[0][0], None


def reference_fingerprint(copies: Sequence[LocalCopy], owner: int) -> Tuple[Optional[str], bool]:
    """Every copy of ``owner``'s shard must have the fingerprint (hash of the stored checksums)
    of its primary (the copy in ``owner``'s directory) when that has one, else the most common
    one. Returns (that fingerprint or ``None`` when no copy has one, whether it is the
    primary's)."""
    primary = next((c.fingerprint for c in copies if c.dir_rank == owner and c.fingerprint), None)
    if primary:
        return primary, True
    common = Counter(c.fingerprint for c in copies if c.fingerprint).most_common(1)
    return (common[0][0], False) if common else (None, False)


def _disagrees(c: LocalCopy, reference: Optional[str]) -> bool:
    return reference is not None and c.fingerprint is not None and c.fingerprint != reference


def _no_verified_copy(owner: int, copies: Sequence[LocalCopy]) -> str:
    """Why no copy of ``owner``'s shard can be used: each copy's holder, role and problem."""
    detail = (
        "; ".join(
            f"rank {c.holder}'s {'primary' if c.holder == owner else 'replica'}: {c.problem}"
            for c in copies
        )
        or "no copy on any rank"
    )
    return f"no verified copy of rank {owner}'s shard ({shorten(detail, 500)})"


def _markers_reason(inventories: Sequence[Inventory]) -> Optional[str]:
    found = [(inv.rank, inv.marker) for inv in inventories if inv.marker is not None]
    if not found:
        return None
    first = describe_marker(*found[0])
    more = f" (markers on ranks {[r for r, _ in found]})" if len(found) > 1 else ""
    return f"bad-tier marker {MARKER_NAME} found: {first}{more}"


def _agreed_pool(inventories: Sequence[Inventory]) -> List[LocalCopy]:
    """Every rank's copies; a usable one written by another run than rank 0's (the agreed run
    id) is not usable. A copy of another run that has other problems too (another topology)
    names the other run first: that is what the user changed."""
    agreed = inventories[0].identity[0]
    out = []
    for inv in inventories:
        for c in inv.copies:
            if c.problem is None and c.run_id != agreed:
                c = replace(
                    c,
                    problem=c.foreign
                    or (
                        f"written by another run (run id {c.run_id}, this run {agreed}; "
                        f"{RUN_ID_FLAG} sets the id explicitly)"
                    ),
                )
            elif c.foreign is not None and c.run_id != agreed:
                c = replace(c, problem=f"{c.foreign}; {c.problem}")
            out.append(c)
    return out


def _by_owner(copies: Sequence[LocalCopy]) -> Dict[int, List[LocalCopy]]:
    out: Dict[int, List[LocalCopy]] = {}
    for c in copies:
        out.setdefault(c.owner, []).append(c)
    return out


# -- the decision ---------------------------------------------------------------------------------
def decide(inventories: Sequence[Inventory], facts: Sequence[Fact] = ()) -> Plan:
    """The plan of a start: pure (no collective, no file access); the same on every rank.

    Args:
        inventories: every rank's inventory, in rank order (rank 0's identity, persistent
            iteration and settings are the job's).
        facts: what carrying out earlier plans of this start found, in order.

    Returns:
        The plan; its ``reason`` says why.
    """
    first = inventories[0]
    reason = _markers_reason(inventories)
    if reason is not None:
        return Fallback(reason)
    pool = _agreed_pool(inventories)
    iterations = sorted({c.iteration for c in pool}, reverse=True)
    if not iterations:
        return Fallback(None)
    persistent = first.persistent
    if persistent is not None and iterations[0] < persistent:
        return PersistentNewer(
            iterations[0],
            persistent,
            f"local checkpoint at iteration {iterations[0]} is older than the persistent "
            f"checkpoint at iteration {persistent}",
        )
    why_not: List[str] = []
    resharding = False  # the newest iteration's reason is the reshard's (not a verification)
    for it in iterations:
        if persistent is not None and it < persistent:
            break
        known = [f for f in facts if f.iteration == it]
        same = [c for c in pool if c.iteration == it and not c.sibling]
        found = _judge_iteration(it, same, len(inventories), known, first.can_repair)
        if not isinstance(found, str):
            return found
        other_dp = [  # of another DP size, and this run's: another run's is never resharded
            c
            for c in pool
            if c.iteration == it and c.saved_topology is not None and c.run_id == first.identity[0]
        ]
        if other_dp and it == persistent:  # e.g. a restart killed after the reshard wrote it
            old_dp = other_dp[0].saved_topology.get("data_parallel_size")
            return PersistentResharded(
                it, old_dp, f"local checkpoint at iteration {it} was written at DP {old_dp}"
            )
        if other_dp and (persistent is None or it > persistent):
            resharding = resharding or it == iterations[0]
            found = _judge_reshard(it, other_dp, first.identity[3], first.reshard, known)
            if not isinstance(found, str):
                return found
        why_not.append(found)  # newer than what can be used: never offered again
    if len(why_not) == 1:
        why_not = [why_not[0].split(": ", 1)[1]]  # the iteration is named in front
    verdict = "cannot be resumed at this DP size" if resharding else "failed verification"
    return Fallback(
        f"local checkpoint at iteration {iterations[0]} {verdict}: " + "; ".join(why_not)
    )


def _judge_iteration(
    it: int, copies: List[LocalCopy], world: int, facts: List[Fact], can_repair: bool
) -> Union[Plan, str]:
    """The plan for local iteration ``it`` at this topology, or why it cannot be used
    (``"iteration N: ..."``)."""
    failed = [f.reason for f in facts if isinstance(f, IterationFailed) and not f.reshard]
    if failed:
        return failed[0]
    copies, why = _agreed_copies(it, copies)
    if why is not None:
        return why
    distinct = {c.problem for c in copies}
    if copies and None not in distinct and len(distinct) == 1:
        return f"iteration {it}: every copy on every rank was {distinct.pop()}"
    by_owner = _by_owner(copies)
    missing = [
        _no_verified_copy(o, by_owner.get(o, []))
        for o in range(world)
        if not any(c.problem is None for c in by_owner.get(o, []))
    ]
    if missing:
        return f"iteration {it}: " + "; ".join(missing)
    copies = _with_facts(copies, facts)
    pending = [
        c for c in copies if c.holder == c.owner and c.problem is None and not c.bytes_verified
    ]
    if pending:  # not the newest own iteration of some rank: verify those primaries now
        owners = tuple(c.owner for c in pending)
        return Verify(it, owners, f"the primaries of rank(s) {list(owners)} are not verified yet")
    return _use_or_repair(it, copies, world, facts, can_repair)


def _agreed_copies(it: int, copies: List[LocalCopy]) -> Tuple[List[LocalCopy], Optional[str]]:
    """``copies`` judged against each other: a copy of another save (outvoted save token) and a
    copy whose checksums differ from its shard's reference are not usable. Returns (judged
    copies, ``None``) or (``[]``, why the iteration cannot be used)."""
    best, tie = save_token_vote([c.token for c in copies if c.problem is None])
    if tie is not None:
        return [], f"iteration {it}: {tie}"
    copies = [
        c
        if c.problem is not None or c.token == best
        else replace(
            c,
            problem=f"from another save of iteration {it} (save token {c.token}, "
            f"the others {best})",
        )
        for c in copies
    ]
    references = {
        owner: reference_fingerprint([c for c in cs if c.problem is None], owner)
        for owner, cs in _by_owner(copies).items()
    }
    out = []
    for c in copies:
        ref, of_primary = references[c.owner]
        if c.problem is None and _disagrees(c, ref):
            c = replace(
                c,
                problem=f"its checksums differ from "
                f"{'the primary' if of_primary else 'the other copies'} of rank {c.owner}'s shard",
            )
        out.append(c)
    return out, None


def _with_facts(copies: List[LocalCopy], facts: List[Fact]) -> List[LocalCopy]:
    """``copies`` with what verifying primaries and senders' replicas found."""
    for f in facts:
        if isinstance(f, PrimariesVerified):
            results = dict(f.results)
            copies = [
                replace(c, problem=results[c.owner], bytes_verified=True)
                if c.owner in results and c.holder == c.owner
                else c
                for c in copies
            ]
        elif isinstance(f, RepairAttemptFailed):
            bad = {(owner, holder): problem for owner, holder, problem in f.bad}
            copies = [
                replace(c, problem=bad[(c.owner, c.holder)]) if (c.owner, c.holder) in bad else c
                for c in copies
            ]
    return copies


def _use_or_repair(
    it: int, copies: List[LocalCopy], world: int, facts: List[Fact], can_repair: bool
) -> Union[Plan, str]:
    """Use ``it`` when every rank has a usable primary, else repair the others from replicas."""
    by_owner = _by_owner(copies)
    need = tuple(
        sorted(
            o
            for o in range(world)
            if not any(c.problem is None and c.holder == o for c in by_owner.get(o, []))
        )
    )
    if not need:
        return Use(it, tuple(copies), f"every shard of iteration {it} has a verified primary")
    if not can_repair:
        return (
            f"iteration {it}: rank(s) {list(need)} have no usable primary and there is no "
            f"replication to repair from: "
            + "; ".join(
                f"rank {o}: "
                f"{next((c.problem for c in by_owner.get(o, []) if c.holder == o), 'missing')}"
                for o in need
            )
        )
    if sum(isinstance(f, RepairAttemptFailed) for f in facts) >= REPAIR_ATTEMPTS:
        return f"iteration {it}: no replica verified after several attempts"
    uncovered = [o for o in need if not any(c.problem is None for c in by_owner.get(o, []))]
    if uncovered:
        return f"iteration {it}: " + "; ".join(
            _no_verified_copy(o, by_owner.get(o, [])) for o in uncovered
        )
    sources = tuple((c.owner, c.holder) for c in copies if c.problem is None)
    return Repair(
        it,
        tuple(copies),
        need,
        sources,
        f"rank(s) {list(need)} have no usable primary of iteration {it}: repaired from replicas",
    )


def _judge_reshard(
    it: int,
    candidates: List[LocalCopy],
    topo: dict,
    settings: ReshardSettings,
    facts: List[Fact],
) -> Union[Reshard, str]:
    """The reshard of iteration ``it`` (its copies of another DP size: ``candidates``), or why
    it cannot be resumed at this DP size."""
    failed = [f.reason for f in facts if isinstance(f, IterationFailed) and f.reshard]
    if failed:
        return failed[0]
    best, tie = save_token_vote([c.token for c in candidates])
    if tie is not None:
        return f"iteration {it}: {tie}"
    candidates = [c for c in candidates if c.token == best]
    saved = candidates[0].saved_topology
    old_world, old_dp = int(saved["world_size"]), saved.get("data_parallel_size")
    what = (
        f"iteration {it}: written at DP {old_dp} (world size {old_world}), this start has "
        f"DP {topo.get('data_parallel_size')} (world size {topo.get('world_size')})"
    )
    # a file of a host may be reported by each rank of the host (other rank directories):
    # each report is a way to read it, and the plan spreads the reading over those ranks
    by_owner = {}
    for owner, cs in _by_owner(candidates).items():
        ref, _ = reference_fingerprint(cs, owner)
        by_owner[owner] = [c for c in cs if not _disagrees(c, ref)]
    missing = [o for o in range(old_world) if not by_owner.get(o)]
    if missing:
        return f"{what}: no copy of the shard of rank(s) {missing} on any rank, cannot reshard"
    why = _reshard_settings_problem(settings)
    if why is not None:
        return f"{what}: {why}"
    replaced = []
    attempts = [f for f in facts if isinstance(f, ReshardAttemptFailed)]
    for f in attempts:
        replaced.append(shorten(f.error, 400))
        for old, holder in f.bad:
            by_owner[old] = [c for c in by_owner[old] if c.holder != holder]
        gone = [o for o in by_owner if not by_owner[o]]
        if gone:
            return f"{what}: no verified copy of the shard of rank(s) {gone}: {f.error}"
    if len(attempts) >= RESHARD_ATTEMPTS:
        return f"{what}: no copies verified after several attempts"
    loaders = plan_loaders({o: [c.holder for c in by_owner[o]] for o in by_owner})
    paths = {
        o: next(
            str(c.path) for c in sorted(by_owner[o], key=lambda c: c.dir_rank != o) if c.holder == r
        )
        for o, r in loaders.items()
    }
    target = os.path.join(settings.save, f"iter_{it:07d}")
    return Reshard(it, old_world, old_dp, loaders, paths, target, what, tuple(replaced))


def _reshard_settings_problem(settings: ReshardSettings) -> Optional[str]:
    """Why this run's flags do not let a reshard write and load the checkpoint, if they do not."""
    if not settings.save or settings.load_elsewhere:
        return (
            "resharding writes the checkpoint into --save and loads it from there, so it needs "
            f"--save{' equal to --load' if settings.save else ''}"
        )
    fmt = settings.ckpt_format
    if fmt != "torch_dist" and not settings.auto_detect:
        return (
            f"resharding writes a torch_dist checkpoint, which a run with --ckpt-format {fmt} "
            "does not load (add --auto-detect-ckpt-format)"
        )
    return None
