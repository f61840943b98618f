"""Whole-line console output for messages that several ranks print at the same moment."""

from __future__ import annotations

import sys


def write_line(line: str) -> None:
    """Write ``line`` and its newline to stdout in one ``write`` call, then flush.

    ``print(line, flush=True)`` writes the text and the newline separately; with unbuffered stdout
    (``PYTHONUNBUFFERED=1``, usual under torchrun/SLURM) these are two system calls, so lines of
    ranks sharing one output pipe can interleave (``A B\\n\\n``) and a grep for one rank's line
    misses it. One write of less than ``PIPE_BUF`` (4096) bytes to a pipe is atomic.
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
