"""The writer side of the checksums: the checkpoint writers' data files and ``.metadata`` are
hashed as they are written, so ``integrity.json`` records what this save wrote, not what is on
disk when the manifest is made (another job's files landing in between would verify). Each save's
write function runs under a token of that save (:func:`write_with_token`, also in a spawned
``--async-save`` worker, which finds it by this import path and installs the ``open`` patch
itself); ``.metadata`` is hashed in the coordinator's ``finish``.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os

from megatron.integrity.checksum import written as written_checksums
from megatron.overlay import Patch, wraps_upstream

__all__ = ["PATCHES", "write_with_token"]

_FSA = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_NVRX_FSA = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"


def _hashing_open(_orig):
    return written_checksums.hashing_open


#: Installed in whichever process runs megatron-core's write function (also a spawned worker).
_OPEN_PATCH = Patch(
    f"{_FSA}.open",
    _hashing_open,
    "the checkpoint writer's data files are hashed as they are written, so integrity.json "
    "records what this save wrote, not what is on disk later",
    adds=True,
)


def write_with_token(token: str, fn, *args, **kwargs):
    """megatron-core's write function ``fn`` run with its data files hashed as written under
    ``token`` (:mod:`megatron.integrity.checksum.written`), in whatever process runs it: a worker
    that did not inherit the patch installs it first."""
    import importlib

    fsa = importlib.import_module(_FSA)
    if getattr(fsa, "open", None) is not written_checksums.hashing_open:
        from megatron.training_ext.persistent_tier import COMPONENT

        _OPEN_PATCH.install(COMPONENT.writer_patcher)
    return written_checksums.run_with_token(token, fn, *args, **kwargs)


def _wrap_get_save_function_and_args(orig):
    @wraps_upstream(orig)
    def get_save_function_and_args(self):
        """Upstream's, with the write function hashing what it writes under a fresh token of
        this save (megatron.training_ext.persistent_tier)."""
        if getattr(self, "open_file", None) is builtins.open:  # NVRx's writer: its open hook
            self.open_file = written_checksums.hashing_open
        save_fn, preload_fn, save_args = orig(self)
        if save_fn is None:
            return save_fn, preload_fn, save_args
        token = written_checksums.new_save(self.checkpoint_dir)
        return functools.partial(write_with_token, token, save_fn), preload_fn, save_args

    return get_save_function_and_args


def _wrap_finish(orig):
    @wraps_upstream(orig)
    def finish(self, metadata, results):
        """Upstream's; the ``.metadata`` it pickles is hashed as written
        (megatron.training_ext.persistent_tier)."""
        fs = getattr(self, "fs", None)
        create = getattr(fs, "create_stream", None)
        if create is None:
            return orig(self, metadata, results)
        got = {}

        @contextlib.contextmanager
        def create_stream(path, mode):
            with create(path, mode) as raw:
                if mode != "wb" or os.path.basename(str(path)) != ".metadata.tmp":
                    yield raw
                    return
                f = written_checksums.HashingFile(raw, lambda d: None)
                yield f
                got["d"] = f.checksum_so_far()

        fs.create_stream = create_stream
        try:
            out = orig(self, metadata, results)
        finally:
            del fs.create_stream
        if got.get("d") is not None:
            written_checksums.record(self.checkpoint_dir, ".metadata", got["d"])
        return out

    return finish


#: The ``open`` of megatron-core's writer module, then ``get_save_function_and_args`` and
#: ``finish`` of each writer (--async-save uses NVRx's writer, other saves megatron's).
PATCHES = (
    _OPEN_PATCH,
    *(
        p
        for writer in (_FSA, _NVRX_FSA)
        for p in (
            Patch(
                f"{writer}.FileSystemWriterAsync.get_save_function_and_args",
                _wrap_get_save_function_and_args,
                "each save's write function hashes its data files as written, under a token of "
                "that save",
            ),
            Patch(
                f"{writer}.FileSystemWriterAsync.finish",
                _wrap_finish,
                "the coordinator's .metadata is hashed as it is written",
                params=("metadata", "results"),
            ),
        )
    ),
)
