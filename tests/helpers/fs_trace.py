"""Test-only: record the file-system operations of one checkpoint save, or ``SIGKILL`` the whole
launch right before one of them (the crash-point harness, :mod:`tests.helpers.crash_points`).

Armed by ``MEGATRON_TEST_FS_TRACE`` (JSON, set by the harness; nothing is installed without it)::

    {"dir": TRACE_DIR, "roots": ["ckpt"], "window": "save:4" | "load",
     "exclude": ["JOB_HOLD"], "points": [[KEY, ACTION], ...]}

``roots`` are directories relative to the launch's working directory; only operations on paths
under them count (a 32-digit hex run in a name, a ``uuid4`` part, reads ``<uuid>``; the digits
of a ``.tmp-<pid>`` suffix read ``<pid>``). ``window``:
``save:K`` counts from the moment ``save_checkpoint`` of iteration
``K`` is entered in this rank to the end of the process (the harness makes ``K`` the run's last
save, so asynchronous finalisation and retention belong to it); ``load`` counts from the start to
the first training step (the local tier's resharded write at a start). Helper processes of a rank
(the async checkpoint worker, spawned; the writers it forks) install the hook from the same
variable and follow their rank's window through a marker file in ``TRACE_DIR``.

The operations: ``open`` (for writing: builtins/``io.open``, ``os.open``), ``write`` (the first
write to a file opened so), ``fsync``, ``rename`` (``os.rename``/``os.replace``, hence pathlib),
``unlink``, ``rmdir``, ``rmtree``, ``mkdir`` (``os.mkdir``/``os.makedirs``) and ``torch.save``
to a path (its C++ writer opens and writes the file itself). An operation's key is
``"rank/role/kind/path#n"``: ``role`` ``main`` (the rank) or ``helper``, ``path`` relative to the
working directory (``src->dst`` for a rename), ``n`` its occurrence in that process: stable across
launches of the same command, whatever the interleaving of ranks, threads and helpers.

Without ``points`` every operation is appended to ``TRACE_DIR/ops.<pid>.jsonl``. With them, an
operation whose key is listed triggers its action: ``kill`` (before it: ``SIGKILL`` to every
process of the launch, this one last), ``kill-after`` (after it) or ``hold`` (this process stops
before it until the launch is killed; after 30 s it kills the launch itself). The launch's
processes: every rank's session (each rank writes its pid to ``TRACE_DIR/ranks/`` at install; a
rank that does not lead its session, e.g. one started without a launcher, counts alone, so the
launcher's session is never killed) and the processes that carry the launch's tag
(``MEGATRON_TEST_LAUNCH_TAG``).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import signal
import threading
import time

ENV = "MEGATRON_TEST_FS_TRACE"
TAG_ENV = "MEGATRON_TEST_LAUNCH_TAG"
HOLD_TIMEOUT_S = 30.0
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

#: Random parts of file names (``uuid4().hex``), the same in every launch's keys.
_RANDOM = re.compile(r"[0-9a-f]{32}")
#: A writer's process id in a temporary name (``<tracker>.tmp-<pid>``, fix ``atomic_tracker``).
_PID = re.compile(r"\.tmp-[0-9]+")
_orig: dict = {}
_state: dict = {}
_local = threading.local()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Busy:
    """Re-entrancy guard: operations inside a recorded one (``makedirs`` -> ``mkdir``, a rename
    inside ``rmtree``) and the harness's own file work are not operations of the save."""

    def __enter__(self):
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc):
        _local.depth -= 1


def _busy() -> bool:
    return getattr(_local, "depth", 0) > 0


def _rel(path) -> str | None:
    """``path`` relative to the working directory if it is under a root and not excluded."""
    try:
        p = os.fspath(path)
    except TypeError:
        return None
    if isinstance(p, bytes):
        p = p.decode(errors="replace")
    full = os.path.normpath(os.path.join(_state["cwd"], p))
    rel = os.path.relpath(full, _state["cwd"])
    if not any(rel == r or rel.startswith(r + os.sep) for r in _state["roots"]):
        return None
    if any(x in rel for x in _state["exclude"]):
        return None
    return _PID.sub(".tmp-<pid>", _RANDOM.sub("<uuid>", rel))


def _is_main() -> bool:
    return os.getpid() == _state["main_pid"]


def _in_window() -> bool:
    if _is_main():
        return _state["open"]
    return _orig["exists"](_state["marker"])


def _op(kind: str, rel: str) -> None:
    """Count operation ``kind`` on ``rel`` (already filtered) in this process; record it or act."""
    if not _in_window():
        return
    counts = _state["counts"]
    n = counts[(kind, rel)] = counts.get((kind, rel), 0) + 1
    role = "main" if _is_main() else "helper"
    key = f"{_rank()}/{role}/{kind}/{rel}#{n}"
    _state["seq"] += 1
    if _state["points"] is None:
        line = json.dumps(
            {
                "key": key,
                "rank": _rank(),
                "role": role,
                "kind": kind,
                "path": rel,
                "n": n,
                "seq": _state["seq"],
                "pid": os.getpid(),
                "t": time.time(),
            }
        )
        with _Busy():
            fd = _orig["os.open"](_state["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                _orig["os.write"](fd, (line + "\n").encode())
            finally:
                _orig["os.close"](fd)
        return
    action = _state["points"].get(key)
    if action == "kill":
        kill_launch(f"before {key}")
    elif action == "hold":
        _say(f"holding before {key}")
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
        kill_launch(f"hold at {key} timed out after {HOLD_TIMEOUT_S:.0f} s")
    elif action == "kill-after":
        _state["after"] = key


def _after() -> None:
    key = _state.pop("after", None)
    if key is not None:
        kill_launch(f"after {key}")


def _say(message: str) -> None:
    with _Busy():
        text = f"[fs-trace] rank {_rank()} pid {os.getpid()}: {message}\n"
        try:
            _orig["os.write"](2, text.encode())
        except OSError:
            pass


def _launch_pids() -> list[int]:
    """Pids of the launch's processes other than this one (see the module docstring)."""
    sessions, ranks = set(), set()
    rank_dir = os.path.join(_state["dir"], "ranks")
    for name in os.listdir(rank_dir):
        try:
            with builtins_open(os.path.join(rank_dir, name)) as f:
                what, pid = f.read().split()
            (sessions if what == "sid" else ranks).add(int(pid))
        except (OSError, ValueError):
            pass
    tag = os.environ.get(TAG_ENV)
    needle = f"\0{TAG_ENV}={tag}\0".encode() if tag else None
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            with builtins_open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            sid = int(stat.rsplit(")", 1)[1].split()[3])  # state ppid pgrp session ...
            if sid in sessions or pid in ranks:
                out.append(pid)
                continue
            if needle is not None:
                with builtins_open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in b"\0" + f.read() + b"\0":
                        out.append(pid)
        except (OSError, ValueError, IndexError):
            pass
    return out


def builtins_open(*a, **kw):
    """The unhooked ``open``."""
    return _orig.get("open", builtins.open)(*a, **kw)


def kill_launch(why: str) -> None:
    """``SIGKILL`` every other process of the launch (twice over, for children forked
    meanwhile), then this one. Never returns."""
    with _Busy():
        _say(f"SIGKILL to the launch ({why})")
        for _ in range(2):
            for pid in _launch_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        os.kill(os.getpid(), signal.SIGKILL)
        while True:  # pragma: no cover
            signal.pause()


class _TracedFile:
    """A file opened for writing under a root: its first write, ``fsync`` through ``fileno``."""

    def __init__(self, f, rel: str):
        object.__setattr__(self, "_f", f)
        object.__setattr__(self, "_rel", rel)
        object.__setattr__(self, "_written", False)
        try:
            _state["fds"][f.fileno()] = rel
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass

    def write(self, data):
        if not self._written and not _busy():
            object.__setattr__(self, "_written", True)
            _op("write", self._rel)
            r = self._f.write(data)
            _after()
            return r
        return self._f.write(data)

    def close(self):
        try:
            _state["fds"].pop(self._f.fileno(), None)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass
        return self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __setattr__(self, name, value):
        setattr(self._f, name, value)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            _state["fds"].pop(self._f.fileno(), None)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)


def _writing(mode) -> bool:
    return isinstance(mode, str) and any(c in mode for c in "wax+")


def _wrap_open(orig):
    def traced_open(file, mode="r", *a, **kw):
        rel = None if _busy() or isinstance(file, int) or not _writing(mode) else _rel(file)
        if rel is None:
            return orig(file, mode, *a, **kw)
        _op("open", rel)
        f = orig(file, mode, *a, **kw)
        _after()
        return _TracedFile(f, rel)

    return traced_open


def _os_open(path, flags, *a, **kw):
    rel = None if _busy() or not flags & _WRITE_FLAGS else _rel(path)
    if rel is None:
        return _orig["os.open"](path, flags, *a, **kw)
    _op("open", rel)
    fd = _orig["os.open"](path, flags, *a, **kw)
    _after()
    _state["fds"][fd] = rel
    _state["fd_written"].discard(fd)
    return fd


def _os_write(fd, data):
    rel = _state["fds"].get(fd)
    if rel is None or _busy() or fd in _state["fd_written"]:
        return _orig["os.write"](fd, data)
    _state["fd_written"].add(fd)
    _op("write", rel)
    r = _orig["os.write"](fd, data)
    _after()
    return r


def _os_close(fd):
    _state["fds"].pop(fd, None)
    _state["fd_written"].discard(fd)
    return _orig["os.close"](fd)


def _os_fsync(fd):
    num = fd if isinstance(fd, int) else fd.fileno()
    rel = _state["fds"].get(num)
    if rel is None or _busy():
        return _orig["os.fsync"](fd)
    _op("fsync", rel)
    r = _orig["os.fsync"](fd)
    _after()
    return r


def _path_op(kind: str, name: str):
    orig = _orig[name]

    def traced(path, *a, **kw):
        rel = None if _busy() else _rel(path)
        if rel is None:
            return orig(path, *a, **kw)
        _op(kind, rel)
        with _Busy():
            r = orig(path, *a, **kw)
        _after()
        return r

    return traced


def _rename_op(name: str):
    orig = _orig[name]

    def traced(src, dst, *a, **kw):
        rel_s = None if _busy() else _rel(src)
        rel_d = None if _busy() else _rel(dst)
        if rel_s is None and rel_d is None:
            return orig(src, dst, *a, **kw)
        _op("rename", f"{rel_s or os.fspath(src)}->{rel_d or os.fspath(dst)}")
        with _Busy():
            r = orig(src, dst, *a, **kw)
        _after()
        return r

    return traced


def _torch_save(obj, f, *a, **kw):
    rel = None
    if not _busy() and isinstance(f, (str, os.PathLike)):
        rel = _rel(f)
    if rel is None:
        return _orig["torch.save"](obj, f, *a, **kw)
    _op("torch.save", rel)
    with _Busy():
        r = _orig["torch.save"](obj, f, *a, **kw)
    _after()
    return r


def open_window() -> None:
    """This rank's window opens now (its helpers follow through the marker file)."""
    if not _state or not _is_main() or _state["open"]:
        return
    _state["open"] = True
    with _Busy():
        with builtins_open(_state["marker"], "w") as f:
            f.write("open\n")


def close_window() -> None:
    """This rank's window closes now (the ``load`` window at the first training step)."""
    if not _state or not _is_main() or not _state["open"]:
        return
    _state["open"] = False
    with _Busy():
        try:
            os.unlink(_state["marker"])
        except FileNotFoundError:
            pass


def config() -> dict | None:
    """The parsed ``MEGATRON_TEST_FS_TRACE``, or ``None``."""
    raw = os.environ.get(ENV)
    return json.loads(raw) if raw else None


def install(main: bool) -> dict | None:
    """Install the hooks in this process if ``MEGATRON_TEST_FS_TRACE`` is set (``main``: a rank,
    else one of its helpers); idempotent. Returns the configuration."""
    cfg = config()
    if cfg is None or _state:
        return cfg
    import torch

    d = cfg["dir"]
    rank = _rank()
    os.makedirs(os.path.join(d, "ranks"), exist_ok=True)
    _state.update(
        dir=d,
        cwd=os.getcwd(),
        roots=[os.path.normpath(r) for r in cfg["roots"]],
        exclude=list(cfg.get("exclude", ())),
        main_pid=os.getpid() if main else None,
        open=main and cfg["window"] == "load",
        marker=os.path.join(d, f"window.rank{rank}"),
        log=os.path.join(d, f"ops.{os.getpid()}.jsonl"),
        points=dict(map(tuple, cfg["points"])) if cfg.get("points") else None,
        counts={},
        seq=0,
        fds={},
        fd_written=set(),
    )
    if main:
        # the rank's session when it leads one (torchrun's workers and the forked launcher's
        # ranks do), else only the rank itself: never a session it shares with its launcher
        me = os.getpid()
        with open(os.path.join(d, "ranks", str(rank)), "w") as f:
            f.write(f"{'sid' if os.getsid(0) == me else 'pid'} {me}")
        if _state["open"]:
            with open(_state["marker"], "w") as f:
                f.write("open\n")
    _orig.update(
        {
            "open": builtins.open,
            "io.open": io.open,
            "os.open": os.open,
            "os.write": os.write,
            "os.close": os.close,
            "os.fsync": os.fsync,
            "exists": os.path.exists,
            "torch.save": torch.save,
        }
    )
    for name in ("rename", "replace", "unlink", "remove", "rmdir", "mkdir", "makedirs"):
        _orig[name] = getattr(os, name)
    _orig["rmtree"] = shutil.rmtree
    builtins.open = _wrap_open(_orig["open"])
    io.open = _wrap_open(_orig["io.open"])
    os.open, os.write, os.close, os.fsync = _os_open, _os_write, _os_close, _os_fsync
    os.rename, os.replace = _rename_op("rename"), _rename_op("replace")
    for name, kind in (("unlink", "unlink"), ("remove", "unlink"), ("rmdir", "rmdir")):
        setattr(os, name, _path_op(kind, name))
    os.mkdir, os.makedirs = _path_op("mkdir", "mkdir"), _path_op("mkdir", "makedirs")
    shutil.rmtree = _path_op("rmtree", "rmtree")
    torch.save = _torch_save
    import torch.serialization

    torch.serialization.save = _torch_save
    return cfg
