"""Fix: the checkpoint tracker is rewritten in place, so for a moment it names nothing.

megatron-core 0.19.2's ``save_checkpoint`` writes ``latest_checkpointed_iteration.txt`` (of
``--save`` and of the global non-persistent directory) with ``maybe_msc.open(tracker, 'w')``: the
file is truncated, then written. A reader in between (a watcher, a job starting on the same
directory, a crash right then) finds an empty tracker, which upstream's ``read_metadata`` answers
with exit code 0 and the non-persistent load cannot use: at no moment may a tracker name
nothing, or a checkpoint that is not complete.

The replacement is the ``maybe_msc`` that ``megatron.training.checkpointing`` uses, unchanged
except for its ``open`` of a tracker file for writing on a local file system: that writes a
temporary file beside it, ``fsync`` s it and renames it over the tracker on close, so a reader
sees the old iteration or the new one. Multi-storage-client paths are left to their client.
Detection of a fixed upstream is by behaviour: a tracker opened for writing through the module's
``maybe_msc`` must still hold its old content until the write is closed.
"""

from __future__ import annotations

import builtins
import os
import tempfile
from typing import Any

from megatron.overlay import Fix, Patch

_CKPT = "megatron.training.checkpointing"
TRACKER = "latest_checkpointed_iteration.txt"


class AtomicTrackerFile:
    """A text file written to ``<tracker>.tmp-<pid>`` and renamed over ``tracker`` at
    :meth:`close` (after ``fsync``); on an exception inside its ``with`` block the temporary file
    is removed and the tracker left as it was."""

    def __init__(self, path: str, mode: str, *args: Any, **kwargs: Any) -> None:
        self.path = path
        self.tmp = f"{path}.tmp-{os.getpid()}"
        self._f = builtins.open(self.tmp, mode, *args, **kwargs)

    def write(self, data):
        return self._f.write(data)

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)

    def __enter__(self) -> "AtomicTrackerFile":
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is None:
            self.close()
            return
        self._f.close()
        try:
            os.unlink(self.tmp)
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _is_local_tracker_write(opener: Any, file: Any, mode: str) -> bool:
    return (
        opener is builtins.open
        and isinstance(file, (str, os.PathLike))
        and os.path.basename(os.fspath(file)) == TRACKER
        and mode in ("w", "wt")
    )


class AtomicTrackerMsc:
    """``megatron.core.msc_utils.maybe_msc`` as ``checkpointing`` sees it, with tracker writes
    atomic (:class:`AtomicTrackerFile`); every other attribute is the original's."""

    def __init__(self, original: Any) -> None:
        self.__dict__["_original"] = original

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._original, name)
        if name != "open":
            return attr

        def open(file, mode="r", *args, **kwargs):
            """``maybe_msc.open``; a local tracker opened for writing is replaced atomically
            (megatron.fixes.atomic_tracker)."""
            if _is_local_tracker_write(attr, file, mode):
                return AtomicTrackerFile(os.fspath(file), mode, *args, **kwargs)
            return attr(file, mode, *args, **kwargs)

        return open

    def __dir__(self):
        return dir(self._original)


def wrap_maybe_msc(original: Any) -> Any:
    """Factory of the replacement of ``megatron.training.checkpointing.maybe_msc``."""
    if isinstance(original, AtomicTrackerMsc):
        return original
    return AtomicTrackerMsc(original)


def upstream_truncates_tracker(msc: Any | None = None) -> bool:
    """Whether a tracker opened for writing through ``checkpointing``'s ``maybe_msc`` (or
    ``msc``) loses its old content before the write is closed (the defect)."""
    if msc is None:
        from megatron.training import checkpointing as ckpt

        msc = ckpt.maybe_msc
        while isinstance(msc, AtomicTrackerMsc):
            msc = msc._original
    with tempfile.TemporaryDirectory(prefix="probe-tracker-") as d:
        path = os.path.join(d, TRACKER)
        with builtins.open(path, "w") as f:
            f.write("1")
        with msc.open(path, "w") as f:
            with builtins.open(path) as r:
                during = r.read()
            f.write("2")
        return during != "1"


class AtomicTrackerFix(Fix):
    name = "atomic_tracker"
    title = "latest_checkpointed_iteration.txt is replaced atomically: it never names nothing"
    upstream_refs = (
        "megatron-core megatron/training/checkpointing.py save_checkpoint writes the tracker "
        "in place (maybe_msc.open(tracker, 'w'))",
    )
    package = "megatron-core"

    patches = (
        Patch(
            f"{_CKPT}.maybe_msc",
            wrap_maybe_msc,
            "the tracker is truncated and rewritten in place: a reader (or a crash) in between "
            "finds it empty",
        ),
    )

    def upstream_behaves(self) -> bool:
        """A tracker written through upstream's ``maybe_msc`` (:func:`upstream_truncates_tracker`):
        behaves if it keeps its old content until the write is closed."""
        return not upstream_truncates_tracker()


FIX = AtomicTrackerFix()
