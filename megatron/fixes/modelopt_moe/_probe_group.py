"""A process group for capability probes that need ``torch.distributed`` initialised."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch


@contextlib.contextmanager
def private_process_group() -> Iterator[None]:
    """A private 1-rank gloo group, initialised for the ``with`` block and destroyed after it.

    Leaves no trace: the ``sys.excepthook`` that ``init_process_group`` installs (it prefixes
    every traceback line with ``[rank0]:``, the rank of the private group) is put back, so the
    job's real group prints ``[rank1]:``, not ``[rank1]: [rank0]:``.

    Raises:
        RuntimeError: ``torch.distributed`` is already initialised.
    """
    if torch.distributed.is_initialized():
        raise RuntimeError("private_process_group: torch.distributed is already initialised")
    hook = sys.excepthook
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        sys.excepthook = hook


@contextlib.contextmanager
def some_process_group() -> Iterator[None]:
    """``torch.distributed`` initialised: the job's group if it is, else a
    :func:`private_process_group`. For probes that run no collective."""
    if torch.distributed.is_initialized():
        yield
        return
    with private_process_group():
        yield
