"""Local-copy verification: per local iteration, does every shard have a copy that verifies
(complete), do all copies of each shard agree and do all shards come from one save (consistent)?
Works on gathered data only (:class:`~megatron.verify.findings.CopyPrint` per file), so
every rank reaches the same verdicts. Adds ``copies_differ`` / ``mixed_saves`` /
``missing_owner`` / ``missing_copy`` problems and ``incomplete_iteration`` warnings; sets
``VerifyReport.local_iterations`` and ``newest_complete_iteration``. Rules: ``docs/verify.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron.integrity.local_layout import parse_local_name
from megatron.verify.discovery import LocalFile
from megatron.verify.findings import CopyPrint
from megatron.verify.report import FileResult, Problem, VerifyReport

__all__ = ["local_iterations"]

# kinds of problems after which a local copy does not count as one that verifies
_UNUSABLE_KINDS = frozenset(
    {
        "unreadable",
        "not_a_local_checkpoint",
        "checksum_mismatch",
        "verifier_error",
        "iteration",
        "identity",
    }
)
_IDENTITY_KEY_FIELDS = ("run_id", "save_token", "iteration", "owner_rank")


def _identity_differences(a: Optional[dict], b: Optional[dict]) -> List[str]:
    """Fields in which two identity records differ: ``run_id``, ``save_token``, ``iteration``,
    ``owner_rank`` first, then the others in name order; nested records (``run_settings``,
    ``topology``) as ``name.field``."""
    if a is None and b is None:
        return []
    if a is None or b is None:
        return ["identity record (one copy has none)"]
    out = []
    others = sorted((set(a) | set(b)) - set(_IDENTITY_KEY_FIELDS), key=str)
    for k in list(_IDENTITY_KEY_FIELDS) + others:
        va, vb = a.get(k), b.get(k)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            out += [
                f"{k}.{n}" for n in sorted(set(va) | set(vb), key=str) if va.get(n) != vb.get(n)
            ]
        else:
            out.append(str(k))
    return out


def _tensor_map(cp: CopyPrint) -> Dict[Tuple[str, Optional[tuple]], list]:
    """(key, global offset) -> [(dtype, shape, checksum)]: the stored checksum where the file has
    one (a copy whose bytes were damaged after the save still agrees with intact copies; the
    damage is a checksum problem of its own), else the checksum of the bytes."""
    m: Dict[Tuple[str, Optional[tuple]], list] = {}
    for key, off, dtype, shape, stored, actual in cp.tensors:
        checksum = stored if stored is not None else actual
        m.setdefault((key, off), []).append((dtype, shape, checksum))
    return m


def _compare_copies(a: CopyPrint, b: CopyPrint) -> Tuple[List[str], int]:
    """Keys of the tensors in which two copies differ (missing on one side included), and how
    many distinct tensors (key, offset) the two hold together."""
    ma, mb = _tensor_map(a), _tensor_map(b)
    keys = sorted(set(ma) | set(mb), key=lambda k: (k[0], k[1] or ()))
    return [k[0] for k in keys if ma.get(k) != mb.get(k)], len(keys)


def _signature(cp: CopyPrint) -> Tuple[tuple, str]:
    """Hashable summary of a copy: equal for copies that agree (see :func:`_compare_copies`)."""
    items = sorted(_tensor_map(cp).items(), key=lambda kv: (kv[0][0], kv[0][1] or ()))
    return tuple((k, tuple(v)) for k, v in items), json.dumps(
        cp.identity, sort_keys=True, default=str
    )


def _save_of(cp: Optional[CopyPrint]) -> Optional[Tuple[Any, Any]]:
    ident = cp.identity if cp is not None else None
    if not ident or "unusable" in ident:
        return None
    return ident.get("run_id"), ident.get("save_token")


def _strict_majority(counts: Dict[Any, int]) -> Any:
    """The value counted most often if no other is counted as often, else ``None``."""
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    if not ranked or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
        return None
    return ranked[0][0]


def _missing_text(
    it: int, owner: int, newest: Optional[int], dirty_of: Dict[Tuple[int, int], List[str]]
) -> str:
    """Why ``owner``'s shard of iteration ``it`` is absent, as far as the directory tells."""
    d = dirty_of.get((it, owner))
    if d:
        return f"rank {owner}'s shard missing (interrupted save: {', '.join(d)})"
    late = newest is not None and it > newest
    return f"rank {owner}'s shard missing" + (" (interrupted save)" if late else "")


@dataclass
class _Context:
    """What every iteration's verdict is made of (gathered data only)."""

    report: VerifyReport
    prints: Dict[str, CopyPrint]
    results: Dict[str, FileResult]
    bad: set  # files with a problem after which they do not verify


@dataclass
class _Facts:
    """One checked iteration, before the newest complete one is known."""

    it: int
    n: int
    world: int
    factor: int
    files: int
    rows: List[dict]
    reasons: List[Any]  # str, or ("missing", owner): worded once the newest complete one is known
    missing: List[int] = field(default_factory=list)
    few: List[Tuple[int, List[LocalFile]]] = field(default_factory=list)
    complete: bool = False
    consistent: bool = False


def _suspect(
    ctx: _Context,
    it: int,
    ref: LocalFile,
    other: LocalFile,
    loaded: List[LocalFile],
    common_save: Any,
    sig: Dict[str, Any],
) -> Tuple[Optional[LocalFile], Optional[str]]:
    """The copy of two that differ likely to be wrong, and why (``(None, None)``: no telling).
    ``sig`` caches the copies' signatures for this shard."""
    prints = ctx.prints
    sa, sb = _save_of(prints[ref.rel]), _save_of(prints[other.rel])
    if common_save is not None and sa != sb and common_save in (sa, sb):
        suspect = ref if sb == common_save else other
        return suspect, f"its run id / save token differ from the other files of iteration {it}"
    if len(loaded) > 2:  # with more than 2 copies: which ones agree (majority -> suspect)
        if not sig:
            sig.update({f.rel: _signature(prints[f.rel]) for f in loaded})
        sigs: Dict[Any, int] = {}
        for v in sig.values():
            sigs[v] = sigs.get(v, 0) + 1
        best = _strict_majority(sigs)
        if best is not None and (sig[ref.rel] == best) != (sig[other.rel] == best):
            suspect = other if sig[ref.rel] == best else ref
            return suspect, "the other copies agree with each other"
    return None, None


def _compare_shard(
    ctx: _Context,
    it: int,
    owner: int,
    loaded: List[LocalFile],
    row: dict,
    reasons: List[Any],
    common_save: Any,
) -> None:
    """Compare the first loaded copy of a shard with each other one (``copies_differ``)."""
    prints, ref = ctx.prints, loaded[0]
    sig: Dict[str, Any] = {}
    for other in loaded[1:]:
        differing, total = _compare_copies(prints[ref.rel], prints[other.rel])
        fields = _identity_differences(prints[ref.rel].identity, prints[other.rel].identity)
        if not differing and not fields:
            continue
        row["consistent"] = False
        suspect, why = _suspect(ctx, it, ref, other, loaded, common_save, sig)
        msg = (
            f"rank {owner}'s shard of iteration {it}: {ref.role} {ref.rel} and {other.role} "
            f"{other.rel} "
            + (
                f"differ in {len(differing)} of {total} tensors"
                if differing
                else f"hold the same {total} tensors"
            )
            + (f"; identity records differ in {', '.join(fields)}" if fields else "")
        )
        if suspect is not None:
            msg += f" [suspect: {suspect.role} {suspect.rel}: {why}]"
        ctx.report.problems.append(
            Problem(
                "copies_differ",
                msg,
                file=other.rel,
                holder_rank=other.holder_rank,
                owner_rank=owner,
                role=other.role,
                iteration=it,
                details={
                    "files": [ref.rel, other.rel],
                    "holders": [ref.holder_rank, other.holder_rank],
                    "differing_tensors": len(differing),
                    "tensors": total,
                    "first_differing_keys": differing[:5],
                    "identity_fields": fields,
                    "suspect": suspect.rel if suspect is not None else None,
                },
            )
        )
        reasons.append(
            f"rank {owner}'s shard: {ref.role} {ref.rel} and {other.role} {other.rel} differ"
        )


def _iteration_facts(
    ctx: _Context, it: int, shards: Dict[int, List[LocalFile]], top_owner: int
) -> _Facts:
    prints, results = ctx.prints, ctx.results
    files = [f for fs in shards.values() for f in fs]
    world = max((results[f.rel].world_size or 0 for f in files if f.rel in results), default=0)
    factor = max(
        (results[f.rel].replication_factor or 1 for f in files if f.rel in results), default=1
    )
    n_owners = max(world, max(shards, default=-1) + 1) if world else top_owner + 1
    saves: Dict[Any, int] = {}
    for f in files:
        sv = _save_of(prints.get(f.rel))
        if sv is not None:
            saves[sv] = saves.get(sv, 0) + 1
    common_save = _strict_majority(saves)
    facts = _Facts(it, n_owners, world, factor, len(files), [], [])
    shard_saves = {}
    for owner in range(n_owners):
        fs = sorted(
            shards.get(owner, []), key=lambda f: (f.role != "primary", f.holder_rank, f.rel)
        )
        loaded = [f for f in fs if f.rel in prints and prints[f.rel].loaded]
        usable = [f for f in loaded if f.rel in results and f.rel not in ctx.bad]
        row = {
            "owner_rank": owner,
            "copies": sorted(f.rel for f in fs),
            "usable": sorted(f.rel for f in usable),
            "consistent": True,
        }
        facts.rows.append(row)
        if not fs:
            facts.missing.append(owner)
            facts.reasons.append(("missing", owner))
            continue
        if not usable:
            facts.reasons.append(
                f"rank {owner}'s shard: no copy verifies ({', '.join(row['copies'])})"
            )
        if len(fs) < factor:
            facts.few.append((owner, fs))
        if loaded:
            _compare_shard(ctx, it, owner, loaded, row, facts.reasons, common_save)
        if row["consistent"] and loaded and _save_of(prints[loaded[0].rel]) is not None:
            shard_saves[owner] = _save_of(prints[loaded[0].rel])
    distinct = sorted(set(shard_saves.values()), key=str)
    if len(distinct) > 1:
        groups = "; ".join(
            f"run {run} save {tok} (rank(s) "
            f"{[o for o, v in sorted(shard_saves.items()) if v == (run, tok)]})"
            for run, tok in distinct
        )
        ctx.report.problems.append(
            Problem(
                "mixed_saves",
                f"iteration {it}: its files come from {len(distinct)} saves: {groups}; "
                "a checkpoint is one save of all ranks",
                iteration=it,
                details={"saves": [list(d) for d in distinct]},
            )
        )
        facts.reasons.append(f"shards from {len(distinct)} saves")
    facts.complete = not facts.missing and all(r["usable"] for r in facts.rows)
    facts.consistent = all(r["consistent"] for r in facts.rows) and len(distinct) <= 1
    return facts


def _verdict(
    report: VerifyReport,
    f: _Facts,
    newest: Optional[int],
    dirty_of: Dict[Tuple[int, int], List[str]],
) -> dict:
    """Problems / warnings of one iteration once ``newest`` is known; its ``local_iterations``
    row."""
    it = f.it
    reasons = [
        _missing_text(it, r[1], newest, dirty_of) if isinstance(r, tuple) else r for r in f.reasons
    ]
    if f.missing and newest is not None:
        notes = [_missing_text(it, o, newest, dirty_of) for o in f.missing]
        notes += [f"rank {o}'s shard has {len(fs)} of {f.factor} copies" for o, fs in f.few]
        report.warnings.append(
            Problem(
                "incomplete_iteration",
                f"iteration {it}: {'; '.join(notes)}; newest complete and "
                f"consistent local iteration: {newest}",
                iteration=it,
                details={"missing_owners": f.missing, "newest_complete_iteration": newest},
            )
        )
    else:
        ran = f"the run had {f.world} ranks" if f.world else f"owner ranks up to {f.n - 1} seen"
        for o in f.missing:
            report.problems.append(
                Problem(
                    "missing_owner",
                    f"no local file holds rank {o}'s shard of iteration {it} ({ran})",
                    owner_rank=o,
                    iteration=it,
                )
            )
        for o, fs in f.few:
            text = (
                f"rank {o}'s shard of iteration {it} has {len(fs)} local cop"
                f"{'y' if len(fs) == 1 else 'ies'} (held by ranks "
                f"{sorted(x.holder_rank for x in fs)}); the run replicated with "
                f"--replication-factor {f.factor}"
            )
            report.problems.append(Problem("missing_copy", text, owner_rank=o, iteration=it))
    return {
        "iteration": it,
        "owners": f.n,
        "files": f.files,
        "complete": f.complete,
        "consistent": f.consistent,
        "reasons": reasons,
        "shards": f.rows,
    }


def local_iterations(
    report: VerifyReport,
    checked: List[int],
    copies: List[LocalFile],
    prints: Dict[str, CopyPrint],
    dirty: Sequence[str],
) -> None:
    """Verdicts of every checked local iteration (see the module docstring).

    A missing shard is a problem unless another checked iteration is complete and consistent
    (then the loader can use that one: the missing shard is the trace of an interrupted save, a
    warning); too few copies of a shard (``--replication-factor``) are a problem in an iteration
    that is otherwise complete.

    Args:
        checked: the iterations whose files were checked; ``copies``: every local file of those
            iterations some rank saw; ``prints``: file ``rel`` -> its copy print; ``dirty``:
            unfinished saves (relative paths).
    """
    results = {f.file: f for f in report.files if f.role in ("primary", "replica")}
    bad = {p.file for p in report.problems if p.kind in _UNUSABLE_KINDS and p.file}
    ctx = _Context(report, prints, results, bad)
    dirty_of: Dict[Tuple[int, int], List[str]] = {}
    for rel in dirty:
        parsed = parse_local_name(Path(rel).name)
        if parsed is not None:
            dirty_of.setdefault((parsed[0], parsed[1]), []).append(rel)
    by_it: Dict[int, Dict[int, List[LocalFile]]] = {}
    for f in copies:
        by_it.setdefault(f.iteration, {}).setdefault(f.owner_rank, []).append(f)
    top_owner = max(f.owner_rank for f in copies)
    facts = [_iteration_facts(ctx, it, by_it.get(it, {}), top_owner) for it in checked]
    ok = [f.it for f in facts if f.complete and f.consistent]
    newest = max(ok) if ok else None
    report.local_iterations = [_verdict(report, f, newest, dirty_of) for f in facts]
    report.newest_complete_iteration = newest
