"""The one restricted loader of every checkpoint file this fork reads or wraps: a pickle may name
only the globals of :data:`ALLOWLIST` (what megatron-core, NVRx, megatron-fsdp, ModelOpt, PyTorch
DCP and this fork store), so reading a checkpoint never imports or calls anything else.

A pickle can name any importable callable; whoever can write a file a job reads could run code in
it. Here the check happens in ``find_class``, before a name is imported: a file that names
anything outside the allowlist raises :class:`UnsafeCheckpointError` naming the file and the
global, and nothing it names is imported or called. :func:`torch_load` reads ``torch.save`` files
(local checkpoints, ``common.pt``, ``--ckpt-format torch``, the byte objects of a DCP checkpoint);
:func:`pickle_load` plain pickles (DCP's ``.metadata``). Both use the C unpickler with the
restricted ``find_class`` (PyTorch's ``weights_only`` unpickler runs in Python and is slower; its
allowlist is process-wide, and megatron-core widens it at import). :data:`POLICY` ``.unrestricted``
(``--unrestricted-unpickling``) restores plain unpickling for checkpoints of code the list does
not know.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Dict, Optional, Union

from megatron.overlay.errors import OverlayError

__all__ = [
    "ALLOWLIST",
    "POLICY",
    "UNRESTRICTED_FLAG",
    "UnsafeCheckpointError",
    "allowed",
    "load_without_tensors",
    "pickle_load",
    "torch_load",
]

#: The flag that restores unrestricted unpickling (named in every refusal).
UNRESTRICTED_FLAG = "--unrestricted-unpickling"

_CORE = "megatron-core"
_ARGS = "megatron-core: the run's args (argparse.Namespace) in every checkpoint"
_DCP = "PyTorch DCP: .metadata of torch_dist / fsdp_dtensor checkpoints"
_TORCH = "torch.save: tensors and containers in every torch.save file"

#: Every global a checkpoint file may name: ``"module.qualname"`` -> the writer that stores it.
#: Found in real checkpoints of every format the tests write (torch_dist, local replicated,
#: fsdp_dtensor, ModelOpt-quantized, --ckpt-format torch, distributed optimizer; see
#: docs/unpickling.md).
ALLOWLIST: Dict[str, str] = {
    # torch.save itself (storages are resolved by torch.load before find_class is asked)
    "torch._utils._rebuild_tensor_v2": _TORCH,
    "torch._utils._rebuild_parameter": _TORCH + " (nn.Parameter)",
    "torch._utils._rebuild_parameter_with_state": _TORCH + " (nn.Parameter with attributes)",
    "torch._tensor._rebuild_from_type_v2": _TORCH + " (tensor subclasses)",
    "torch.nn.parameter.Parameter": _TORCH + " (nn.Parameter)",
    "torch.Tensor": _TORCH,
    "torch.Size": _TORCH + "; DCP .metadata (TensorStorageMetadata.size)",
    "torch.device": _TORCH,
    "torch._C.Generator": "megatron-core --ckpt-format torch: RNG generator states",
    "torch.serialization._get_layout": _DCP + " (TensorProperties.layout)",
    "collections.OrderedDict": _TORCH + " (module state dicts)",
    "_codecs.encode": "pickle protocol 2: bytes and numpy buffers (every writer)",
    "builtins.set": "plain containers (args values; harmless data, kept for custom args)",
    "builtins.frozenset": "plain containers (args values; harmless data, kept for custom args)",
    "builtins.slice": _CORE + ": ShardedTensor.flattened_range (distributed optimizer)",
    # numpy (the numpy RNG state of every checkpoint)
    "numpy._core.multiarray._reconstruct": _CORE + ": numpy RNG state (numpy >= 2)",
    "numpy.core.multiarray._reconstruct": _CORE + ": numpy RNG state (numpy < 2)",
    "numpy.ndarray": _CORE + ": numpy RNG state",
    "numpy.dtype": _CORE + ": numpy RNG state",
    "numpy.dtypes.UInt32DType": _CORE + ": numpy RNG state (megatron-core's SAFE_GLOBALS)",
    # the run's arguments and upstream's state objects (megatron-core safe_globals.SAFE_GLOBALS)
    "argparse.Namespace": _ARGS,
    "types.SimpleNamespace": _CORE + " (SAFE_GLOBALS)",
    "pathlib.PosixPath": _ARGS + "; megatron-fsdp .metadata (storage_meta.checkpoint_id)",
    "signal.Signals": _ARGS + " (--exit-signal)",
    "io.BytesIO": _CORE + " (SAFE_GLOBALS: byte objects)",
    "megatron.core.enums.ModelType": _ARGS,
    "megatron.core.optimizer.optimizer_config.OptimizerConfig": _CORE + " (SAFE_GLOBALS)",
    "megatron.core.transformer.enums.AttnBackend": _ARGS + " (--attention-backend)",
    "megatron.core.transformer.enums.CudaGraphModule": _ARGS,
    "megatron.core.transformer.enums.CudaGraphScope": _ARGS + " (--cuda-graph-scope)",
    "megatron.core.transformer.enums.InferenceCudaGraphScope": _ARGS,
    "megatron.core.transformer.enums.AttnMaskType": _ARGS,
    "megatron.core.rerun_state_machine.RerunDiagnostic": _CORE + ": rerun state machine state",
    "megatron.core.rerun_state_machine.RerunMode": _CORE + ": rerun state machine state",
    "megatron.core.rerun_state_machine.RerunState": _CORE + ": rerun state machine state",
    # local checkpoints (NVRx LocalCheckpointManager + megatron-core's tensor-aware state dict)
    "megatron.core.dist_checkpointing.tensor_aware_state_dict.MCoreTensorAwareStateDict": (
        "NVRx local checkpoints written by megatron-core (--non-persistent-ckpt-type local)"
    ),
    "megatron.core.dist_checkpointing.mapping.ShardedTensor": _CORE + " local checkpoints",
    "megatron.core.dist_checkpointing.mapping.ShardedObject": _CORE + " local checkpoints",
    "megatron.core.dist_checkpointing.mapping.LocalNonpersistentObject": _CORE + " local ckpts",
    # PyTorch DCP .metadata
    "torch.distributed.checkpoint.metadata.Metadata": _DCP,
    "torch.distributed.checkpoint.metadata.MetadataIndex": _DCP,
    "torch.distributed.checkpoint.metadata.StorageMeta": _DCP,
    "torch.distributed.checkpoint.metadata.TensorProperties": _DCP,
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata": _DCP,
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata": _DCP,
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata": _DCP,
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": _DCP,
    "torch.distributed.checkpoint.filesystem._StorageInfo": _DCP,
    "torch.distributed.checkpoint.planner.SavePlan": _DCP + " (megatron-core's cached plans)",
    "torch.distributed.checkpoint.planner.WriteItem": _DCP + " (megatron-core's cached plans)",
    "torch.distributed.checkpoint.planner.WriteItemType": _DCP + " (megatron-core's plans)",
    "torch.distributed.checkpoint.planner.TensorWriteData": _DCP + " (megatron-core's plans)",
}

#: torch dtypes (``torch.float32``, ...): every writer (tensor metadata, args such as
#: ``params_dtype``); names taken from torch's own module dictionary, nothing imported.
_DTYPES = frozenset()


def _dtype_names() -> frozenset:
    import torch

    return frozenset(
        f"torch.{n}" for n, v in vars(torch).items() if isinstance(v, torch.dtype) and "." not in n
    )


_STORAGES = frozenset()


def _storage_names() -> frozenset:
    """Names of torch's storage classes (``FloatStorage``, ``UntypedStorage``, ...), which
    ``torch.load`` resolves itself; read from torch's module dictionary, nothing imported."""
    global _STORAGES
    if not _STORAGES:
        import torch

        _STORAGES = frozenset(
            n for n, v in vars(torch).items() if n.endswith("Storage") and isinstance(v, type)
        )
    return _STORAGES


@dataclass
class UnpicklePolicy:
    """How this process unpickles checkpoints.

    Attributes:
        unrestricted: plain unpickling (``--unrestricted-unpickling``): a file may run code.
    """

    unrestricted: bool = False


#: The process's policy (set from ``--unrestricted-unpickling`` at start, or by a tool's flag).
POLICY = UnpicklePolicy()


class UnsafeCheckpointError(OverlayError, pickle.UnpicklingError):
    """A checkpoint file names a global outside :data:`ALLOWLIST`; it was not loaded and nothing
    it names was imported or called. A ``pickle.UnpicklingError`` (callers that treat any
    unpickling failure as a damaged file keep doing so).

    Attributes:
        path: the file (or ``"<what>"`` for bytes with no file of their own).
        global_name: the ``module.name`` it asked for.
    """

    def __init__(self, path: Union[str, os.PathLike], global_name: str) -> None:
        self.path = str(path)
        self.global_name = global_name
        super().__init__(
            f"{self.path} names {global_name}, outside the unpickling allowlist: not loaded "
            f"({UNRESTRICTED_FLAG} loads files you trust)"
        )

    def __reduce__(self):  # travels between ranks (DCP gathers the failures of every rank)
        return (type(self), (self.path, self.global_name))


def allowed(global_name: str) -> bool:
    """Whether a pickle may name ``global_name`` (``"module.qualname"``)."""
    global _DTYPES
    if global_name in ALLOWLIST:
        return True
    if not _DTYPES:
        _DTYPES = _dtype_names()
    return global_name in _DTYPES


class _Refused(pickle.UnpicklingError):
    def __init__(self, global_name: str) -> None:
        super().__init__(global_name)
        self.global_name = global_name


def _py3_name(module: str, name: str) -> tuple:
    """Python 3's name of a global a protocol 0-2 pickle names the Python 2 way
    (``__builtin__.set`` -> ``builtins.set``), as ``pickle.Unpickler.find_class`` maps it."""
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` imports only :data:`ALLOWLIST` globals (raises
    before importing anything else)."""

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` when allowed (imported only then), else ``_Refused``."""
        module, name = _py3_name(module, name)
        full = f"{module}.{name}"
        if not allowed(full):
            raise _Refused(full)
        return super().find_class(module, name)


class _NoTensorUnpickler(RestrictedUnpickler):
    """Unpickles a ``torch.save`` archive's ``data.pkl`` with every tensor replaced by ``None``
    (no storage read)."""

    def find_class(self, module: str, name: str) -> Any:
        module, name = _py3_name(module, name)
        if module == "torch" and name in _storage_names():
            return None  # a storage's type in a persistent id: no storage is read
        if module in ("torch._utils", "torch._tensor") and name.startswith("_rebuild"):
            full = f"{module}.{name}"
            if not allowed(full):
                raise _Refused(full)
            return _no_tensor
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> None:
        return None


def _no_tensor(*args: Any, **kwargs: Any) -> None:
    return None


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: an ``Unpickler`` and ``load``."""

    Unpickler = RestrictedUnpickler
    __name__ = "megatron.integrity.unpickle"

    @staticmethod
    def load(f: IO[bytes], **kwargs: Any) -> Any:
        return RestrictedUnpickler(f, **kwargs).load()


def _name(f: Any, what: Optional[str]) -> str:
    if what:
        return what
    return str(f) if isinstance(f, (str, os.PathLike)) else "<bytes>"


def torch_load(
    f: Union[str, os.PathLike, IO[bytes]],
    *,
    map_location: Any = None,
    mmap: bool = False,
    what: Optional[str] = None,
) -> Any:
    """``torch.load`` of a checkpoint file, restricted to :data:`ALLOWLIST`.

    Args:
        f: a path or a seekable binary file object.
        map_location, mmap: as ``torch.load``.
        what: the name used in errors when ``f`` is not a path (e.g. the DCP item's file and key).

    Returns:
        The object stored, tensors as ``torch.load`` restores them.

    Raises:
        UnsafeCheckpointError: the file names a global outside the allowlist (nothing imported).
        OSError, RuntimeError, pickle.UnpicklingError, EOFError, ...: as ``torch.load`` for a
            missing, truncated or corrupt file.
    """
    import torch

    if POLICY.unrestricted:
        return torch.load(f, map_location=map_location, mmap=mmap, weights_only=False)
    try:
        return torch.load(
            f, map_location=map_location, mmap=mmap, weights_only=False, pickle_module=_PickleModule
        )
    except _Refused as e:
        raise UnsafeCheckpointError(_name(f, what), e.global_name) from None


def pickle_load(f: IO[bytes], *, what: str) -> Any:
    """``pickle.load`` of a plain pickle (DCP's ``.metadata``), restricted to :data:`ALLOWLIST`.

    Raises:
        UnsafeCheckpointError: the pickle names a global outside the allowlist (``what`` names the
            file; nothing imported).
        pickle.UnpicklingError, EOFError, ...: a truncated or corrupt pickle.
    """
    if POLICY.unrestricted:
        return pickle.load(f)
    try:
        return RestrictedUnpickler(f).load()
    except _Refused as e:
        raise UnsafeCheckpointError(what, e.global_name) from None


def load_without_tensors(path: Union[str, os.PathLike]) -> Any:
    """The object a ``torch.save`` file holds, with every tensor replaced by ``None`` (reads the
    archive's directory and its ``data.pkl`` only), restricted to :data:`ALLOWLIST` (unless
    :data:`POLICY` is unrestricted, the rebuild functions are the only torch globals replaced).

    Raises:
        UnsafeCheckpointError: the pickle names a global outside the allowlist.
        ValueError: the archive has no ``data.pkl``.
        OSError, zipfile.BadZipFile, pickle.UnpicklingError, ...: missing, truncated or not a zip.
    """
    with zipfile.ZipFile(path) as z:
        data = _data_pkl(z, f"{path}: no data.pkl in the archive (not a torch.save file)")
    return loads_without_tensors(data, what=str(path))


def _data_pkl(z: zipfile.ZipFile, missing: str) -> bytes:
    """The ``data.pkl`` member of a ``torch.save`` archive (``missing``: the error's message).

    Raises:
        ValueError: the archive has no ``data.pkl``.
    """
    names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
    if not names:
        raise ValueError(missing)
    return z.read(names[0])


def loads_without_tensors(data: bytes, *, what: str) -> Any:
    """:func:`load_without_tensors` of a ``data.pkl`` already read (``what`` names it in errors)."""
    cls = _UnrestrictedNoTensor if POLICY.unrestricted else _NoTensorUnpickler
    try:
        return cls(io.BytesIO(data)).load()
    except _Refused as e:
        raise UnsafeCheckpointError(what, e.global_name) from None


class _UnrestrictedNoTensor(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch") and name.startswith("_rebuild"):
            return _no_tensor
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> None:
        return None


def torch_bytes_without_tensors(blob: bytes, *, what: str) -> Any:
    """The object of a ``torch.save`` blob held in memory (a DCP byte item), tensors as ``None``,
    restricted as :func:`load_without_tensors` (for checks that must not load it)."""
    if blob[:2] == b"PK":
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            blob = _data_pkl(z, f"{what}: no data.pkl (not a torch.save blob)")
    return loads_without_tensors(blob, what=what)


def describe() -> str:
    """One line: the allowlist's size (entries plus torch dtypes) and where it is defined."""
    if not _DTYPES:
        allowed("torch.float32")
    return (
        f"{len(ALLOWLIST)} globals + {len(_DTYPES)} torch dtypes "
        f"({Path(__file__).name}); unrestricted: {POLICY.unrestricted}"
    )
