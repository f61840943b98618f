"""The bad-tier marker: written by a rank whose run turned non-finite inside the NaN window after a
local resume, read by every rank at the next start (the tier is then skipped), removed by the next
local save complete on all ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Optional

from megatron.training_ext.console import process_rank, rank_line
from megatron.training_ext.local_tier.common import (
    LOCAL_TIER_BAD_EXIT_CODE,
    LOG_PREFIX,
    MARKER_FORMAT,
    MARKER_NAME,
    QUARANTINE_DIR,
    shorten,
)
from megatron.training_ext.local_tier.component import COMPONENT


def _local_dir(manager: Any) -> Path:
    return Path(manager.local_ckpt_dir)


def read_marker(local_dir: os.PathLike | str) -> Optional[dict]:
    """The marker in one rank's local checkpoint directory, or ``None``.

    An unreadable marker is returned as ``{"reason": "unreadable marker ..."}`` (it still marks
    the tier bad).
    """
    path = Path(local_dir) / MARKER_NAME
    if not path.exists():
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as e:
        return {"reason": f"unreadable marker {path}: {e}"}


def write_marker(manager: Any, iteration: int, reason: str) -> Path:
    st = COMPONENT.state
    local_dir = _local_dir(manager)
    local_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "format": MARKER_FORMAT,
        "version": 1,
        "iteration": int(iteration),
        "local_checkpoint_iteration": st.local_load_iteration,
        "reason": reason,
        "rank": process_rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "exit_code": LOCAL_TIER_BAD_EXIT_CODE,
    }
    path = local_dir / MARKER_NAME
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    st.marker_written = True
    return path


def clear_marker(manager: Any, iteration: int) -> None:
    st = COMPONENT.state
    if st is None or st.marker_written:
        return
    local_dir = _local_dir(manager)
    marker = local_dir / MARKER_NAME
    rejected = local_dir / QUARANTINE_DIR
    removed = []
    if marker.exists():
        try:
            marker.unlink()
            removed.append(f"the bad-tier marker {marker}")
        except FileNotFoundError:
            pass
    if rejected.is_dir():
        shutil.rmtree(rejected, ignore_errors=True)
        removed.append(f"the rejected local checkpoints in {rejected}")
    if removed:
        rank_line(
            LOG_PREFIX,
            f"local checkpoint at iteration {iteration} is complete on all ranks: removed "
            f"{' and '.join(removed)}",
        )


def describe_marker(rank: int, m: dict) -> str:
    if "iteration" in m:
        return (
            f"rank {rank} marked the local tier bad at iteration {m.get('iteration')} "
            f"(resumed from local iteration {m.get('local_checkpoint_iteration')}, "
            f"{m.get('time', '?')}): {shorten(m.get('reason', '?'), 200)}"
        )
    return f"rank {rank}: {m.get('reason')}"
