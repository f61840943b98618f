"""How the checkpoint verifier checks: :class:`VerifyOptions`, the one options object of
:func:`megatron.verify.verify_checkpoint`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

__all__ = ["DEFAULT_BATCH_BYTES", "VerifyOptions"]

DEFAULT_BATCH_BYTES = 64 * 1024 * 1024
"""Most persistent tensor bytes held in memory at once while comparing one local file."""


@dataclass(frozen=True)
class VerifyOptions:
    """What the verifier checks and how it reads (defaults: ``tools/verify_checkpoint.py``'s).

    Attributes:
        check_nonfinite: scan floating-point tensors for NaN/Inf.
        verify_manifest: verify the persistent checkpoint's ``integrity.json`` (xxh3 blocks or
            SHA-256) if it has one. ``None``: only when the persistent checkpoint is verified
            alone (with local files, the bitwise comparison with local copies whose own checksums
            verify already checks the persistent tensor data).
        compare_objects: compare main-replica ``ShardedObject`` s with the persistent ones.
        batch_bytes: most persistent tensor bytes held at once per process.
        mmap: ``torch.load(mmap=True)`` for local files (falls back to reading for files that
            cannot be mapped).
        readahead: read the next ranges in a background thread, so that I/O and checks overlap.
        torch_threads: torch intra-op threads while verifying (restored afterwards; ``None``: leave
            as is). Default 1: the checks run on 1 MiB blocks; use several processes instead.
        progress: show a ``tqdm`` progress bar (bytes) on rank 0 of the group.
    """

    check_nonfinite: bool = True
    verify_manifest: Optional[bool] = None
    compare_objects: bool = True
    batch_bytes: int = DEFAULT_BATCH_BYTES
    mmap: bool = True
    readahead: bool = True
    torch_threads: Optional[int] = 1
    progress: bool = False

    def resolved(self, with_local: bool) -> "VerifyOptions":
        """These options with ``verify_manifest`` decided (``None`` -> ``not with_local``) and
        ``batch_bytes`` an ``int``."""
        manifest = (not with_local) if self.verify_manifest is None else self.verify_manifest
        return dataclasses.replace(
            self, verify_manifest=manifest, batch_bytes=int(self.batch_bytes)
        )
