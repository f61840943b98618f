"""The start check of ``--save``: a run that did not load the checkpoints in ``--save`` never
overwrites them (upstream starts from scratch on a ``--load`` typo, then its saves overwrite the
run's ``iter_*``). Called at argument validation, on every rank; it reads only the file system.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

from megatron.training_ext.persistent_tier.common import ITER_DIR, NON_PERSISTENT, TRACKER

__all__ = ["OVERWRITE_FLAG", "check_save_dir", "saved_checkpoints"]

OVERWRITE_FLAG = "--overwrite-save"


def saved_checkpoints(directory: Optional[str]) -> List[str]:
    """What in ``directory`` a start from scratch would overwrite: the tracker file, ``iter_*``
    and ``release`` directories, and global non-persistent checkpoints (names, sorted)."""
    if not directory or not os.path.isdir(directory):
        return []
    out = []
    for e in os.scandir(directory):
        if e.name == TRACKER or (e.is_dir() and (ITER_DIR.match(e.name) or e.name == "release")):
            out.append(e.name)
        elif (
            e.is_dir()
            and e.name == NON_PERSISTENT
            and any(ITER_DIR.match(x) for x in os.listdir(e.path))
        ):
            out.append(e.name + "/")
    return sorted(out)


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _shown(names: List[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_save_dir(args: Any) -> None:
    """Refuse a start that would overwrite checkpoints in ``--save`` without having loaded them.

    Allowed: ``--save`` holds no checkpoint (a first start, also with a ``--load`` that does not
    exist yet: that is how auto-resume begins), or ``--load`` is the same directory as ``--save``
    (upstream then resumes from it), or ``--overwrite-save``.

    Refused (``--save`` holds checkpoints): no ``--load``, or a ``--load`` of another directory
    (a typo, an empty directory, another run's checkpoints, a ``--pretrained-checkpoint`` start).

    Raises:
        SystemExit: naming both directories, what ``--save`` holds, and the choices; raised on
            every rank before any process group or model exists (it only reads the file system).
    """
    save = getattr(args, "save", None)
    if not save or getattr(args, "overwrite_save", False):
        return
    held = saved_checkpoints(save)
    if not held:
        return
    load = getattr(args, "load", None)
    if load and _same_dir(load, save):
        return
    if load is None:
        why = "no --load was given, so this run starts from scratch"
    elif not os.path.exists(load):
        why = f"--load {load} does not exist (a typo?), so this run would start from scratch"
    elif not saved_checkpoints(load):
        why = f"--load {load} holds no checkpoint, so this run would start from scratch"
    else:
        why = f"this run would resume from --load {load}, another directory"
    raise SystemExit(
        f"pretrain_gpt.py: --save {save} already holds checkpoints ({_shown(held)}), but {why}; "
        f"its saves would overwrite them. To resume that run, pass --load {save}. To keep them, "
        f"choose another --save. To start over in {save} and overwrite them, add {OVERWRITE_FLAG}."
    )
