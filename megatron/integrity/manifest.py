"""Checksum manifest of a persistent checkpoint directory (``integrity.json``): written at save,
verified at load, so that a flipped, truncated or missing file is found and named, with its byte
range, before its bytes reach the model.

The file is megatron-core's integrity manifest (``{"algorithm": ..., "files": {name: checksum}}``,
``megatron.core.dist_checkpointing.validation``) with a faster algorithm, ``xxh3-64-blocks``:
xxh3-64 of every :data:`BLOCK_BYTES` block of a file (``"blocks"``), the file's size (``"sizes"``)
and, under ``"files"``, the xxh3-128 of the size and block checksums (one value per file, as
upstream's format has; :mod:`megatron.integrity.checksum.file`). Upstream's ``sha256`` manifests
verify as well, file by file. Design and measured costs: ``docs/persistent-tier.md``.

Saving and verifying are collective when ``torch.distributed`` is initialised: every rank hashes
the data files it wrote (``__<rank>_<n>.distcp``) or its share of the files to verify, then one
``all_gather_object`` gives every rank the same result, so an error is raised on every rank.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from megatron.integrity.checksum import written as written_checksums
from megatron.integrity.checksum.file import (
    ALGORITHM,
    BLOCK_BYTES,
    VERSION,
    FileChecksum,
    hash_file,
    sha256_file,
)
from megatron.integrity.dcp_metadata import DcpMetadataError, read_dcp_metadata
from megatron.overlay import collective
from megatron.overlay.errors import OverlayError

__all__ = [
    "ALGORITHM",
    "BLOCK_BYTES",
    "INTEGRITY_FNAME",
    "UPSTREAM_ALGORITHM",
    "VERSION",
    "CheckpointIntegrityError",
    "FileChecksum",
    "FileProblem",
    "VerifySummary",
    "check_files",
    "check_storage_ranges",
    "hash_file",
    "read_manifest",
    "save_manifest",
    "verify_checkpoint_dir",
]

INTEGRITY_FNAME = "integrity.json"  # megatron-core's name (validation.INTEGRITY_FNAME)
UPSTREAM_ALGORITHM = "sha256"

_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp$")

try:  # megatron-core's exception type, so that callers catching it keep working
    from megatron.core.dist_checkpointing.core import CheckpointingException as _Base
except ImportError:  # pragma: no cover - megatron-core is a dependency
    _Base = RuntimeError


@dataclass(frozen=True)
class FileProblem:
    """What is wrong with one file of a checkpoint directory.

    Attributes:
        file: name relative to the checkpoint directory.
        what: short description (``"missing"``, ``"truncated: 100 of 4096 bytes"``, ...).
        start, end: the byte range concerned, inclusive, or ``None``.
        holds: tensor/object keys stored in that range (from ``.metadata``), when known.
    """

    file: str
    what: str
    start: Optional[int] = None
    end: Optional[int] = None
    holds: Tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f" (bytes {self.start}-{self.end})" if self.start is not None else ""
        held = ""
        if self.holds:
            shown = ", ".join(self.holds[:4]) + (
                f", and {len(self.holds) - 4} more" if len(self.holds) > 4 else ""
            )
            held = f"; holds {shown}"
        return f"{self.file}: {self.what}{where}{held}"


class CheckpointIntegrityError(OverlayError, _Base):
    """A checkpoint directory failed verification: files missing, truncated or changed since the
    save, or (when the manifest is required) saved without ``integrity.json``.

    Attributes:
        checkpoint_dir: the directory verified.
        problems: one :class:`FileProblem` per finding, sorted by file.
    """

    def __init__(
        self,
        checkpoint_dir: Union[str, os.PathLike],
        problems: Sequence[FileProblem],
        detail: str = "",
        advice: str = "",
    ) -> None:
        self.checkpoint_dir = str(checkpoint_dir)
        self.problems = tuple(problems)
        self.detail = detail
        lines = [
            f"checkpoint {self.checkpoint_dir} failed verification"
            f"{' (' + detail + ')' if detail else ''}:"
        ]
        lines += [f"  {p}" for p in self.problems]
        if advice:
            lines.append(advice)
        super().__init__("\n".join(lines))


@dataclass
class VerifySummary:
    """What :func:`verify_checkpoint_dir` checked: ``algorithm`` (``None``: no manifest, sizes
    only), ``files``, ``bytes`` hashed over all ranks, ``seconds`` (this rank's wall time)."""

    algorithm: Optional[str]
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# The manifest file
# ---------------------------------------------------------------------------------------------


def _manifest_names(checkpoint_dir: Path) -> List[str]:
    """Top-level regular files of a checkpoint directory, except the manifest and its temporary
    and the checksum side files of saves (:mod:`megatron.integrity.checksum.written`)."""
    out = []
    for e in os.scandir(checkpoint_dir):
        name = e.name[: -len(".tmp")] if e.name.endswith(".tmp") else e.name
        if (
            e.is_file(follow_symlinks=False)
            and not e.name.startswith(INTEGRITY_FNAME)
            and not written_checksums.is_side_file(name)
        ):
            out.append(e.name)
    return sorted(out)


def _owner(name: str, world: int) -> int:
    m = _DATA_FILE.search(name)
    return int(m.group(1)) % world if m else 0


def read_manifest(checkpoint_dir: Union[str, os.PathLike]) -> Optional[dict]:
    """The directory's ``integrity.json`` or ``None`` when there is none.

    Raises:
        CheckpointIntegrityError: the manifest exists but is unreadable, not JSON, or of an
            algorithm or version this module does not know.
    """
    p = Path(checkpoint_dir) / INTEGRITY_FNAME
    try:
        text = p.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointIntegrityError(
            checkpoint_dir, [FileProblem(INTEGRITY_FNAME, f"unreadable ({e})")]
        ) from e
    try:
        man = json.loads(text)
        files = man["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointIntegrityError(
            checkpoint_dir, [FileProblem(INTEGRITY_FNAME, f"not a valid manifest ({e})")]
        ) from e
    algo = man.get("algorithm", UPSTREAM_ALGORITHM)
    if algo not in (ALGORITHM, UPSTREAM_ALGORITHM) or (
        algo == ALGORITHM and man.get("version") != VERSION
    ):
        raise CheckpointIntegrityError(
            checkpoint_dir,
            [
                FileProblem(
                    INTEGRITY_FNAME,
                    f"algorithm {algo!r} version {man.get('version')!r} is not known to this "
                    f"version of the fork (known: {ALGORITHM} v{VERSION}, {UPSTREAM_ALGORITHM})",
                )
            ],
        )
    return man


def _write_manifest(
    checkpoint_dir: Path, records: Dict[str, FileChecksum], block_bytes: int
) -> None:
    names = sorted(records)
    payload = {
        "algorithm": ALGORITHM,
        "version": VERSION,
        "block_bytes": block_bytes,
        "files": {n: records[n].checksum for n in names},
        "sizes": {n: records[n].size for n in names},
        "blocks": {n: list(records[n].blocks) for n in names},
    }
    tmp = checkpoint_dir / (INTEGRITY_FNAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint_dir / INTEGRITY_FNAME)


# ---------------------------------------------------------------------------------------------
# Checks of one file / of the .metadata storage ranges
# ---------------------------------------------------------------------------------------------


def _check_one(checkpoint_dir: Path, name: str, manifest: dict) -> List[FileProblem]:
    path = checkpoint_dir / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [FileProblem(name, "missing (listed in integrity.json)")]
    except OSError as e:
        return [FileProblem(name, f"unreadable ({e})")]
    algo = manifest.get("algorithm", UPSTREAM_ALGORITHM)
    try:
        if algo == UPSTREAM_ALGORITHM:
            got = sha256_file(path)
            want = manifest["files"][name]
            return (
                []
                if got == want
                else [
                    FileProblem(
                        name,
                        f"SHA-256 {got[:16]}... differs from integrity.json ({want[:16]}...)",
                        0,
                        max(size - 1, 0),
                    )
                ]
            )
        want_size = int(manifest["sizes"][name])
        block = int(manifest.get("block_bytes", BLOCK_BYTES))
        want_blocks = manifest["blocks"][name]
        if size < want_size:
            return [
                FileProblem(name, f"truncated: {size} of {want_size} bytes", size, want_size - 1)
            ]
        if size > want_size:
            return [
                FileProblem(name, f"has {size} bytes, {want_size} were saved", want_size, size - 1)
            ]
        got = hash_file(path, block)
    except OSError as e:
        return [FileProblem(name, f"unreadable ({e})")]
    except (KeyError, TypeError, ValueError) as e:
        return [FileProblem(INTEGRITY_FNAME, f"entry for {name} is incomplete ({e})")]
    out = []
    bad = [i for i, (a, b) in enumerate(zip(got.blocks, want_blocks)) if a != b]
    for first, last in _runs(bad):
        out.append(
            FileProblem(
                name,
                "bytes differ from what was saved (xxh3-64 block digest)",
                first * block,
                min((last + 1) * block, size) - 1,
            )
        )
    if not out and got.checksum != manifest["files"][name]:
        out.append(
            FileProblem(name, "file digest differs from integrity.json", 0, max(size - 1, 0))
        )
    return out


def _runs(indices: Sequence[int]) -> List[Tuple[int, int]]:
    """[1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    out: List[Tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def check_files(
    checkpoint_dir: Union[str, os.PathLike], manifest: dict, names: Optional[Sequence[str]] = None
) -> List[FileProblem]:
    """Check ``names`` (default: every file the manifest lists) against ``manifest``: presence,
    size, then the checksums (per block for ``xxh3-64-blocks``, per file for ``sha256``).

    Returns:
        The problems found, in file order (empty: all verified). Never raises for a bad file.
    """
    d = Path(checkpoint_dir)
    out: List[FileProblem] = []
    for n in sorted(manifest["files"] if names is None else names):
        out += _check_one(d, n, manifest)
    return out


def _storage_ranges(checkpoint_dir: Path) -> Dict[str, List[Tuple[int, int, str]]]:
    """``.metadata``: data file -> [(offset, length, key)] of every stored item.

    Raises:
        DcpMetadataError: ``.metadata`` is absent or cannot be read.
    """
    md = read_dcp_metadata(checkpoint_dir)
    out: Dict[str, List[Tuple[int, int, str]]] = {}
    for idx, info in (md.storage_data or {}).items():
        out.setdefault(info.relative_path, []).append((int(info.offset), int(info.length), idx.fqn))
    return out


def check_storage_ranges(
    checkpoint_dir: Union[str, os.PathLike], names: Optional[Sequence[str]] = None
) -> List[FileProblem]:
    """Without a manifest: every data file that ``.metadata`` refers to exists and is long enough
    for the items it places there (a stat per file; no data read).

    Args:
        names: only these data files (default: all that ``.metadata`` names).

    Returns:
        The problems found (``.metadata`` missing or unreadable is one).
    """
    d = Path(checkpoint_dir)
    try:
        ranges = _storage_ranges(d)
    except DcpMetadataError as e:
        if e.missing:
            return [FileProblem(".metadata", "missing (not a complete torch_dist checkpoint)")]
        cause = e.__cause__ if e.__cause__ is not None else e
        return [FileProblem(".metadata", f"unreadable ({type(cause).__name__}: {cause})")]
    out = []
    for rel in sorted(ranges if names is None else names):
        items = ranges.get(rel, [])
        need = max((o + n for o, n, _ in items), default=0)
        try:
            size = (d / rel).stat().st_size
        except FileNotFoundError:
            out.append(
                FileProblem(rel, "missing (named in .metadata)", holds=_keys(items, 0, need))
            )
            continue
        except OSError as e:
            out.append(FileProblem(rel, f"unreadable ({e})"))
            continue
        if size < need:
            out.append(
                FileProblem(
                    rel,
                    f"truncated: {size} bytes, .metadata places data up to byte {need - 1}",
                    size,
                    need - 1,
                    _keys(items, size, need),
                )
            )
    return out


def _keys(items: Sequence[Tuple[int, int, str]], start: int, end: int) -> Tuple[str, ...]:
    """Keys of the items overlapping bytes [start, end)."""
    return tuple(sorted({k for o, n, k in items if o < end and o + n > start}))


def _annotate(checkpoint_dir: Path, problems: Sequence[FileProblem]) -> List[FileProblem]:
    """Add the keys stored in each problem's byte range (best effort: ``.metadata`` may be the
    broken file)."""
    if not problems or all(p.holds or p.start is None for p in problems):
        return list(problems)
    try:
        ranges = _storage_ranges(checkpoint_dir)
    except Exception:  # noqa: BLE001
        return list(problems)
    out = []
    for p in problems:
        if p.holds or p.start is None or p.file not in ranges:
            out.append(p)
        else:
            out.append(
                FileProblem(
                    p.file, p.what, p.start, p.end, _keys(ranges[p.file], p.start, p.end + 1)
                )
            )
    return out


# ---------------------------------------------------------------------------------------------
# Collective save / verify
# ---------------------------------------------------------------------------------------------


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def _gather(obj, group=None) -> list:
    return collective.all_gather_object(obj, group)


def _rank_world(group=None) -> Tuple[int, int]:
    dist = _dist()
    if dist is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def save_manifest(
    checkpoint_dir: Union[str, os.PathLike], group=None, block_bytes: int = BLOCK_BYTES
) -> float:
    """Write ``integrity.json`` for the files of the save into ``checkpoint_dir``. Collective:
    call on every rank of ``group`` (default: the world) after all ranks finished writing.

    Rank ``r`` records ``__r_*.distcp`` (the files it wrote) as its writer hashed them on their
    way to disk (:mod:`megatron.integrity.checksum.written`), so a file that another save replaced
    since does not verify; files without such a record (written outside megatron-core's writer)
    are hashed from disk (still in the page cache). Rank 0 also covers every other file and any
    file a rank did not see, and writes the manifest atomically; a barrier follows.

    Returns:
        This rank's seconds spent.

    Raises:
        CheckpointIntegrityError: on every rank, when a file could not be read back.
    """
    t0 = time.perf_counter()
    d = Path(checkpoint_dir)
    rank, world = _rank_world(group)
    names = _manifest_names(d)
    mine = [n for n in names if _owner(n, world) == rank]
    written = written_checksums.take_written(d, mine)
    records: Dict[str, FileChecksum] = {}
    errors: List[FileProblem] = []
    for n in mine:
        if n in written and block_bytes == BLOCK_BYTES:  # the writer hashes BLOCK_BYTES blocks
            records[n] = written[n]
            continue
        try:
            records[n] = hash_file(d / n, block_bytes)
        except OSError as e:
            errors.append(FileProblem(n, f"cannot be read back after the save ({e})"))
    gathered = _gather((records, errors), group)
    all_records: Dict[str, FileChecksum] = {}
    all_errors: List[FileProblem] = []
    for rec, err in gathered:
        all_records.update(rec)
        all_errors += err
    if rank == 0 and not all_errors:
        for (
            n
        ) in names:  # files the owner rank did not see (attribute caching on shared file systems)
            if n not in all_records:
                try:
                    all_records[n] = hash_file(d / n, block_bytes)
                except OSError as e:
                    all_errors.append(FileProblem(n, f"cannot be read back after the save ({e})"))
        if not all_errors:
            _write_manifest(d, all_records, block_bytes)
    status = _gather(all_errors if rank == 0 else None, group)[0]
    if status:
        raise CheckpointIntegrityError(
            d, sorted(status, key=lambda p: p.file), "writing integrity.json"
        )
    return time.perf_counter() - t0


def _assign(sizes: Dict[str, int], world: int) -> List[List[str]]:
    """Greedy by size: biggest file first to the least loaded rank (ties: lowest rank)."""
    load = [0] * world
    out: List[List[str]] = [[] for _ in range(world)]
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        r = min(range(world), key=lambda x: (load[x], x))
        load[r] += size
        out[r].append(name)
    return out


def verify_checkpoint_dir(
    checkpoint_dir: Union[str, os.PathLike],
    require_manifest: bool = False,
    hash_bytes: bool = True,
    group=None,
    damaged_as_absent: bool = False,
) -> VerifySummary:
    """Verify a checkpoint directory. Collective when ``torch.distributed`` is initialised (call on
    every rank of ``group``): each rank checks a share of the files (balanced by size) and one
    ``all_gather_object`` gives every rank every finding.

    With ``integrity.json``: every listed file is present, of the saved size and (``hash_bytes``)
    of the saved checksums. Without it: every data file ``.metadata`` names exists and is long
    enough (no data read), and ``require_manifest`` makes the absence itself a problem. A manifest
    of this fork (``xxh3-64-blocks``) must list every file of the directory: one that leaves a file
    out (``"files": {}``, a hand edit, files of another save) fails. ``damaged_as_absent`` (the
    ``--no-verify-integrity`` load): an unreadable manifest counts as absent, with a note.

    Returns:
        What was checked.

    Raises:
        CheckpointIntegrityError: on every rank, listing every problem (file, what, byte range,
            the keys stored there).
    """
    t0 = time.perf_counter()
    d = Path(checkpoint_dir)
    rank, world = _rank_world(group)
    man, damaged = _agreed_manifest(d, require_manifest, damaged_as_absent, group)
    summary = VerifySummary(
        algorithm=None if man is None else man.get("algorithm", UPSTREAM_ALGORITHM)
    )
    hashed = 0
    if man is not None:
        problems, hashed = _manifest_problems(d, man, summary, hash_bytes, rank, world)
    else:
        problems = _no_manifest_problems(d, summary, require_manifest, damaged, rank, world)
    found = _gather((problems, hashed), group)
    merged = sorted({p for ps, _ in found for p in ps}, key=lambda p: (p.file, p.start or 0))
    summary.bytes = sum(h for _, h in found)
    summary.seconds = time.perf_counter() - t0
    if merged:
        raise CheckpointIntegrityError(
            d,
            _annotate(d, merged),
            f"integrity.json, {summary.algorithm}" if man is not None else "",
        )
    return summary


def _agreed_manifest(
    d: Path, require_manifest: bool, damaged_as_absent: bool, group
) -> Tuple[Optional[dict], Optional[str]]:
    """Read ``integrity.json`` and agree across ``group`` (one ``all_gather_object``; a second one
    when the ranks disagree) that every rank read it alike.

    Returns:
        ``(manifest or None, why it was unreadable or None)``: with ``damaged_as_absent`` (and not
        ``require_manifest``) an unreadable manifest is ``None`` and the second value says why.

    Raises:
        CheckpointIntegrityError: on every rank, when a rank cannot read the manifest or the ranks
            disagree on whether there is one.
    """
    damaged = None
    try:
        man = read_manifest(d)
        local: Tuple = ("ok", man is not None, [])
    except CheckpointIntegrityError as e:
        man, local = None, ("bad", True, list(e.problems))
        if damaged_as_absent and not require_manifest:
            damaged, local = "; ".join(str(p) for p in e.problems), ("ok", False, [])
    views = _gather(local[:2], group)
    if any(v[0] == "bad" for v in views) or len({v[1] for v in views}) > 1:
        bad = [r for r, v in enumerate(views) if v[0] == "bad" or v[1] != views[0][1]]
        problems = list(local[2]) or [
            FileProblem(INTEGRITY_FNAME, f"unreadable or absent on ranks {bad}")
        ]
        problems = _gather(problems, group)
        merged = sorted({p for ps in problems for p in ps}, key=lambda p: (p.file, p.start or 0))
        raise CheckpointIntegrityError(
            d, merged or [FileProblem(INTEGRITY_FNAME, f"differs between ranks {bad}")]
        )
    return man, damaged


def _manifest_problems(
    d: Path, man: dict, summary: VerifySummary, hash_bytes: bool, rank: int, world: int
) -> Tuple[List[FileProblem], int]:
    """This rank's problems of a directory with a manifest ``man``: rank 0 names files the
    manifest of this fork leaves out; each rank checks its share of the listed files (their bytes
    when ``hash_bytes``, else their sizes). Sets ``summary.files``.

    Returns:
        ``(problems, bytes hashed by this rank)``.
    """
    sizes = {n: int(man.get("sizes", {}).get(n, 1)) for n in man["files"]}
    summary.files = len(sizes)
    share = _assign(sizes, world)[rank]
    problems: List[FileProblem] = []
    if rank == 0 and summary.algorithm == ALGORITHM:
        problems += [
            FileProblem(
                n,
                f"not covered by {INTEGRITY_FNAME} (it lists {len(sizes)} files): a manifest "
                f"that leaves out a file of the checkpoint verifies nothing about it",
            )
            for n in _manifest_names(d)
            if n not in sizes
        ]
    if hash_bytes:
        return problems + check_files(d, man, share), sum(sizes[n] for n in share)
    return problems + _size_problems(d, man, share), 0


def _size_problems(d: Path, man: dict, share: Sequence[str]) -> List[FileProblem]:
    """Files of ``share`` that are missing or not of the size manifest ``man`` records (no data
    read; a manifest without ``"sizes"``: presence only)."""
    problems = []
    for n in share:
        p = d / n
        if not p.is_file():
            problems.append(FileProblem(n, "missing (listed in integrity.json)"))
        elif "sizes" in man and p.stat().st_size != int(man["sizes"][n]):
            s, w = p.stat().st_size, int(man["sizes"][n])
            problems.append(
                FileProblem(n, f"truncated: {s} of {w} bytes", s, w - 1)
                if s < w
                else FileProblem(n, f"has {s} bytes, {w} were saved", w, s - 1)
            )
    return problems


def _no_manifest_problems(
    d: Path,
    summary: VerifySummary,
    require_manifest: bool,
    damaged: Optional[str],
    rank: int,
    world: int,
) -> List[FileProblem]:
    """This rank's problems of a directory without a (readable) manifest: its absence when
    ``require_manifest``; on rank 0, data files that ``.metadata`` names and that are missing or
    too short. Adds the note saying what was not verified to ``summary`` (``damaged``: why the
    manifest was treated as absent)."""
    problems = []
    if require_manifest:
        problems.append(
            FileProblem(
                INTEGRITY_FNAME,
                "missing: the checkpoint was saved without "
                "checksums, and --verify-integrity requires them",
            )
        )
    if rank == 0 or world == 1:
        problems += check_storage_ranges(d)
    summary.notes.append(
        f"{INTEGRITY_FNAME} unreadable ({damaged}): treated as absent (--no-verify-integrity); "
        "sizes checked against .metadata, bytes not verified"
        if damaged
        else "no integrity.json: sizes checked against .metadata, bytes not verified"
    )
    return problems
