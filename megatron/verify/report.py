"""Result records of the checkpoint verifier (:mod:`megatron.verify`): problems, per-file
results, the report, its JSON form and its text tables.

Everything in a :class:`VerifyReport` except its ``timing`` section is deterministic: the same
checkpoint verified by one process or by N processes gives the same dictionary from
:meth:`VerifyReport.to_dict` ``(include_timing=False)``. The JSON schema (``format``
``megatron.integrity.verify_report``, version 1) and the rules for complete and consistent local
iterations: ``docs/verify.md``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from megatron.verify.text_table import format_table, human_bytes

__all__ = [
    "PROBLEM_KINDS",
    "WARNING_KINDS",
    "FileResult",
    "Problem",
    "VerifyReport",
    "format_table",
    "normalize_key",
]

REPORT_FORMAT = "megatron.integrity.verify_report"
REPORT_VERSION = 1

PROBLEM_KINDS: Dict[str, str] = {
    "value_mismatch": (
        "a local tensor's bytes differ from the same region of the persistent checkpoint"
    ),
    "checksum_mismatch": "a local tensor's bytes do not match the xxh3 checksum stored in its file",
    "nonfinite": "a tensor holds NaN or Inf values",
    "dtype_mismatch": "local and persistent dtypes of a tensor differ (cannot compare bitwise)",
    "missing_in_persistent": (
        "a local tensor region / object is not (fully) in the persistent checkpoint"
    ),
    "object_mismatch": "a local ShardedObject differs from the persistent one",
    "unreadable": "a file, tensor chunk or object cannot be read / deserialised",
    "unsafe_pickle": (
        "a file or object names a global outside the unpickling allowlist "
        "(megatron/integrity/unpickle.py): not loaded, nothing it names imported or called"
    ),
    "not_a_local_checkpoint": "a local file does not hold a tensor-aware state dict",
    "iteration": "a file's recorded iteration differs from the iteration being verified",
    "coverage": (
        "a persistent tensor's chunks do not tile its global shape exactly (gap, overlap, out of "
        "bounds)"
    ),
    "storage": "a persistent chunk's storage entry is missing or lies beyond the end of its file",
    "manifest": (
        "integrity.json (its algorithm named with the finding: this fork's per-block xxh3-64, or "
        "megatron-core's SHA-256 per file) does not match the files"
    ),
    "local_incomplete": "the local files together do not hold every region of a persistent tensor",
    "missing_copy": (
        "an owner rank has fewer local copies (primary + replicas) than the replication factor"
    ),
    "missing_owner": "no local file at all holds some rank's shard",
    "copies_differ": (
        "copies (primary and replicas) of one shard hold different tensors or identity records"
    ),
    "mixed_saves": "the shards of one local iteration carry the identity of different saves / runs",
    "identity": (
        "a local file's identity record is unusable or names another iteration / owner than its "
        "file name"
    ),
    "verifier_error": "the verifier itself failed on a file (the message has the traceback)",
}
"""Kinds of :class:`Problem` that make a report fail (exit status 1)."""

WARNING_KINDS: Dict[str, str] = {
    "no_checksum_record": (
        "a local file has no per-tensor checksum record (written without the replication fix)"
    ),
    "no_manifest": (
        "the persistent checkpoint has no integrity.json (saved without --verify-integrity)"
    ),
    "state_digest": "the persistent checkpoint's state_digest.json is unreadable",
    "dirty_file": "an unfinished local save (*.dirty.pt) is present",
    "rejected_file": (
        "a local file quarantined by the training run's local tier (<rank>/rejected/) is present"
    ),
    "bad_tier_marker": (
        "a bad-tier marker (<rank>/LOCAL_TIER_BAD.json) is present: the next start loads the "
        "persistent checkpoint"
    ),
    "incomplete_iteration": (
        "a local iteration lacks some rank's shard (interrupted save) while another local "
        "iteration is complete and consistent"
    ),
    "object_not_compared": "a local ShardedObject has no persistent counterpart to compare with",
    "not_compared": (
        "a local file is not a Megatron (MCore) tensor-aware state dict: only checksums and "
        "NaN/Inf checked"
    ),
}
"""Kinds of :class:`Problem` reported as warnings only."""

#: Kinds that concern one tensor shard of one file and go into the per-key mismatch table.
SHARD_KINDS = (
    "value_mismatch",
    "checksum_mismatch",
    "nonfinite",
    "dtype_mismatch",
    "missing_in_persistent",
    "object_mismatch",
    "unreadable",
)

_NUM_SEGMENT = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def normalize_key(key: str) -> Tuple[str, Tuple[int, ...]]:
    """Replace numeric path segments of a checkpoint key by ``*``.

    ``decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight`` ->
    ``("decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight", (3, 7))``.

    Megatron's default (layer-stacked) ShardedTensors have no layer number in the key: the layer is
    the first *prepended* axis of ``global_offset`` (``prepend_axis_num``); the verifier reports it
    next to the normalised key (column ``indices``).

    Returns:
        ``(pattern, numbers)``: the key with numeric segments replaced, and the replaced numbers
        in order.
    """
    numbers = tuple(int(m.group(0)) for m in _NUM_SEGMENT.finditer(key))
    return _NUM_SEGMENT.sub("*", key), numbers


@dataclass
class Problem:
    """One finding. ``kind`` is a key of :data:`PROBLEM_KINDS` (a failure) or :data:`WARNING_KINDS`.

    Attributes:
        kind: what is wrong (see the two tables).
        message: human-readable, names the file / key / rank and what to do where
            useful.
        file: path of the file concerned, relative to the local root
            (``"1/iter_0000010_0_local.pt"``) or the persistent iteration directory
            (``"__0_0.distcp"``); ``None`` for global findings.
        holder_rank: rank whose local directory holds the file (local files only).
        owner_rank: rank whose shard the file holds (file name ``iter_<it>_<owner>_local.pt``).
        role: ``"primary"`` (holder == owner), ``"replica"`` or ``"persistent"``.
        iteration: the local iteration concerned (local findings), else ``None``.
        key: ``ShardedTensor.key`` / ``ShardedObject.key`` / DCP key.
        global_offset: offset of the shard in the global tensor (elements, one per global axis).
        prepend_axis_num: how many leading axes of ``global_offset`` are prepended
            (layer/expert) axes.
        shape: shard shape (the local tensor's shape).
        dtype: e.g. ``"bfloat16"``.
        nbytes: shard size in bytes.
        details: kind-specific numbers (``differing_elements``, ``first_difference_global_index``,
            ``max_abs_difference``, ``nan``, ``inf``, ``expected_checksum``, ``actual_checksum``,
            ``suspect``...).
    """

    kind: str
    message: str
    file: Optional[str] = None
    holder_rank: Optional[int] = None
    owner_rank: Optional[int] = None
    role: Optional[str] = None
    iteration: Optional[int] = None
    key: Optional[str] = None
    global_offset: Optional[List[int]] = None
    prepend_axis_num: int = 0
    shape: Optional[List[int]] = None
    dtype: Optional[str] = None
    nbytes: Optional[int] = None
    details: Dict[str, Any] = field(default_factory=dict)

    def sort_key(self) -> tuple:
        """Order of problems in a report: kind, file, key, offset, message."""
        return (
            self.kind,
            self.file or "",
            self.key or "",
            tuple(self.global_offset or ()),
            self.message,
        )

    def to_dict(self) -> dict:
        """The JSON form (every field)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Problem":
        """Inverse of :meth:`to_dict`."""
        return cls(**d)


@dataclass
class FileResult:
    """Counts for one verified file (a local checkpoint file or a persistent ``.distcp`` file).

    Bytes are tensor payload bytes (``numel * element_size``), not file sizes, except
    ``file_bytes``. ``iteration`` and ``has_identity`` (an identity record of
    :mod:`megatron.integrity.local_identity`) are set for local files only.
    """

    file: str
    role: str  # "primary" | "replica" | "persistent"
    holder_rank: Optional[int] = None
    owner_rank: Optional[int] = None
    iteration: Optional[int] = None
    file_bytes: int = 0
    tensors: int = 0
    tensors_compared: int = 0
    tensors_equal: int = 0
    tensors_mismatched: int = 0
    bytes_compared: int = 0
    bytes_scanned: int = 0
    checksums_verified: int = 0
    checksums_failed: int = 0
    has_checksum_record: Optional[bool] = None
    has_identity: Optional[bool] = None
    nonfinite_tensors: int = 0
    objects_compared: int = 0
    objects_equal: int = 0
    objects_skipped: int = 0
    objects_read: int = 0
    replication_factor: Optional[int] = None
    world_size: Optional[int] = None
    persistent_bytes_read: int = 0

    def to_dict(self) -> dict:
        """The JSON form (every field)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FileResult":
        """Inverse of :meth:`to_dict`."""
        return cls(**d)


def _ranks(values: Iterable[Optional[int]]) -> str:
    vals = sorted({v for v in values if v is not None})
    return ",".join(map(str, vals)) if vals else "-"


@dataclass
class VerifyReport:
    """Outcome of a verification.

    Attributes:
        mode: ``"local+persistent"``, ``"persistent"`` or ``"local"``.
        local_dir / persistent_dir: what was verified (``persistent_dir`` is the iteration
            directory).
        iteration: the training iteration verified (local alone, several iterations: the
            newest).
        iterations: the local iterations whose files were checked: ``[iteration]``, all local
            iterations when the local checkpoint is verified alone without an iteration given,
            ``[]`` for a persistent checkpoint alone.
        local_iterations: local modes: per checked iteration, whether it is complete and
            consistent, why not, and its shards' copies (see the module docstring); ``None`` for
            persistent alone.
        newest_complete_iteration: the newest of ``local_iterations`` that is complete and
            consistent, ``None`` if none is.
        files: per-file counts, sorted by file name.
        problems: findings that make the verification fail, sorted.
        warnings: findings that do not.
        manifest: result of megatron-core's ``integrity.json`` verification (``None`` if not
            run): ``{"present": bool, "verified": bool | None, "files": int,
            "failed_files": [name, ...], "algorithm": str | None}``.
        state_digest: the persistent checkpoint's ``state_digest.json`` (the resume proof's
            record, :mod:`megatron.integrity.digest.record`): ``{"present": bool, "tensors": int,
            "iteration": int | None}``, ``None`` without a persistent checkpoint. Its values are
            recomputed from the files by ``tools/check_state_digest.py``.
        timing: ``wall_s`` (seconds inside :func:`~megatron.verify.verify_checkpoint`,
            without interpreter start-up), ``workers`` (processes), ``bytes_read`` (file bytes the
            checks read, persistent chunks counted once per local copy compared with them),
            ``file_bytes`` (size of the files verified: local files, or the persistent data files
            when verified alone) and ``gb_per_s`` (``file_bytes`` / ``wall_s`` / 10^9); not
            deterministic, excluded by ``to_dict(include_timing=False)``.
    """

    mode: str
    local_dir: Optional[str]
    persistent_dir: Optional[str]
    iteration: Optional[int]
    iterations: List[int] = field(default_factory=list)
    local_iterations: Optional[List[Dict[str, Any]]] = None
    newest_complete_iteration: Optional[int] = None
    files: List[FileResult] = field(default_factory=list)
    problems: List[Problem] = field(default_factory=list)
    warnings: List[Problem] = field(default_factory=list)
    manifest: Optional[Dict[str, Any]] = None
    state_digest: Optional[Dict[str, Any]] = None
    timing: Dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no problem (only warnings, if any) was found."""
        return not self.problems

    @property
    def exit_code(self) -> int:
        """0 when :attr:`ok`, else 1 (the CLI uses 2 for bad input)."""
        return 0 if self.ok else 1

    def sort(self) -> None:
        """Sort files, problems and warnings.

        (A report's content does not depend on who found what.)
        """
        self.files.sort(key=lambda f: (f.file, f.role))
        self.problems.sort(key=Problem.sort_key)
        self.warnings.sort(key=Problem.sort_key)

    # ---- aggregation -------------------------------------------------------------------------

    def summary(self) -> Dict[str, Any]:
        """Counts over all files: files (by role), tensors compared / equal / mismatched, bytes
        compared, checksums verified / failed, tensors with NaN/Inf, objects, problems by kind."""
        s: Dict[str, Any] = {
            "files": len(self.files),
            "primary_files": sum(f.role == "primary" for f in self.files),
            "replica_files": sum(f.role == "replica" for f in self.files),
            "persistent_files": sum(f.role == "persistent" for f in self.files),
        }
        for name in (
            "file_bytes",
            "tensors",
            "tensors_compared",
            "tensors_equal",
            "tensors_mismatched",
            "bytes_compared",
            "bytes_scanned",
            "checksums_verified",
            "checksums_failed",
            "nonfinite_tensors",
            "objects_compared",
            "objects_equal",
            "objects_skipped",
            "objects_read",
        ):
            s[name] = sum(getattr(f, name) for f in self.files)
        by_kind: Dict[str, int] = {}
        for p in self.problems:
            by_kind[p.kind] = by_kind.get(p.kind, 0) + 1
        s["problems"] = len(self.problems)
        s["problems_by_kind"] = dict(sorted(by_kind.items()))
        s["warnings"] = len(self.warnings)
        wk: Dict[str, int] = {}
        for p in self.warnings:
            wk[p.kind] = wk.get(p.kind, 0) + 1
        s["warnings_by_kind"] = dict(sorted(wk.items()))
        return s

    def mismatch_rows(self) -> List[Dict[str, Any]]:
        """The per-key table of bad shards: one row per normalised key (numeric segments -> ``*``).

        Columns: ``key`` (pattern), ``shards`` (distinct file/shard pairs with any problem),
        ``value`` / ``checksum`` / ``nonfinite`` / ``other`` (shards per problem kind),
        ``primary`` / ``replica`` / ``persistent`` (shards by role), ``owners`` / ``holders``
        (ranks), ``indices`` (numbers replaced in the key and prepended-axis offsets, e.g. layers).
        """
        rows: Dict[str, Dict[str, Any]] = {}
        for p in self.problems:
            if p.kind not in SHARD_KINDS or p.key is None:
                continue
            pattern, nums = normalize_key(p.key)
            r = rows.setdefault(
                pattern,
                {
                    "key": pattern,
                    "_shards": {},
                    "_owners": set(),
                    "_holders": set(),
                    "_indices": set(),
                },
            )
            shard = (p.file, p.key, tuple(p.global_offset or ()))
            kinds, role = r["_shards"].setdefault(shard, (set(), p.role))
            kinds.add(p.kind)
            r["_owners"].add(p.owner_rank)
            r["_holders"].add(p.holder_rank)
            idx = tuple(nums) + tuple((p.global_offset or [])[: p.prepend_axis_num])
            if idx:
                r["_indices"].add(idx)
        out = []
        for pattern in sorted(rows):
            r = rows[pattern]
            shards = r["_shards"]

            def n(pred):
                return sum(
                    1
                    for kinds, role in shards.values()  # noqa: B023 called in this iteration
                    if pred(kinds, role)
                )

            idx = sorted(r["_indices"])
            out.append(
                {
                    "key": pattern,
                    "shards": len(shards),
                    "value": n(lambda k, _: "value_mismatch" in k),
                    "checksum": n(lambda k, _: "checksum_mismatch" in k),
                    "nonfinite": n(lambda k, _: "nonfinite" in k),
                    "other": n(
                        lambda k, _: bool(k - {"value_mismatch", "checksum_mismatch", "nonfinite"})
                    ),
                    "primary": n(lambda _, role: role == "primary"),
                    "replica": n(lambda _, role: role == "replica"),
                    "persistent": n(lambda _, role: role == "persistent"),
                    "owners": _ranks(r["_owners"]),
                    "holders": _ranks(r["_holders"]),
                    "indices": " ".join("(" + ",".join(map(str, i)) + ")" for i in idx[:8])
                    + (f" +{len(idx) - 8}" if len(idx) > 8 else ""),
                }
            )
        return out

    def local_iteration_lines(self) -> List[str]:
        """Text lines on the local iterations: one per checked iteration (complete and consistent,
        or why not), then ``newest complete and consistent local iteration: N`` (``none``), followed
        by why the newer iterations are not, in parentheses.

        Returns:
            ``[]`` when the report has no local iterations (persistent checkpoint alone).
        """
        if self.local_iterations is None:
            return []
        out = ["Local iterations:"]
        for it in self.local_iterations:
            head = f"  {it['iteration']}: "
            if it["complete"] and it["consistent"]:
                out.append(
                    head + f"complete and consistent ({it['owners']} shards, {it['files']} files)"
                )
            else:
                state = (
                    ("complete" if it["complete"] else "INCOMPLETE")
                    + ", "
                    + ("consistent" if it["consistent"] else "INCONSISTENT")
                )
                out.append(head + f"{state}: " + "; ".join(it["reasons"]))
        newest = self.newest_complete_iteration
        newer = [it for it in self.local_iterations if newest is None or it["iteration"] > newest]
        why = "; ".join(
            f"iteration {it['iteration']}: {'; '.join(it['reasons'])}" for it in reversed(newer)
        )
        out.append(
            "newest complete and consistent local iteration: "
            f"{'none' if newest is None else newest}" + (f" ({why})" if why else "")
        )
        return out

    # ---- serialisation -----------------------------------------------------------------------

    def to_dict(self, include_timing: bool = True) -> Dict[str, Any]:
        """The JSON report (see the module docstring)."""
        d = {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "mode": self.mode,
            "ok": self.ok,
            "local_dir": self.local_dir,
            "persistent_dir": self.persistent_dir,
            "iteration": self.iteration,
            "iterations": list(self.iterations),
            "newest_complete_iteration": self.newest_complete_iteration,
            "local_iterations": self.local_iterations,
            "summary": self.summary(),
            "mismatch_table": self.mismatch_rows(),
            "problems": [p.to_dict() for p in self.problems],
            "warnings": [p.to_dict() for p in self.warnings],
            "files": [f.to_dict() for f in self.files],
            "manifest": self.manifest,
            "state_digest": self.state_digest,
        }
        if include_timing:
            d["timing"] = dict(self.timing)
        return d

    def format_text(self, max_rows: int = 50) -> str:
        """Summary, the per-key mismatch table, and the first ``max_rows`` problems and warnings."""
        its = (
            f"iterations {', '.join(map(str, self.iterations))}"
            if len(self.iterations) > 1
            else f"iteration {self.iteration}"
        )
        lines = [
            f"Checkpoint verification ({self.mode}), {its}",
            f"  local:      {self.local_dir or '-'}",
            f"  persistent: {self.persistent_dir or '-'}",
            "",
        ]
        lines.append(format_table(("summary", "value"), self._summary_rows(self.summary())))
        if self.local_iterations is not None:
            lines += ["", *self.local_iteration_lines()]
        lines += self._mismatch_table_lines(max_rows)
        for title, items in (("Problems", self.problems), ("Warnings", self.warnings)):
            if items:
                lines += ["", f"{title} ({len(items)}):"]
                for p in items[:max_rows]:
                    lines.append(f"  [{p.kind}] {p.message}")
                if len(items) > max_rows:
                    lines.append(f"  ... {len(items) - max_rows} more (see --json)")
        lines += [
            "",
            "RESULT: " + ("OK" if self.ok else f"FAILED ({len(self.problems)} problem(s))"),
        ]
        return "\n".join(lines)

    def _summary_rows(self, s: Dict[str, Any]) -> List[Tuple[str, Any]]:
        """``(label, value)`` rows of the text summary table from :meth:`summary` ``s``: the counts
        this mode has, then integrity.json, state_digest.json, findings and time."""
        persistent_only = self.mode == "persistent"
        rows = [
            (
                "files",
                f"{s['files']} ({s['primary_files']} primary, {s['replica_files']} replica, "
                f"{s['persistent_files']} persistent)",
            ),
            ("tensor chunks read" if persistent_only else "tensors", s["tensors"]),
        ]
        if self.mode == "local+persistent":
            rows += [
                ("tensors compared", s["tensors_compared"]),
                ("  equal (bitwise)", s["tensors_equal"]),
                ("  mismatched", s["tensors_mismatched"]),
                ("bytes compared", f"{s['bytes_compared']} ({human_bytes(s['bytes_compared'])})"),
            ]
        rows += [
            (
                "bytes scanned for NaN/Inf",
                f"{s['bytes_scanned']} ({human_bytes(s['bytes_scanned'])})",
            ),
            ("tensors with NaN/Inf", s["nonfinite_tensors"]),
        ]
        if not persistent_only:
            rows += [
                ("checksums verified", s["checksums_verified"]),
                ("  failed", s["checksums_failed"]),
            ]
        if self.mode == "local+persistent":
            rows.append(
                (
                    "objects compared",
                    f"{s['objects_compared']} ({s['objects_equal']} equal, "
                    f"{s['objects_skipped']} not comparable)",
                )
            )
        if persistent_only:
            rows.append(("objects read", s["objects_read"]))
        rows += self._record_rows()
        rows.append(("problems", f"{s['problems']} {s['problems_by_kind'] or ''}".strip()))
        rows.append(("warnings", f"{s['warnings']} {s['warnings_by_kind'] or ''}".strip()))
        if self.timing:
            t = self.timing
            rows.append(
                (
                    "time",
                    f"{t.get('wall_s', 0):.2f} s on {t.get('workers', 1)} process(es), "
                    f"{human_bytes(t.get('bytes_read', 0))} read, {t.get('gb_per_s', 0):.3f} GB/s",
                )
            )
        return rows

    def _record_rows(self) -> List[Tuple[str, str]]:
        """Summary rows on the persistent checkpoint's records: ``integrity.json`` (its algorithm,
        verified / FAILED / skipped / absent) and ``state_digest.json``, each when looked at."""
        rows = []
        if self.manifest is not None:
            m = self.manifest
            state = (
                "absent"
                if not m.get("present")
                else "verified"
                if m.get("verified")
                else "FAILED"
                if m.get("verified") is False
                else "skipped"
            )
            algorithm = {"sha256": "SHA-256"}.get(m.get("algorithm") or "", m.get("algorithm"))
            name = f"integrity.json ({algorithm})" if algorithm else "integrity.json"
            rows.append((name, f"{state}, {m.get('files', 0)} files"))
        if self.state_digest is not None:
            g = self.state_digest
            rows.append(
                (
                    "state_digest.json",
                    f"present, {g.get('tensors', 0)} tensors (values: tools/check_state_digest.py)"
                    if g.get("present")
                    else "absent (saved without a state digest: its resumes are not proven)",
                )
            )
        return rows

    def _mismatch_table_lines(self, max_rows: int) -> List[str]:
        """Text lines of the per-key table of bad shards (:meth:`mismatch_rows`, its first
        ``max_rows`` keys), preceded by a blank line and its title; ``[]`` when no shard is bad."""
        mrows = self.mismatch_rows()
        if not mrows:
            return []
        lines = [
            "",
            "Bad shards per key (numeric key segments -> *; indices: replaced numbers and "
            "prepended-axis offsets, e.g. layer):",
        ]
        cols = (
            "key",
            "shards",
            "value",
            "checksum",
            "nonfinite",
            "other",
            "primary",
            "replica",
            "persistent",
            "owners",
            "holders",
            "indices",
        )
        lines.append(
            format_table(cols, [[r[c] for c in cols] for r in mrows[:max_rows]], max_width=80)
        )
        if len(mrows) > max_rows:
            lines.append(f"... {len(mrows) - max_rows} more keys (see --json)")
        return lines
