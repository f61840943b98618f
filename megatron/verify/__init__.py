"""Checkpoint verifier: local (non-persistent) checkpoint files against a persistent
``torch_dist`` checkpoint of the same iteration, or either one alone
(``tools/verify_checkpoint.py``; what is checked and how: ``docs/verify.md``).

:func:`verify_checkpoint` (``local_dir``, ``persistent_dir``, ``iteration``, ``options``:
:class:`VerifyOptions`, ``group``) returns a :class:`~megatron.verify.report.VerifyReport`,
the same on every rank of ``group``. Bad input raises :class:`CheckpointInputError` (a
``ValueError``) or its subclass :class:`IterationMismatchError` on every rank. Modules:
``options``, ``discovery`` (files, iteration), ``tensor_checks`` (one tensor), ``local_file``
(one local file), ``persistent_checks``, ``copies`` (local-copy verdicts), ``schedule`` (work
division), ``merge`` (the report), ``run`` (the entry point), ``report`` (the result records, their
JSON form and text) and ``text_table``.

Offline only: the training path never imports this package. What it reads and the primitives it
runs come from :mod:`megatron.integrity` (formats of the files, checksums, the DCP reader
:class:`~megatron.integrity.persistent.PersistentCheckpoint`, :mod:`megatron.integrity.tensor_ops`).
"""

from megatron.integrity.persistent import CheckpointInputError
from megatron.verify.discovery import (
    IterationMismatchError,
    LocalFile,
    LocalLayout,
    discover_local,
)
from megatron.verify.options import DEFAULT_BATCH_BYTES, VerifyOptions
from megatron.verify.report import (
    PROBLEM_KINDS,
    WARNING_KINDS,
    FileResult,
    Problem,
    VerifyReport,
)
from megatron.verify.run import verify_checkpoint

__all__ = [
    "CheckpointInputError",
    "DEFAULT_BATCH_BYTES",
    "FileResult",
    "IterationMismatchError",
    "LocalFile",
    "LocalLayout",
    "PROBLEM_KINDS",
    "Problem",
    "VerifyOptions",
    "VerifyReport",
    "WARNING_KINDS",
    "discover_local",
    "verify_checkpoint",
]
