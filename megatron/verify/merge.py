"""The report from every rank's findings (:func:`merge`): the same on every rank, since only
gathered data is used. Adds the persistent metadata checks, the manifest verdict, the local-copy
verdicts (:mod:`~megatron.verify.copies`), the coverage of the persistent tensors by
the local files, leftover warnings, and a suspect for each value mismatch."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from megatron.integrity.persistent import INTEGRITY_FNAME, PersistentCheckpoint, check_chunk_cover
from megatron.verify.copies import local_iterations
from megatron.verify.discovery import LocalLayout, Plan, holder_of
from megatron.verify.findings import CopyPrint, Findings
from megatron.verify.persistent_checks import metadata_problems
from megatron.verify.report import Problem, VerifyReport

__all__ = ["merge"]

_Regions = Dict[str, Dict[Tuple[tuple, tuple], int]]


def _leftover_warnings(report: VerifyReport, layout: LocalLayout) -> None:
    """Warnings naming what interrupted saves and the local tier's fallback left behind."""
    for rel in layout.dirty:
        report.warnings.append(
            Problem(
                "dirty_file",
                f"{rel}: unfinished local save (*.dirty.pt, left by an interrupted save); ignored",
                file=rel,
                holder_rank=holder_of(rel),
            )
        )
    for rel in layout.rejected:
        report.warnings.append(
            Problem(
                "rejected_file",
                f"{rel}: quarantined by the local tier "
                "(rejected when the run loaded its local checkpoint); not "
                "verified",
                file=rel,
                holder_rank=holder_of(rel),
            )
        )
    for rel, m in sorted(layout.markers.items()):
        if "unreadable" in m:
            what = f"unreadable: {m['unreadable']}"
        else:
            reason = str(m.get("reason", "?"))
            short = reason if len(reason) <= 200 else reason[:197] + "..."
            what = f"iteration {m.get('iteration', '?')}: {short}"
        rank = m.get("rank", holder_of(rel))
        report.warnings.append(
            Problem(
                "bad_tier_marker",
                f"{rel}: bad-tier marker of rank {rank} ({what}); the next start "
                "loads the persistent checkpoint",
                file=rel,
                holder_rank=holder_of(rel),
                details={k: v for k, v in m.items() if isinstance(v, (str, int, float))},
            )
        )


def _state_digest(report: VerifyReport, pc: PersistentCheckpoint) -> Dict[str, Any]:
    """Whether the persistent checkpoint carries the resume proof's ``state_digest.json``."""
    from megatron.integrity.digest import record as digest_record

    try:
        record = digest_record.read_record(pc.path)
    except ValueError as e:
        report.warnings.append(Problem("state_digest", str(e), role="persistent"))
        return {"present": False, "tensors": 0, "iteration": None}
    if record is None:
        return {"present": False, "tensors": 0, "iteration": None}
    return {
        "present": True,
        "tensors": len(record.get("tensors", {})),
        "iteration": record.get("iteration"),
    }


def _manifest_verdict(
    report: VerifyReport, parts: List[Findings], pc: PersistentCheckpoint, manifest: Optional[dict]
) -> None:
    failed = sorted({x for p in parts for x in p.manifest_failed})
    if manifest is None:
        report.manifest = {"present": False, "verified": None, "files": 0, "failed_files": []}
        report.warnings.append(
            Problem(
                "no_manifest",
                f"{pc.path / INTEGRITY_FNAME} is absent "
                "(checkpoint saved without --verify-integrity): file hashes "
                "not checked",
                role="persistent",
            )
        )
        return
    report.manifest = {
        "present": True,
        "verified": not failed,
        "files": len(manifest.get("files", {})),
        "failed_files": [n for n, _ in failed],
        "algorithm": manifest.get("algorithm", "sha256"),
    }
    for n, why in failed:
        report.problems.append(
            Problem(
                "manifest",
                f"persistent {n}: {why}",
                file=None if n == "*" else n,
                role="persistent",
            )
        )


def _coverage(report: VerifyReport, parts: List[Findings], pc: PersistentCheckpoint) -> _Regions:
    """``local_incomplete`` problems for persistent regions no local file holds; returns the
    regions held (with the number of local files holding each)."""
    regions: _Regions = {}
    for p in parts:
        for k, v in p.regions.items():
            dst = regions.setdefault(k, {})
            for reg, n in v.items():
                dst[reg] = dst.get(reg, 0) + n
    for key in sorted(pc.tensors):
        md = pc.tensors[key]
        got = sorted(regions.get(key, {}))
        if not got:
            report.problems.append(
                Problem(
                    "local_incomplete",
                    f"persistent tensor '{key}' {list(md.size)} is in no local file",
                    key=key,
                    shape=list(md.size),
                )
            )
            continue
        for e in check_chunk_cover(tuple(md.size), got):
            report.problems.append(
                Problem(
                    "local_incomplete",
                    f"local shards of '{key}' {list(md.size)}: {e}",
                    key=key,
                    shape=list(md.size),
                )
            )
    return regions


def _suspects(report: VerifyReport, regions: _Regions) -> None:
    """Mark each value mismatch with the side most likely wrong (``details['suspect']``):
    ``"local file changed after save"`` when the file's stored checksum of the tensor fails;
    ``"persistent"`` when every local copy of the region (primary and replicas) differs from the
    persistent data while matching its own checksum; ``"this local copy"`` when other copies of
    the region match the persistent data; ``"unknown"`` for a single copy without a checksum
    verdict."""
    failed_ck = {
        (p.file, p.key, tuple(p.global_offset or ()))
        for p in report.problems
        if p.kind == "checksum_mismatch"
    }
    bad: Dict[Tuple[str, tuple], int] = {}
    for p in report.problems:
        if p.kind == "value_mismatch":
            rk = (p.key, tuple(p.global_offset or ()))
            bad[rk] = bad.get(rk, 0) + 1
    for p in report.problems:
        if p.kind != "value_mismatch":
            continue
        off = tuple(p.global_offset or ())
        copies = sum(n for (o, _s), n in regions.get(p.key, {}).items() if o == off)
        if (p.file, p.key, off) in failed_ck:
            p.details["suspect"] = "local file changed after save (its stored checksum fails)"
        elif bad[(p.key, off)] < copies:
            p.details["suspect"] = (
                "this local copy (other copies of the region match the persistent data)"
            )
        elif copies > 1:
            p.details["suspect"] = (
                "persistent (all local copies differ from it, none fails its checksum)"
            )
        else:
            p.details["suspect"] = "unknown (single local copy)"
        p.message += f" [suspect: {p.details['suspect']}]"


def merge(parts: List[Findings], plan: Plan, verify_manifest: bool) -> VerifyReport:
    """The report from every worker's findings on ``plan`` (its ``checked`` iterations and every
    local file of those some rank saw, ``copies``, whether or not it could be checked)."""
    layout, pc, checked = plan.layout, plan.pc, plan.checked
    report = VerifyReport(
        mode=plan.mode,
        local_dir=str(layout.rank_root) if layout else None,
        persistent_dir=str(pc.path) if pc else None,
        iteration=plan.iteration,
        iterations=list(checked),
    )
    prints: Dict[str, CopyPrint] = {}
    for p in parts:
        report.files += p.files
        report.problems += p.problems
        report.warnings += p.warnings
        prints.update(p.prints)
    if layout is not None:
        _leftover_warnings(report, layout)
    if pc is not None:
        report.problems += metadata_problems(pc)
        report.state_digest = _state_digest(report, pc)
        if verify_manifest:
            _manifest_verdict(report, parts, pc, plan.manifest)
    if layout is not None and plan.copies:
        local_iterations(report, list(checked), list(plan.copies), prints, layout.dirty)
    if layout is not None and pc is not None:
        _suspects(report, _coverage(report, parts, pc))
    report.sort()
    return report
