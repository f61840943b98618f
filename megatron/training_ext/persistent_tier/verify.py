"""The verification of what a load reads, and the checksums it verifies: every ``torch_dist`` save
writes ``integrity.json`` when done (upstream only with ``--verify-integrity``), and every load
verifies the directory's sizes and checksums once per install before its bytes are used (a flipped
byte otherwise loads silently, a truncated file fails deep in the load with a bare ``EOFError``).
The wrappers of ``megatron.core.dist_checkpointing``'s ``save``, ``load`` and
``load_common_state_dict`` read the installed tier's policy and memo at call time.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.integrity import manifest as mf
from megatron.overlay import Patch, wraps_upstream
from megatron.training_ext import resume_proof
from megatron.training_ext.console import rank0_line
from megatron.training_ext.persistent_tier.common import LOG_PREFIX, tier_state

__all__ = ["PATCHES", "IntegrityPolicy"]


@dataclass
class IntegrityPolicy:
    """What the persistent tier does with checksums (from the arguments of one install).

    Attributes:
        write: write ``integrity.json`` at every ``torch_dist`` save.
        verify: hash the bytes at load when ``integrity.json`` is present.
        require: ``integrity.json`` must be present (upstream's ``--verify-integrity``).
    """

    write: bool = True
    verify: bool = True
    require: bool = False


def _ensure_verified(checkpoint_dir: Any, require: bool, group=None) -> None:
    """Verify ``checkpoint_dir`` once per process; collective over ``group`` (default: the world)
    when distributed is initialised, as megatron-core's loads are (every rank of the group reads
    the same directory). Before ``torch.distributed`` exists (``--use-checkpoint-args`` reads the
    checkpoint's args first) only the sizes are checked, on this process alone; the collective
    load verifies later."""
    import torch.distributed as dist

    state = tier_state()
    policy = state.policy
    d = Path(str(checkpoint_dir))
    key = os.path.realpath(d)  # the same on every rank (a stamp read per rank might not be)
    if key in state.verified:
        return
    collective = dist.is_available() and dist.is_initialized()
    hash_bytes = policy.verify and collective
    summary = mf.verify_checkpoint_dir(
        d,
        require_manifest=require or policy.require,
        hash_bytes=hash_bytes,
        group=group if collective else None,
        damaged_as_absent=not policy.verify,
    )
    if not collective:
        return
    state.verified[key] = summary
    if summary.algorithm is None and summary.notes and "unreadable" in summary.notes[0]:
        rank0_line(LOG_PREFIX, f"{d.name}: {summary.notes[0]}")
    elif summary.algorithm is None:
        rank0_line(
            LOG_PREFIX,
            f"{d.name}: no {mf.INTEGRITY_FNAME} (saved without checksums, e.g. by upstream "
            f"Megatron-LM or with --no-verify-integrity): file sizes checked against .metadata, "
            f"bytes not verified",
        )
    elif hash_bytes:
        rank0_line(
            LOG_PREFIX,
            f"{d.name}: verified {summary.files} files, {summary.bytes / 1e6:.1f} MB "
            f"({summary.algorithm}) in {summary.seconds * 1e3:.0f} ms",
        )
    else:
        rank0_line(
            LOG_PREFIX,
            f"{d.name}: sizes of {summary.files} files checked (--no-verify-integrity: bytes not "
            f"verified)",
        )


def _bind(sig: inspect.Signature, args, kwargs) -> inspect.BoundArguments:
    ba = sig.bind(*args, **kwargs)
    ba.apply_defaults()
    return ba


def _wrap_save(orig):
    sig = inspect.signature(orig)

    @wraps_upstream(orig)
    def save(*args, **kwargs):
        """dist_checkpointing.save that writes integrity.json (xxh3 blocks, hashed by the ranks
        that wrote the files) by default (megatron.training_ext.persistent_tier)."""
        ba = _bind(sig, args, kwargs)
        state = tier_state()
        write = state.policy.write or bool(ba.arguments.get("verify_integrity"))
        ba.arguments["verify_integrity"] = False
        state.verified.pop(os.path.realpath(str(ba.arguments["checkpoint_dir"])), None)  # rewritten
        request = orig(*ba.args, **ba.kwargs)
        resume_proof.write_pending(ba.arguments["checkpoint_dir"])  # before the manifest
        if not write:
            return request
        finalize = functools.partial(mf.save_manifest, str(ba.arguments["checkpoint_dir"]))
        if request is None:
            finalize()
        else:
            request.finalize_fns.append(finalize)
        return request

    return save


def _wrap_load(orig):
    sig = inspect.signature(orig)

    @wraps_upstream(orig)
    def load(*args, **kwargs):
        """dist_checkpointing.load that verifies the directory first (once per process)
        (megatron.training_ext.persistent_tier)."""
        ba = _bind(sig, args, kwargs)
        _ensure_verified(
            ba.arguments["checkpoint_dir"],
            bool(ba.arguments.get("verify_integrity")),
            ba.arguments.get("process_group"),
        )
        ba.arguments["verify_integrity"] = False
        return orig(*ba.args, **ba.kwargs)

    return load


def _wrap_load_common(orig):
    @wraps_upstream(orig)
    def load_common_state_dict(checkpoint_dir, *args, **kwargs):
        """dist_checkpointing.load_common_state_dict that verifies the directory first
        (megatron.training_ext.persistent_tier)."""
        _ensure_verified(checkpoint_dir, False)
        return orig(checkpoint_dir, *args, **kwargs)

    return load_common_state_dict


_DC, _SER = "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.serialization"

#: The patches of ``dist_checkpointing`` (its package attributes, then ``serialization``'s).
PATCHES = tuple(
    Patch(f"{owner}.{name}", factory, why, params=params)
    for owner in (_DC, _SER)
    for name, factory, why, params in (
        (
            "save",
            _wrap_save,
            "every torch_dist save writes integrity.json (per-block xxh3) when done",
            ("checkpoint_dir", "verify_integrity"),
        ),
        (
            "load",
            _wrap_load,
            "a torch_dist load verifies sizes and checksums before reading",
            ("checkpoint_dir", "verify_integrity"),
        ),
        (
            "load_common_state_dict",
            _wrap_load_common,
            "the common state is verified before it is unpickled",
            (),
        ),
    )
)
