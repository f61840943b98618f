"""The state of one local checkpoint file on its way through the verifier: what
:func:`~megatron.verify.local_file.open_local` loaded and what the checks of
:mod:`~megatron.verify.tensor_checks` read. A module of its own so that both import it: the file's
checks run from :mod:`~megatron.verify.local_file`, which imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from megatron.verify.discovery import LocalFile
from megatron.verify.findings import CopyPrint
from megatron.verify.report import FileResult

__all__ = ["OpenedLocal"]


@dataclass
class OpenedLocal:
    """A local file loaded (memory-mapped) and, once planned, its read-ahead tickets.

    Attributes:
        base: the :class:`~megatron.verify.report.Problem` fields naming the file.
        items: ``(key, tensor, ShardedTensor or None)`` per tensor, in file order.
        objs: its ``ShardedObject`` s.
        entries: its checksum record's entries (``None``: no record).
        batches: tensor indices per batch (at most ``batch_bytes`` each, or one tensor).
    """

    lf: LocalFile
    res: FileResult
    base: dict
    sd: Any = None
    items: List[Tuple[str, Any, Any]] = field(default_factory=list)
    objs: list = field(default_factory=list)
    entries: Optional[list] = None
    print: Optional[CopyPrint] = None
    batches: List[List[int]] = field(default_factory=list)
    batch_tickets: List[int] = field(default_factory=list)
    failed: bool = False
