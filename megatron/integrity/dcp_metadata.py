"""The one reader of a ``torch_dist`` checkpoint's ``.metadata`` (PyTorch DCP's pickled
``Metadata``: every tensor's global shape, dtype and chunks, every byte object, and where each
item lies in the ``__<rank>_<n>.distcp`` data files).

Every module of this project that needs a checkpoint's metadata calls :func:`read_dcp_metadata`
(the verifier's :class:`~megatron.integrity.persistent.PersistentCheckpoint`, the storage-range
check of :mod:`megatron.integrity.manifest`, the fixes and the training extensions that look at a
checkpoint before loading it), so a missing or damaged file is reported the same way everywhere:
as :class:`DcpMetadataError`. Importing this module is cheap (PyTorch DCP is imported on the
first read).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from megatron.integrity.persistent_dirs import CheckpointInputError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["METADATA_FNAME", "DcpMetadataError", "read_dcp_metadata"]

METADATA_FNAME = ".metadata"
"""File name of DCP's metadata in a ``torch_dist`` iteration directory."""


class DcpMetadataError(CheckpointInputError):
    """A checkpoint directory's DCP ``.metadata`` cannot be read: it is absent (not a complete
    ``torch_dist`` checkpoint, or another format), not a readable file, or not an unpicklable
    ``Metadata`` (truncated, corrupt). A :class:`~megatron.integrity.persistent_dirs.
    CheckpointInputError`, hence a ``ValueError`` and an
    :class:`~megatron.overlay.errors.OverlayError`. The message names the file and the cause.

    Attributes:
        path: the ``.metadata`` path that was read.
        missing: True when no such file exists (the directory holds no ``torch_dist``
            checkpoint), False when it exists but cannot be read or unpickled.
    """

    def __init__(self, message: str, path: Union[str, os.PathLike], missing: bool) -> None:
        super().__init__(message)
        self.path = Path(path)
        self.missing = missing


def read_dcp_metadata(
    checkpoint_dir: Union[str, os.PathLike], reader: Optional["FileSystemReader"] = None
) -> "Metadata":
    """Read (unpickle) the DCP ``Metadata`` of a ``torch_dist`` iteration directory.

    Reads ``<checkpoint_dir>/.metadata`` only: no data file, no collective.

    Args:
        checkpoint_dir: the iteration directory (``iter_0000010``), which holds ``.metadata``.
        reader: the ``torch.distributed.checkpoint.FileSystemReader`` to read it with, for a
            caller that then reads data through the same reader (default: a new one over
            ``checkpoint_dir``).

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata`` (``state_dict_metadata``: key ->
        ``TensorStorageMetadata`` / ``BytesStorageMetadata``; ``storage_data``:
        ``MetadataIndex`` -> ``_StorageInfo``).

    Raises:
        DcpMetadataError: the file is absent (``missing=True``), or cannot be read or unpickled
            (``missing=False``; the original exception is its ``__cause__``).

    Note: unpickling runs code named in the file, as loading the checkpoint does; read only
    checkpoints you would load.
    """
    path = Path(checkpoint_dir) / METADATA_FNAME
    try:
        if reader is None:
            from torch.distributed.checkpoint import FileSystemReader

            reader = FileSystemReader(str(checkpoint_dir))
        return reader.read_metadata()
    except Exception as e:  # any unpickling error means the same: a damaged file
        if isinstance(e, FileNotFoundError) and not path.exists():
            raise DcpMetadataError(
                f"cannot read {path}: missing (not a complete torch_dist checkpoint)",
                path,
                missing=True,
            ) from e
        raise DcpMetadataError(
            f"cannot read {path}: {type(e).__name__}: {e}", path, missing=False
        ) from e
