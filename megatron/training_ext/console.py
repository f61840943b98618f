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


def process_rank() -> int:
    """This process's global rank (0 without an initialised process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank0_line(prefix: str, line: str) -> None:
    """``f"{prefix} {line}"`` on global rank 0 only (every process without a process group): the
    one line a collective decision prints for the whole job (:func:`write_line`)."""
    if process_rank() == 0:
        write_line(f"{prefix} {line}")


def rank_line(prefix: str, line: str) -> None:
    """``f"{prefix} rank R: {line}"`` on this rank: a line only this rank can say."""
    write_line(f"{prefix} rank {process_rank()}: {line}")
