"""Checkpoint verifier: local (non-persistent) checkpoint files against a persistent
``torch_dist`` checkpoint of the same iteration, or either one alone
(``tools/verify_checkpoint.py``; what is checked and how: ``docs/verify.md``).

:func:`verify_checkpoint` (``local_dir``, ``persistent_dir``, ``iteration``, ``options``:
:class:`VerifyOptions`, ``group``) returns a :class:`~megatron.integrity.report.VerifyReport`,
the same on every rank of ``group``. Bad input raises :class:`CheckpointInputError` (a
``ValueError``) or its subclass :class:`IterationMismatchError` on every rank. Modules:
``options``, ``discovery`` (files, iteration), ``tensor_ops`` / ``tensor_checks`` (one tensor),
``local_file`` (one local file), ``persistent_checks``, ``copies`` (local-copy verdicts),
``schedule`` (work division), ``merge`` (the report), ``run`` (the entry point).
"""

from megatron.integrity.persistent import CheckpointInputError
from megatron.integrity.report import VerifyReport
from megatron.integrity.verify.discovery import (
    IterationMismatchError,
    LocalFile,
    LocalLayout,
    discover_local,
)
from megatron.integrity.verify.options import DEFAULT_BATCH_BYTES, VerifyOptions
from megatron.integrity.verify.run import verify_checkpoint
from megatron.integrity.verify.schedule import assign as _assign
from megatron.integrity.verify.schedule import local_units as _local_units
from megatron.integrity.verify.tensor_ops import (
    SCAN_BLOCK_BYTES,
    bytes_equal,
    count_nonfinite,
    deep_difference,
    fused_scan,
)

__all__ = [
    "CheckpointInputError",
    "DEFAULT_BATCH_BYTES",
    "IterationMismatchError",
    "LocalFile",
    "LocalLayout",
    "SCAN_BLOCK_BYTES",
    "VerifyOptions",
    "VerifyReport",
    "_assign",
    "_local_units",
    "bytes_equal",
    "count_nonfinite",
    "deep_difference",
    "discover_local",
    "fused_scan",
    "verify_checkpoint",
]
