"""Training-time integrity primitives and the on-disk formats of saved state.

Two kinds of hash, each with one home. *Checksums* hash bytes as stored or sent
(:mod:`~megatron.integrity.checksum`): per-tensor checksums and their record
(:mod:`~megatron.integrity.checksum.tensor`: xxh3 on the CPU;
:mod:`~megatron.integrity.checksum.device`: ``pmix64`` where the tensor lives), block checksums of
files (:mod:`~megatron.integrity.checksum.file`) and of the bytes a save writes
(:mod:`~megatron.integrity.checksum.written`). The *digest* is the resume proof's
topology-independent hash of the training state's values by global index
(:mod:`~megatron.integrity.digest`: :mod:`~megatron.integrity.digest.state`, CPU kernel
:mod:`~megatron.integrity.digest.kernel`, the ``state_digest.json`` record
:mod:`~megatron.integrity.digest.record`). Both build on the mixing step of
:mod:`~megatron.integrity.mix64` and never import each other. Also: one-pass tensor scans and
comparisons (:mod:`~megatron.integrity.tensor_ops`), tensor kinds
(:mod:`~megatron.integrity.tensors`).

Formats: ``integrity.json`` of persistent checkpoints (:mod:`~megatron.integrity.manifest`), names
and identity records of local files (:mod:`~megatron.integrity.local_layout`,
:mod:`~megatron.integrity.local_identity`), ``torch.save`` archives
(:mod:`~megatron.integrity.torch_save`), ``torch_dist`` checkpoints (the one ``.metadata`` reader
:mod:`~megatron.integrity.dcp_metadata`, locating and reading them
:mod:`~megatron.integrity.persistent_dirs`, :mod:`~megatron.integrity.persistent`), and ordered
read-ahead of file ranges (:mod:`~megatron.integrity.readahead`).

The offline checkpoint verifier built on these is :mod:`megatron.verify`; this package never
imports it (layering, ``docs/layout.md``: of this project's packages it imports only
:mod:`megatron.overlay`). Names are imported on first use, so ``import megatron.integrity`` loads
nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any, List

#: Public modules and subpackages of this package (the subpackages' modules: ``checksum.tensor``,
#: ``checksum.device``, ``checksum.file``, ``checksum.written``, ``digest.state``,
#: ``digest.record``, and ``digest.kernel``, imported by ``digest.state`` only when numba is
#: installed).
_MODULES = (
    "checksum",
    "dcp_metadata",
    "digest",
    "local_identity",
    "local_layout",
    "manifest",
    "mix64",
    "persistent",
    "persistent_dirs",
    "readahead",
    "tensor_ops",
    "tensors",
    "torch_save",
)

#: Name -> the module defining it, for the names offered at package level.
_NAMES = {
    "ChecksumMismatchError": "checksum.tensor",
    "CheckpointInputError": "persistent_dirs",
    "CheckpointIntegrityError": "manifest",
    "DcpMetadataError": "dcp_metadata",
    "PersistentCheckpoint": "persistent",
    "ReadAhead": "readahead",
    "fused_scan": "tensor_ops",
    "is_quantized": "tensors",
    "pmix64": "checksum.device",
    "read_dcp_metadata": "dcp_metadata",
    "resolve_persistent_dir": "persistent_dirs",
    "tensor_checksum": "checksum.tensor",
    "tensor_digest": "digest.state",
}

__all__ = sorted(_MODULES + tuple(_NAMES))


def __getattr__(name: str) -> Any:
    """The module ``megatron.integrity.<name>``, or the name from the module that defines it
    (imported on first access).

    Raises:
        AttributeError: ``name`` is not offered here.
    """
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
