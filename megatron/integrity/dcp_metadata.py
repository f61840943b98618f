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

from megatron.integrity import unpickle
from megatron.integrity.persistent_dirs import CheckpointInputError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "METADATA_FNAME",
    "DcpMetadataError",
    "read_dcp_metadata",
    "read_metadata",
    "restricted_reader",
]

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


def read_metadata(reader: "FileSystemReader", rank: Optional[int] = None) -> "Metadata":
    """What ``FileSystemReader.read_metadata`` returns (torch 2.14: ``pickle.load`` of
    ``.metadata``, or ``__<rank>.metadata``, then ``storage_meta.load_id``), unpickled with the
    restricted unpickler of :mod:`megatron.integrity.unpickle`.

    Raises:
        UnsafeCheckpointError: the file names a global outside the allowlist (nothing imported).
        FileNotFoundError, pickle.UnpicklingError, EOFError, ...: as upstream.
    """
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = reader._get_metadata_path(rank)
    with reader.fs.create_stream(path, "rb") as f:
        metadata = unpickle.pickle_load(f, what=str(path))
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = getattr(reader, "load_id", None)
    return metadata


def restricted_reader(checkpoint_dir: Union[str, os.PathLike]) -> "FileSystemReader":
    """A ``torch.distributed.checkpoint.FileSystemReader`` over ``checkpoint_dir`` whose
    ``read_metadata`` is :func:`read_metadata` (for a ``dcp.load`` outside training, where the
    persistent tier's patches are not installed)."""
    from torch.distributed.checkpoint import FileSystemReader

    class RestrictedFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose ``.metadata`` is unpickled restricted."""

        def read_metadata(self, *args, **kwargs):
            """:func:`read_metadata` of this reader (``rank`` as upstream's keyword)."""
            return read_metadata(self, kwargs.get("rank"))

    return RestrictedFileSystemReader(str(checkpoint_dir))


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

    The file is unpickled by :func:`read_metadata` (restricted to the allowlist of
    :mod:`megatron.integrity.unpickle`): a file naming any other global is a
    :class:`DcpMetadataError` whose ``__cause__`` is the
    :class:`~megatron.integrity.unpickle.UnsafeCheckpointError`; nothing it names is imported.
    """
    path = Path(checkpoint_dir) / METADATA_FNAME
    try:
        if reader is None:
            from torch.distributed.checkpoint import FileSystemReader

            reader = FileSystemReader(str(checkpoint_dir))  # read_metadata below is restricted
        return read_metadata(reader)
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
