"""The verifier's entry point, :func:`verify_checkpoint`: input checks agreed by every rank,
files divided among the ranks, each rank's checks, findings gathered and merged into one report
(the same on every rank, and the same a single process would produce)."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.integrity.persistent import CheckpointInputError, PersistentCheckpoint
from megatron.integrity.readahead import ReadAhead
from megatron.overlay import collective
from megatron.verify.discovery import (
    IterationMismatchError,
    LocalFile,
    Plan,
    choose_iteration,
    discover_local,
    require_local_files,
    where,
)
from megatron.verify.findings import Findings
from megatron.verify.local_file import (
    OpenedLocal,
    check_opened,
    open_local,
    plan_readahead,
)
from megatron.verify.merge import merge
from megatron.verify.options import VerifyOptions
from megatron.verify.persistent_checks import (
    check_manifest_files,
    check_persistent_file,
    file_size,
    manifest_names,
    read_manifest,
)
from megatron.verify.report import Problem, VerifyReport
from megatron.verify.schedule import assign, local_units

__all__ = ["verify_checkpoint"]

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class _Ranks:
    """The process group the verification is divided over (``group=None``: this process)."""

    group: Any
    rank: int
    world: int

    @classmethod
    def of(cls, group: Any) -> "_Ranks":
        if group is None:
            return cls(None, 0, 1)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj`` (no collective for a single process)."""
        return [obj] if self.world == 1 else collective.all_gather_object(obj, self.group)

    def agree(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on every rank; if it raised CheckpointInputError anywhere, raise it
        everywhere (so no rank waits in a collective for a rank that gave up): the first failing
        rank's error, its type kept (:class:`IterationMismatchError` or
        :class:`CheckpointInputError`), ``failures`` naming every failing rank."""
        out, mine = None, []
        try:
            out = fn()
        except CheckpointInputError as e:
            mine = [f"{type(e).__name__}: {e}"]
        if self.world == 1:
            tagged = {self.rank: mine} if mine else {}
        else:
            tagged = collective.agree_on_failures(mine, self.group)
        if not tagged:
            return out
        failures = {r: [m.partition(": ")[2] for m in msgs] for r, msgs in tagged.items()}
        first = min(tagged)
        kind = tagged[first][0].partition(": ")[0]
        mismatch = kind == IterationMismatchError.__name__
        cls = IterationMismatchError if mismatch else CheckpointInputError
        text = failures[first][0]
        raise cls(text if self.world == 1 else f"rank {first}: {text}", failures)


def _open_inputs(
    local_dir: Optional[PathLike],
    persistent_dir: Optional[PathLike],
    iteration: Optional[int],
    opts: VerifyOptions,
    ranks: _Ranks,
) -> Plan:
    """Discover the local files and open the persistent checkpoint, every rank agreeing."""
    layout = ranks.agree(lambda: discover_local(local_dir) if local_dir is not None else None)
    if layout is not None and ranks.world > 1:
        # in a distributed run, iterations and leftovers are the union over ranks
        layout.merge_seen(ranks.gather(layout.seen()))

    def open_persistent():
        if layout is not None:
            require_local_files(layout)
        it, p_dir = choose_iteration(layout, persistent_dir, iteration)
        pc = PersistentCheckpoint(p_dir, it) if p_dir is not None else None
        man = read_manifest(pc) if (pc is not None and opts.verify_manifest) else None
        return it, pc, man

    chosen, pc, manifest = ranks.agree(open_persistent)
    if pc is not None and chosen is None:
        chosen = pc.iteration
    plan = Plan(layout, pc, manifest, chosen)
    # local alone without an iteration: every local iteration (to find the newest complete one)
    all_iterations = layout is not None and iteration is None and persistent_dir is None
    if layout is not None:
        plan.checked = layout.iterations if all_iterations else [chosen]
    return plan


def _divide(plan: Plan, ranks: _Ranks) -> None:
    """This rank's share: local files (those of one owner together where possible), persistent
    data files (persistent alone), manifest files."""
    layout, pc, rank, world = plan.layout, plan.pc, ranks.rank, ranks.world
    if layout is not None:
        mine = {f.rel: f for it in plan.checked for f in layout.files.get(it, [])}
        visible: List[List[LocalFile]] = ranks.gather(list(mine.values()))
        plan.copies = sorted({f.rel: f for fs in visible for f in fs}.values(), key=lambda f: f.rel)
        units = [[(f.rel, (f.iteration, f.owner_rank), f.size) for f in fs] for fs in visible]
        assigned = local_units(units, world)[rank]
        plan.my_local = sorted(
            (mine[r] for r in assigned),
            key=lambda f: (f.iteration, f.owner_rank, f.role != "primary", f.rel),
        )
    if pc is not None and layout is None:
        units = [(n, max(s, 0), set(range(world))) for n, s in pc.data_files.items()]
        plan.my_data_files = sorted(assign(units, world)[rank])
    names = manifest_names(plan.manifest) if plan.manifest else []
    if names:
        units = [(n, file_size(pc.path / n), set(range(world))) for n in names]
        plan.my_manifest = sorted(assign(units, world)[rank])


def _progress_bar(plan: Plan, opts: VerifyOptions, ranks: _Ranks):
    if not (opts.progress and ranks.rank == 0):
        return None
    from tqdm import tqdm

    pc = plan.pc
    total = (
        sum(f.size for f in plan.my_local)
        + sum(max(pc.data_files[n], 0) for n in plan.my_data_files)
        + sum(file_size(pc.path / n) for n in plan.my_manifest)
    )
    desc = "verify" if ranks.world == 1 else f"verify (rank 0 of {ranks.world})"
    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True, desc=desc
    )


def _verifier_error(part: Findings, lf: LocalFile) -> None:
    part.problems.append(
        Problem(
            "verifier_error",
            f"{where(lf)}: {traceback.format_exc()}",
            file=lf.rel,
            holder_rank=lf.holder_rank,
            owner_rank=lf.owner_rank,
            role=lf.role,
            iteration=lf.iteration,
        )
    )


def _check_mine(plan: Plan, opts: VerifyOptions, ranks: _Ranks) -> Findings:
    """Every check of this rank's share; a check that fails unexpectedly is a
    ``verifier_error`` problem (never leaves the other ranks waiting)."""
    part, pc, my_local = Findings(), plan.pc, plan.my_local
    bar = _progress_bar(plan, opts, ranks)
    step = bar.update if bar is not None else None
    ra = ReadAhead(opts.readahead)
    try:
        if plan.my_manifest:
            check_manifest_files(pc, plan.my_manifest, plan.manifest, part)
            if step:
                step(sum(file_size(pc.path / n) for n in plan.my_manifest))

        # one file of look-ahead: file k+1 is opened and its ranges queued before file k is checked
        def open_and_plan(k: int) -> Optional[OpenedLocal]:
            try:
                op = open_local(my_local[k], opts, part)
                plan_readahead(op, pc, ra, opts.mmap)
                return op
            except Exception:  # noqa: BLE001
                _verifier_error(part, my_local[k])
                return None

        nxt = open_and_plan(0) if my_local else None
        for k, lf in enumerate(my_local):
            cur = nxt
            nxt = open_and_plan(k + 1) if k + 1 < len(my_local) else None
            if cur is None:
                continue
            try:
                check_opened(cur, pc, opts, part, ra, step)
            except Exception:  # noqa: BLE001
                _verifier_error(part, lf)
        for name in plan.my_data_files:
            try:
                check_persistent_file(pc, name, opts, part, step, ra)
            except Exception:  # noqa: BLE001
                part.problems.append(
                    Problem(
                        "verifier_error",
                        f"persistent {name}: {traceback.format_exc()}",
                        file=name,
                        role="persistent",
                    )
                )
    finally:
        ra.close()
        if bar is not None:
            bar.close()
    return part


def verify_checkpoint(
    local_dir: Optional[PathLike] = None,
    persistent_dir: Optional[PathLike] = None,
    *,
    iteration: Optional[int] = None,
    options: Optional[VerifyOptions] = None,
    group: Optional[Any] = None,
) -> VerifyReport:
    """Verify a local checkpoint against a persistent one, or either alone (``docs/verify.md``).

    Args:
        local_dir: ``--non-persistent-local-ckpt-dir`` of the run (all ranks' ``<rank>/``
            directories; in distributed mode each rank may see only some of them).
        persistent_dir: a ``torch_dist`` iteration directory (``.../iter_0000010``) or the
            ``--save`` root (the iteration is then the local one, or ``iteration``, or the latest).
        iteration: the iteration to verify (default: the persistent directory's; with a local
            directory alone, every local iteration, to find the newest complete and consistent one).
        options: how to check (:class:`VerifyOptions`; default ``VerifyOptions()``).
        group: a ``torch.distributed`` process group (e.g. ``torch.distributed.group.WORLD``) to
            divide the files among its ranks; ``None``: this process does everything. Every rank
            of the group must call this function with the same arguments.

    Returns:
        The :class:`~megatron.verify.report.VerifyReport` (identical on every rank). With local
        files it has ``local_iterations`` and ``newest_complete_iteration``.

    Raises:
        CheckpointInputError: neither directory given, a directory missing, no local files at
            all, not a torch_dist checkpoint, unreadable ``.metadata`` (on every rank of
            ``group``).
        IterationMismatchError: the local checkpoint has no files of the persistent checkpoint's
            iteration.
    """
    opts = options if options is not None else VerifyOptions()
    saved_threads = torch.get_num_threads()
    if opts.torch_threads is not None:
        torch.set_num_threads(int(opts.torch_threads))
    try:
        return _verify(local_dir, persistent_dir, iteration, opts, group)
    finally:
        torch.set_num_threads(saved_threads)


def _verify(
    local_dir: Optional[PathLike],
    persistent_dir: Optional[PathLike],
    iteration: Optional[int],
    opts: VerifyOptions,
    group: Any,
) -> VerifyReport:
    t0 = time.perf_counter()
    if local_dir is None and persistent_dir is None:
        raise CheckpointInputError(
            "nothing to verify: give a local checkpoint directory, a persistent one, or both"
        )
    ranks = _Ranks.of(group)
    opts = opts.resolved(with_local=local_dir is not None)
    plan = _open_inputs(local_dir, persistent_dir, iteration, opts, ranks)
    _divide(plan, ranks)
    parts: List[Findings] = ranks.gather(_check_mine(plan, opts, ranks))
    report = merge(parts, plan, opts.verify_manifest)
    wall = time.perf_counter() - t0
    bytes_read = sum(p.bytes_read for p in parts)
    data_bytes = sum(f.file_bytes for f in report.files)
    report.timing = {
        "wall_s": wall,
        "workers": ranks.world,
        "bytes_read": bytes_read,
        "file_bytes": data_bytes,
        "gb_per_s": data_bytes / wall / 1e9 if wall > 0 else 0.0,
    }
    return report
