"""Fix: retention of global non-persistent checkpoints deletes the one the tracker names.

megatron-core 0.19.2's ``megatron.training.checkpointing.cleanup_old_non_persistent_checkpoint``
runs at the start of every global non-persistent save and keeps only the newest ``iter_*`` by name,
complete or not. With ``--async-save`` the newest is often the previous save, still being written,
while the tracker still names the one before it: that one, the only complete checkpoint, is
deleted, and until the save in flight is finalised the tracker names a deleted directory (5
windows in 12 iterations with ``--non-persistent-save-interval 1``; a crash in one leaves nothing
to resume). Megatron-Bridge PRs 4678 and 5184 fixed the same ordering in Bridge.

The replacement deletes only what is older than the iteration the tracker names, and only when
that iteration's directory is complete (``.metadata``): an old checkpoint goes after the newer one
is complete and the tracker has moved to it; a save in flight, and anything newer than the
tracker, is never touched; a missing or damaged tracker deletes nothing. ``leave_ckpt_num - 1``
older complete checkpoints are kept besides the tracker's. Rank 0 only, in the background with
``--async-save`` (as upstream). Detection of a fixed upstream is by behaviour: upstream's own
function on a directory whose tracker names a complete ``iter_0000001`` beside an incomplete
``iter_0000002`` must keep ``iter_0000001``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tempfile
import threading
import warnings
from typing import Callable, List

from megatron.fixes.standins import upstream_own
from megatron.overlay import Fix, Patch, value

_CKPT = "megatron.training.checkpointing"
TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"iter_(\d+)$")


def _iterations(save_dir: str) -> dict[int, str]:
    out = {}
    try:
        names = os.listdir(save_dir)
    except OSError:
        return out
    for name in names:
        m = _ITER.match(name)
        path = os.path.join(save_dir, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            out[int(m.group(1))] = path
    return out


def _tracked(save_dir: str) -> int | None:
    """The iteration the tracker of ``save_dir`` names, when it is a number; else ``None``."""
    try:
        with open(os.path.join(save_dir, TRACKER)) as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def retired_checkpoints(save_dir: str, leave_ckpt_num: int = 1) -> List[str]:
    """The ``iter_*`` directories of ``save_dir`` that retention may delete now: those older than
    the iteration the tracker names, when that iteration's directory is complete (``.metadata``),
    except the newest ``leave_ckpt_num - 1`` complete ones among them. Empty when the tracker is
    missing or damaged or names an incomplete or missing directory. Paths, oldest first."""
    tracked = _tracked(save_dir)
    dirs = _iterations(save_dir)
    if tracked is None or tracked not in dirs:
        return []
    if not os.path.isfile(os.path.join(dirs[tracked], ".metadata")):
        return []
    older = sorted(it for it in dirs if it < tracked)
    complete_older = [it for it in older if os.path.isfile(os.path.join(dirs[it], ".metadata"))]
    extra = max(int(leave_ckpt_num), 1) - 1
    keep = set(complete_older[len(complete_older) - extra :]) if extra else set()
    return [dirs[it] for it in older if it not in keep]


def cleanup_old_non_persistent_checkpoint(save_dir, leave_ckpt_num=1, do_async=False):
    """Retention of global non-persistent checkpoints in ``save_dir`` (megatron.fixes.
    nonpersistent_retention): rank 0 deletes :func:`retired_checkpoints` (in a thread with
    ``do_async``, as upstream); never the checkpoint the tracker names, a save in flight or
    anything newer than the tracker."""
    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    retired = retired_checkpoints(os.fspath(save_dir), leave_ckpt_num)
    if not retired:
        return

    def remove(paths):
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    if do_async:
        threading.Thread(target=remove, args=(retired,), name="nonpersistent-retention").start()
    else:
        remove(retired)


def upstream_deletes_tracked(fn: Callable | None = None) -> bool:
    """Whether upstream's ``cleanup_old_non_persistent_checkpoint`` (or ``fn``) deletes the
    complete checkpoint the tracker names when a newer, incomplete one exists (a save in
    flight): the defect. Its output is swallowed."""
    from megatron.training import checkpointing as ckpt

    fn = fn or upstream_own(ckpt.cleanup_old_non_persistent_checkpoint)
    with tempfile.TemporaryDirectory(prefix="probe-np-retention-") as d:
        done = os.path.join(d, "iter_0000001")
        os.makedirs(done)
        open(os.path.join(done, ".metadata"), "wb").close()
        os.makedirs(os.path.join(d, "iter_0000002"))
        with open(os.path.join(d, TRACKER), "w") as f:
            f.write("1")
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # upstream's rank lookup warns without a group
            fn(d, leave_ckpt_num=1, do_async=False)
        return not os.path.isdir(done)


class NonPersistentRetentionFix(Fix):
    name = "nonpersistent_retention"
    title = (
        "global non-persistent retention deletes a checkpoint only after a newer one is "
        "complete and the tracker names it"
    )
    upstream_refs = (
        "Megatron-Bridge PRs 4678 and 5184 (non-persistent retention deletes the checkpoint the "
        "tracker names while the next save is in flight)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            f"{_CKPT}.cleanup_old_non_persistent_checkpoint",
            value(cleanup_old_non_persistent_checkpoint),
            "keeps only the newest iter_* by name, complete or not: with --async-save the "
            "complete checkpoint the tracker names is deleted while the next save is in flight",
            params=("save_dir", "leave_ckpt_num", "do_async"),
        ),
    )

    def upstream_behaves(self) -> bool:
        """Upstream's own function on a stand-in directory (:func:`upstream_deletes_tracked`):
        behaves if the tracked, complete checkpoint survives."""
        return not upstream_deletes_tracked()


FIX = NonPersistentRetentionFix()
