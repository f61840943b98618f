"""Read-ahead for the checkpoint verifier: a background thread that reads the file ranges the
checks will need next, in order, so that the disk streams (like ``cat``) while the main thread
checks data that is already in the page cache.

The verifier memory-maps every file it checks; a check that touches an uncached page waits for a
small synchronous read. Instead, the main thread queues ``(path, offset, length)`` ranges in the
order it will use them (:meth:`ReadAhead.add` returns a ticket) and, before checking a range,
waits for its ticket (:meth:`ReadAhead.wait`). The thread reads each range with large ``preadv``
calls into one reusable buffer and discards the data (it stays in the page cache). Blocks already
cached are skipped: a one-byte ``preadv(..., RWF_NOWAIT)`` probe at both ends of a block fails
with ``EAGAIN`` unless those pages are cached, so with a warm cache nothing is copied. Reads
release the GIL.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Dict, Optional, Union

__all__ = ["ReadAhead"]


class ReadAhead:
    """Ordered read-ahead of file ranges in one background thread.

    Args:
        enabled: when False (or without ``os.preadv``), :meth:`add` does nothing and :meth:`wait`
            returns at once.
        block_bytes: size of one read (bytes).
        max_ahead_bytes: the thread does not start a range while the ranges queued after the last
            one waited for, and before this one, exceed this many bytes (so that it never evicts
            from the page cache what the checks have yet to use).

    Tickets are consecutive integers; ranges are read in ticket order, so waiting for a ticket
    also waits for every earlier one. If the thread fails or is closed, waits return (the checks
    then read the pages themselves).
    """

    def __init__(
        self,
        enabled: bool = True,
        block_bytes: int = 8 * 1024 * 1024,
        max_ahead_bytes: int = 1024 * 1024 * 1024,
    ):
        self.enabled = enabled and hasattr(os, "preadv")
        self._block = int(block_bytes)
        self._max_ahead = int(max_ahead_bytes)
        self._cum: list = [0]  # _cum[t + 1]: bytes of tickets 0..t
        self._wanted = -1  # highest ticket a caller has asked for
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._done = -1
        self._alive = True
        self._stop = False
        self.bytes_read = 0
        """Bytes the thread actually read from disk (uncached blocks)."""

    def add(self, path: Union[str, os.PathLike], offset: int = 0, length: int = 0) -> int:
        """Queue ``length`` bytes (0: to the end of the file) of ``path`` from ``offset``.

        Returns:
            The ticket to :meth:`wait` for (``-1`` when disabled).
        """
        if not self.enabled:
            return -1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verify-readahead", daemon=True)
            self._thread.start()
        if length <= 0:
            try:
                length = max(0, os.path.getsize(path) - int(offset))
            except OSError:
                length = 0
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._cum.append(self._cum[-1] + int(length))
        self._queue.put((ticket, str(path), int(offset), int(length)))
        return ticket

    def wait(self, ticket: int) -> None:
        """Block until the range of ``ticket`` (and all earlier ones) has been read."""
        if ticket < 0:
            return
        with self._cond:
            if ticket > self._wanted:
                self._wanted = ticket
                self._cond.notify_all()
            while self._done < ticket and self._alive:
                self._cond.wait()

    @staticmethod
    def _cached(fd: int, first: int, last: int, probe: bytearray) -> bool:
        nowait = getattr(os, "RWF_NOWAIT", None)
        if nowait is None:
            return False
        try:
            return all(os.preadv(fd, [probe], p, nowait) == 1 for p in (first, last))
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP etc.: cannot tell, read it
            return False

    def _run(self) -> None:
        buf = bytearray(self._block)
        view = memoryview(buf)
        probe = bytearray(1)
        fds: Dict[str, int] = {}
        try:
            while True:
                item = self._queue.get()
                if item is None or self._stop:
                    return
                ticket, path, off, length = item
                with self._cond:  # bounded look-ahead
                    while (
                        not self._stop
                        and self._cum[ticket] - self._cum[max(self._wanted, 0) + 1]
                        > self._max_ahead
                    ):
                        self._cond.wait()
                try:
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY)
                    fd = fds[path]
                    end = os.fstat(fd).st_size if length <= 0 else off + length
                    pos = off
                    while pos < end and not self._stop:
                        n = min(len(buf), end - pos)
                        if not self._cached(fd, pos, pos + n - 1, probe):
                            got = os.preadv(fd, [view[:n]], pos)
                            if got <= 0:
                                break
                            self.bytes_read += got
                        pos += n
                except OSError:
                    pass  # the check will read (and report) it itself
                with self._cond:
                    self._done = ticket
                    self._cond.notify_all()
        finally:
            for fd in fds.values():
                os.close(fd)
            with self._cond:
                self._alive = False
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread (pending ranges are dropped) and release waiters."""
        if self._thread is not None:
            self._stop = True
            with self._cond:
                self._cond.notify_all()
            self._queue.put(None)
            self._thread.join()
            self._thread = None
