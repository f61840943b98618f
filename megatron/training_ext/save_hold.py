"""One job per ``--save``: a hold file (``JOB_HOLD.json``) in ``--save`` and in the local checkpoint
directory, written at start, refreshed while the job runs and removed at exit.

Upstream lets two jobs with the same ``--save`` (a SLURM requeue while the old job still runs, a
copy-pasted sbatch) train side by side and overwrite each other's checkpoints; a checkpoint can
end with files from both saves. Here the second job refuses at start, on every rank, naming the
holder. A hold whose holder is gone (same host, process not alive) or silent (no heartbeat for
``--save-hold-timeout`` seconds: another host) is taken over with one line. It relies on the
file system alone (atomic ``link``/``rename``, as on NFS and Lustre), not on local pids alone.
Rules and the override (``--take-save-hold``): ``docs/persistent-tier.md``.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from megatron.training_ext.console import write_line

__all__ = ["DEFAULT_TIMEOUT_S", "HOLD_NAME", "HEARTBEAT_S", "Hold", "acquire", "release_all"]

HOLD_NAME = "JOB_HOLD.json"
HEARTBEAT_S = 5.0  # seconds between refreshes of a held file
DEFAULT_TIMEOUT_S = 30.0  # --save-hold-timeout: no heartbeat for this long = the holder is gone
LOG_PREFIX = "[save-hold]"


def _proc_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (``/proc/<pid>/stat`` field 22), ``None`` if not alive
    (or not Linux): a pid reused by another process does not look alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def job_key(env: Optional[Dict[str, str]] = None) -> str:
    """What every rank of one launch (one rendezvous round) shares and another job does not: the
    rendezvous endpoint and run id, the restart round and the SLURM job and step."""
    env = os.environ if env is None else env
    parts = [
        env.get(k, "")
        for k in (
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT",
            "SLURM_JOB_ID",
            "SLURM_STEP_ID",
        )
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _describe(h: Dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("started", 0)))
    job = f", SLURM job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
    return f"host {h.get('host')}, pid {h.get('pid')}{job}, since {since}"


@dataclass
class Hold:
    """A hold this process took (the leader of its directory) or waits on."""

    flag: str
    directory: str
    key: str
    path: str

    def record(self) -> Dict[str, Any]:
        now = time.time()
        return {
            "key": self.key,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "proc_start": _proc_start(os.getpid()),
            "pid_namespace": _pid_namespace(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": now,
            "heartbeat": now,
        }


def _read(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            got = json.load(f)
        return got if isinstance(got, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written, or damaged: treated as a holder of unknown liveness


def _write_new(path: str, record: Dict[str, Any]) -> bool:
    """Create ``path`` with ``record`` atomically; False if it exists (another job won)."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    try:
        os.link(tmp, path)  # atomic, fails if path exists (also on NFS)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def _same_pids(h: Dict[str, Any]) -> bool:
    """Whether the holder's pid can be checked here: same host and pid namespace (another
    container on this node is judged by its heartbeat, as another host is)."""
    return (
        h.get("host") == socket.gethostname()
        and isinstance(h.get("pid"), int)
        and h.get("pid_namespace") == _pid_namespace()
    )


def _gone(h: Dict[str, Any], timeout: float, now: float) -> Optional[str]:
    """Why the holder ``h`` is gone, or ``None`` if it may be alive."""
    if _same_pids(h):
        start = _proc_start(h["pid"])
        if start is None or (h.get("proc_start") and start != h.get("proc_start")):
            return f"its process {h['pid']} on this host is gone"
        return None
    beat = h.get("heartbeat")
    if isinstance(beat, (int, float)) and now - beat > timeout:
        return f"no heartbeat for {now - beat:.0f} s"
    return None


def _refusal(hold: Hold, h: Dict[str, Any]) -> SystemExit:
    return SystemExit(
        f"pretrain_gpt.py: {hold.flag} {hold.directory} is held by another job ({_describe(h)}; "
        f"{hold.path}): two jobs saving into one directory overwrite each other's checkpoints. "
        f"Wait for that job to end, or give this one another {hold.flag}; if that job is gone "
        f"and its hold is not taken over by itself (it is when its process on that host is gone, "
        f"or after --save-hold-timeout seconds without heartbeat), pass --take-save-hold"
    )


def _lead(hold: Hold, timeout: float, take: bool) -> None:
    """The leader's loop: create the hold, or take over a gone holder's, or refuse."""
    deadline = None
    seen_beat = None
    while True:
        if _write_new(hold.path, hold.record()):
            return
        h = _read(hold.path)
        if h is None:
            continue  # released meanwhile
        if h.get("key") == hold.key:
            return  # this launch already holds it (the other directory's leader is this process)
        now = time.time()
        why = "--take-save-hold" if take else _gone(h, timeout, now)
        if why is None and _same_pids(h):
            raise _refusal(hold, h)
        if why is None:  # another host: alive while its heartbeat moves
            if deadline is None:
                deadline, seen_beat = now + timeout, h.get("heartbeat")
            elif h.get("heartbeat") != seen_beat:
                raise _refusal(hold, h)
            elif now > deadline:
                why = f"no heartbeat for {timeout:.0f} s"
        if why is None:
            time.sleep(min(1.0, timeout / 4))
            continue
        aside = f"{hold.path}.taken-{uuid.uuid4().hex}"
        try:
            os.rename(hold.path, aside)  # atomic: of two takers one wins
        except FileNotFoundError:
            continue
        os.unlink(aside)
        write_line(
            f"{LOG_PREFIX} {hold.flag} {hold.directory}: took over the hold of {_describe(h)} "
            f"({why})"
        )


def _follow(hold: Hold, timeout: float) -> None:
    """A non-leader rank: wait until this launch's leader holds it; refuse with the others."""
    deadline = time.time() + timeout + 10.0
    while True:
        h = _read(hold.path)
        if h and h.get("key") == hold.key:
            return
        if h and _same_pids(h) and _gone(h, timeout, time.time()) is None:
            raise _refusal(hold, h)  # a live holder on this host: the leader refuses too
        if time.time() > deadline:
            raise _refusal(hold, h or {"host": "?", "pid": "?"})
        time.sleep(0.1)


_HELD: List[Hold] = []
_STOP = threading.Event()


def _heartbeat(stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        for hold in list(_HELD):
            h = _read(hold.path)
            if not h or h.get("key") != hold.key:
                continue  # taken over (--take-save-hold): the other job says so
            h["heartbeat"] = time.time()
            tmp = f"{hold.path}.{uuid.uuid4().hex}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(h, f)
                os.replace(tmp, hold.path)
            except OSError:
                pass  # a full or stalled file system: the next beat tries again


def release_all() -> None:
    """Remove the holds this process took (at exit; idempotent)."""
    _STOP.set()
    while _HELD:
        hold = _HELD.pop()
        h = _read(hold.path)
        if h and h.get("key") == hold.key and h.get("pid") == os.getpid():
            try:
                os.unlink(hold.path)
            except OSError:
                pass


def acquire(args: Any) -> List[Hold]:
    """Hold ``--save`` (global rank 0 leads) and the local checkpoint directory
    (``--non-persistent-local-ckpt-dir`` with local checkpoints; local rank 0 of each node leads)
    for this launch; every other rank waits until its leader holds them. A second call in the
    same process (the next attempt of an in-process restart) keeps the holds it leads.

    Returns:
        The holds this process leads (refreshed every :data:`HEARTBEAT_S` seconds by a daemon
        thread, removed at exit).

    Raises:
        SystemExit: another live job holds a directory (naming its host, pid, SLURM job and
            start), on every rank; before any process group exists.
    """
    if getattr(args, "save_hold", True) is False:
        return []
    timeout = float(getattr(args, "save_hold_timeout", None) or DEFAULT_TIMEOUT_S)
    take = bool(getattr(args, "take_save_hold", False))
    key = job_key()
    wanted = []
    if getattr(args, "save", None):
        wanted.append(("--save", args.save, int(os.environ.get("RANK", 0)) == 0))
    local = getattr(args, "non_persistent_local_ckpt_dir", None)
    if local and getattr(args, "non_persistent_ckpt_type", None) == "local":
        wanted.append(
            ("--non-persistent-local-ckpt-dir", local, int(os.environ.get("LOCAL_RANK", 0)) == 0)
        )
    led, fresh = [], []
    held = {(h.path, h.key) for h in _HELD}  # a new attempt of in-process restart: still held
    for flag, directory, leader in wanted:
        hold = Hold(flag, directory, key, os.path.join(directory, HOLD_NAME))
        if leader and (hold.path, hold.key) in held:
            led.append(hold)
        elif leader:
            os.makedirs(directory, exist_ok=True)
            _lead(hold, timeout, take)
            led.append(hold)
            fresh.append(hold)
            _HELD.append(hold)
        else:
            _follow(hold, timeout)
    if fresh:
        global _STOP
        _STOP = threading.Event()
        atexit.register(release_all)
        threading.Thread(
            target=_heartbeat, args=(_STOP,), name="save-hold-heartbeat", daemon=True
        ).start()
    return led
