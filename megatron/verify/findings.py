"""What a verifier process finds, gathered to every rank and merged into the report: per-file
results and problems (:class:`Findings`), and per local copy what copies are compared by
(:class:`CopyPrint`). Both are picklable (builtin types, report records)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.verify.report import FileResult, Problem

__all__ = ["CopyPrint", "Findings", "TensorPrint"]

TensorPrint = Tuple[str, Optional[tuple], str, tuple, Optional[int], Optional[int]]
"""``(key, global offset, dtype, shape, stored checksum or None, checksum of the bytes or
None)``."""


@dataclass
class CopyPrint:
    """What one local file holds, for comparing the copies of a shard.

    Attributes:
        loaded: the file could be loaded as a state dict.
        identity: its identity record (:mod:`megatron.integrity.local_identity`; ``None``: none).
        tensors: one :data:`TensorPrint` per tensor, in file order.
    """

    loaded: bool = False
    identity: Optional[dict] = None
    tensors: List[TensorPrint] = field(default_factory=list)


@dataclass
class Findings:
    """What one verifier process found.

    Attributes:
        files / problems / warnings: report records.
        regions: key -> {(offsets, sizes): number of local files holding it} (coverage of the
            persistent tensors, copies per region).
        manifest_failed: ``(file, why)`` per ``integrity.json`` failure; ``manifest_checked``:
            files checked.
        bytes_read: bytes this process read.
        prints: local file ``rel`` -> its :class:`CopyPrint`.
    """

    files: List[FileResult] = field(default_factory=list)
    problems: List[Problem] = field(default_factory=list)
    warnings: List[Problem] = field(default_factory=list)
    regions: Dict[str, Dict[Tuple[tuple, tuple], int]] = field(default_factory=dict)
    manifest_failed: List[Tuple[str, str]] = field(default_factory=list)
    manifest_checked: int = 0
    bytes_read: int = 0
    prints: Dict[str, CopyPrint] = field(default_factory=dict)
