"""The resume proof's wrappers of upstream's checkpointing: a save digests the live training
state first and records the digest (``state_digest.json`` in the iteration directory, and the
``state_digest`` entry of the common state); a load remembers the digest of what it read, and when
the first training step after it begins (or a save comes first), the state is digested and
compared with it: whatever upstream runs between the load and that step is covered.

The wrappers read the installed proof's state (:func:`proof_state`) at call time and pass through
when the proof is not installed.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import time
from typing import TYPE_CHECKING, Any, Dict, Optional

from megatron.integrity.digest import record as digest_record
from megatron.overlay import OverlayError, Patch, alias_of, wraps_upstream
from megatron.training_ext.console import process_rank, rank0_line
from megatron.training_ext.resume_proof.compare import compare, grouped
from megatron.training_ext.resume_proof.digest import (
    deferred_training_state,
    digest_training_state,
    shard_sources,
)
from megatron.training_ext.resume_proof.exchange import DigestUnavailable

if TYPE_CHECKING:
    from megatron.training_ext.resume_proof import ResumeProofState

__all__ = [
    "LOG_PREFIX",
    "PATCHES",
    "STATE_KEY",
    "ResumeProofError",
    "digest_of_save",
    "proof_state",
    "prove_pending",
    "write_pending",
]

LOG_PREFIX = "[resume-proof]"
STATE_KEY = "state_digest"  # entry in the checkpoint's common state dict
_ITER_DIR = re.compile(r"(iter_\d{7}|release)$")


class ResumeProofError(SystemExit, OverlayError):
    """The state a load rebuilt differs from the state that was saved (raised on every rank,
    before training; exit status 1 with the message)."""


def proof_state() -> Optional["ResumeProofState"]:
    """The installed proof's state (``None`` while the proof is not installed)."""
    from megatron.training_ext.resume_proof import COMPONENT

    return COMPONENT.state


def _say(line: str) -> None:
    rank0_line(LOG_PREFIX, line)


def write_pending(checkpoint_dir: Any) -> None:
    """Write the digest of the save in progress into ``checkpoint_dir`` (rank 0). The persistent
    tier's ``dist_checkpointing.save`` calls it before its manifest, so the manifest covers it."""
    st = proof_state()
    if st is None or st.pending is None or st.written:
        return
    if not _ITER_DIR.search(str(checkpoint_dir).rstrip("/")):
        return  # e.g. modelopt_state/ inside the iteration directory
    if process_rank() == 0:
        digest_record.write_record(checkpoint_dir, st.pending)
    st.written = True


@contextlib.contextmanager
def digest_of_save(record: Optional[dict]):
    """Within the block, the ``dist_checkpointing.save`` of an iteration directory writes
    ``record`` as its ``state_digest.json`` (before its manifest), as :func:`write_pending` does
    for a save of the live state. The local tier uses it when it writes a local checkpoint as a
    persistent one: the record is the one taken at the local save. A no-op without ``record`` or
    when the proof is off."""
    st = proof_state()
    if st is None or record is None:
        yield
        return
    saved = (st.pending, st.written)
    st.pending, st.written = record, False
    try:
        yield
    finally:
        st.pending, st.written = saved


def _save_dir(args: Any, arguments: Dict[str, Any]) -> Optional[str]:
    """The iteration directory the save just wrote, where ``state_digest.json`` still has to be
    written (``None`` for a local checkpoint, without ``--save``, or when it is not there)."""
    from megatron.training import checkpointing

    non_persistent = arguments.get("non_persistent_ckpt")
    if non_persistent and getattr(args, "non_persistent_ckpt_type", None) == "local":
        return None
    if not args.save:
        return None
    save_dir = args.save
    if non_persistent:
        save_dir = args.non_persistent_global_ckpt_dir or os.path.join(args.save, "non_persistent")
    name = checkpointing.get_checkpoint_name(
        save_dir, arguments["iteration"], release=False, return_base_dir=True
    )
    return name if os.path.isdir(name) else None


def _wrap_save_checkpoint(orig):
    sig = inspect.signature(orig)

    @wraps_upstream(orig)
    def save_checkpoint(*a, **kw):
        """Upstream's; first digests the live training state (resume_proof)."""
        from megatron.training import checkpointing

        st = proof_state()
        if st is None:
            return orig(*a, **kw)
        prove_pending()  # a save right after a load (no step between): the loaded state first
        ba = sig.bind(*a, **kw)
        ba.apply_defaults()
        args = checkpointing.get_args()
        st.deferred = None
        parts = (
            ba.arguments["model"],
            ba.arguments["optimizer"],
            ba.arguments["opt_param_scheduler"],
            args,
            ba.arguments["iteration"],
        )
        try:
            if _async_local_save(args, ba.arguments):  # digested from the snapshot, off the loop
                st.pending = None
                st.deferred = deferred_training_state(*parts, all_replicas=True, lazy=True)
            if st.deferred is None:
                st.pending = digest_training_state(*parts, exchange=st.exchange)
        except (
            DigestUnavailable
        ) as e:  # the save goes ahead, without a digest (its load: not proven)
            st.pending = None
            _say(f"iteration {ba.arguments['iteration']}: no state digest for this save ({e})")
        st.written = False
        try:
            result = orig(*a, **kw)
            if not st.written:
                name = _save_dir(args, ba.arguments)
                if name is not None:
                    write_pending(name)
            return result
        finally:
            st.pending = st.deferred = None

    return save_checkpoint


def _async_local_save(args: Any, arguments: Dict[str, Any]) -> bool:
    """An asynchronous local save of the validated local tier (``--async-save`` with local
    checkpoints and validation on): its digest is taken from the snapshot in the tier's
    background thread (``take_deferred_digest``)."""
    return bool(
        arguments.get("non_persistent_ckpt")
        and getattr(args, "non_persistent_ckpt_type", None) == "local"
        and getattr(args, "async_save", False)
        and getattr(args, "local_tier_validation", True)
    )


def take_deferred_digest():
    """The deferred digest (:class:`~.digest.DeferredDigest`) of the asynchronous local save in
    progress, once (the local tier's save takes it), else ``None``. It records every replica's
    blocks (``all_replicas``) and, once upstream built the save's state dict, where its shards lie
    (``shards``): the taker keeps one sum per block over all ranks
    (:func:`megatron.training_ext.local_tier.async_save.assign_digest`)."""
    st = proof_state()
    if st is None:
        return None
    deferred, st.deferred = getattr(st, "deferred", None), None
    return deferred


def _wrap_dcp_save(orig):
    @wraps_upstream(orig)
    def save(*a, **kw):
        """torch's ``distributed.checkpoint.save``; when it writes the iteration directory of a
        save whose state digest is pending (``save_checkpoint``'s ``fsdp_dtensor`` and
        ``torch_dcp`` formats call it directly, after creating the directory), the digest is
        written first: DCP's ``.metadata`` makes the directory complete, and the tracker follows,
        so a crash at any point leaves no complete checkpoint whose load cannot be proven
        (resume_proof)."""
        st = proof_state()
        if st is not None and st.pending is not None and not st.written:
            writer = kw.get("storage_writer", a[1] if len(a) > 1 else None)
            path = getattr(writer, "path", None) or kw.get("checkpoint_id")
            if path is not None and os.path.isdir(path):
                write_pending(path)
        return orig(*a, **kw)

    return save


def _wrap_generate_state_dict(orig):
    @wraps_upstream(orig)
    def generate_state_dict(*a, **kw):
        """Upstream's; a save's state dict carries the state digest in its common state
        (megatron.training_ext.resume_proof)."""
        state_dict = orig(*a, **kw)
        st = proof_state()
        deferred = None if st is None else getattr(st, "deferred", None)
        if deferred is not None and isinstance(state_dict, dict):
            deferred.shard_sources = _shards_of(state_dict)
            deferred.capture_model(state_dict)  # its blocks are recorded off the training loop
        if st is not None and st.pending is not None and isinstance(state_dict, dict):
            # without this rank's ``seconds``: the common state must be equal on every rank
            # (upstream's validation warns when it is not)
            state_dict[STATE_KEY] = json.dumps(
                {k: v for k, v in st.pending.items() if k != "seconds"}
            )
        return state_dict

    return generate_state_dict


def _shards_of(state_dict: dict) -> list:
    """The shards of an asynchronous local save's state dict and their data
    (:func:`~.digest.shard_sources`; where they lie is worked out off the training loop), for
    the saving ranks to sum the deferred digest: only under the fully parallel distribution (one
    copy of each shard saved per DP group; the ``atomic`` algorithm saves every copy)."""
    from megatron.training import checkpointing

    algo = getattr(checkpointing.get_args(), "non_persistent_local_ckpt_algo", "fully_parallel")
    return shard_sources(state_dict) if algo == "fully_parallel" else []


def _wrap_load_base_checkpoint(orig):
    @wraps_upstream(orig)
    def _load_base_checkpoint(*a, **kw):
        """Upstream's; remembers the digest of what it loaded (resume_proof)."""
        result = orig(*a, **kw)
        st = proof_state()
        if st is not None and isinstance(result, tuple) and len(result) == 4:
            state_dict, name, _release, ckpt_type = result
            if state_dict is not None:
                record = state_dict.get(STATE_KEY) if isinstance(state_dict, dict) else None
                if isinstance(record, (str, bytes)):
                    record = json.loads(record)
                st.loaded = (record, name, ckpt_type)
        return result

    return _load_base_checkpoint


def _tier(ckpt_type: Any, name: Any, args: Any) -> str:
    t = getattr(ckpt_type, "name", str(ckpt_type)).lower()
    if t == "local":
        return "local tier"
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if "non_persistent" in str(name):
        return f"global non-persistent {fmt}"
    return f"persistent {fmt}"


def _restored(args: Any) -> Dict[str, bool]:
    finetune = bool(getattr(args, "finetune", False))
    return {
        "optimizer": not (finetune or getattr(args, "no_load_optim", False)),
        "rng": not (finetune or getattr(args, "no_load_rng", False)),
        # upstream restores the scheduler together with the optimizer (not with --no-load-optim)
        "scheduler": not (
            finetune
            or getattr(args, "no_load_optim", False)
            or getattr(args, "override_opt_param_scheduler", False)
        ),
        "progress": not finetune,
    }


def _saved_record(record: Optional[dict], name: Any, iteration: int, where: str):
    """The digest saved with the loaded checkpoint: the one of its common state, else its
    ``state_digest.json`` (``None``, said on rank 0, when there is none or it is unreadable)."""
    if record is None and name is not None and os.path.isdir(str(name)):
        try:
            record = digest_record.read_record(name)
        except ValueError as e:
            _say(f"iteration {iteration} ({where}): {e}; not proven")
            record = None
    if record is None:
        _say(
            f"iteration {iteration} ({where}): saved without a state digest (upstream "
            "Megatron-LM, or an older version of this fork): not proven"
        )
    return record


def _prove(st: "ResumeProofState", ba: inspect.BoundArguments, result: Any) -> None:
    """Digest the state the load rebuilt and compare it with the saved digest (collective).

    Raises:
        ResumeProofError: on every rank, when they differ and the mode is ``error``.
    """
    from megatron.training import checkpointing

    record, name, ckpt_type = st.loaded
    st.loaded = None
    args = checkpointing.get_args()
    iteration = result[0] if isinstance(result, tuple) else getattr(args, "iteration", 0)
    tier = _tier(ckpt_type, name, args)
    shown_name = (
        getattr(args, "non_persistent_local_ckpt_dir", None) if tier == "local tier" else name
    )
    where = f"{tier} {shown_name}"
    record = _saved_record(record, name, iteration, where)
    if record is None:
        return
    t0 = time.perf_counter()
    try:
        now = digest_training_state(
            ba.arguments["ddp_model"],
            ba.arguments["optimizer"],
            ba.arguments["opt_param_scheduler"],
            args,
            record.get("iteration", iteration) if getattr(args, "finetune", False) else iteration,
            exchange=st.exchange,
        )
    except DigestUnavailable as e:
        _say(
            f"iteration {iteration} ({where}): the loaded state could not be digested ({e}): "
            "not proven"
        )
        return
    cmp = compare(record, now, _restored(args))
    seconds = time.perf_counter() - t0
    skipped = f"; not compared: {'; '.join(cmp.not_compared)}" if cmp.not_compared else ""
    if cmp.ok:
        _say(
            f"iteration {iteration}: {cmp.equal} tensors and the scalar state equal to the "
            f"saved state ({where}, {seconds:.1f} s){skipped}"
        )
        return
    message = (
        f"{LOG_PREFIX} iteration {iteration}: the state loaded from {where} differs from the "
        f"state that was saved: {len(cmp.differ)} of {cmp.equal + len(cmp.differ)} items "
        f"differ: {grouped(cmp.differ)}{skipped}. The checkpoint's writer or this load put wrong "
        f"values in the training state; resuming would train on them. Load another checkpoint "
        f"(--ckpt-step), or pass --resume-proof warn to continue anyway"
    )
    if st.mode == "warn":
        rank0_line("WARNING:", message)
        return
    raise ResumeProofError(message)


def _wrap_load_checkpoint(orig):
    sig = inspect.signature(orig)

    @wraps_upstream(orig)
    def load_checkpoint(*a, **kw):
        """Upstream's (with this fork's fallbacks); then the loaded state is proven equal to the
        saved one (megatron.training_ext.resume_proof)."""
        st = proof_state()
        if st is None:
            return orig(*a, **kw)
        st.loaded = None
        st.unproven = None
        result = orig(*a, **kw)
        ba = sig.bind(*a, **kw)
        ba.apply_defaults()
        if st.loaded is None or ba.arguments.get("skip_load_to_model_and_opt"):
            return result
        # proven when the first training step begins (or at a save before any step): whatever
        # runs between the load and that step (building the data iterators, ...) is covered
        st.unproven = (ba, result, st.loaded)
        st.loaded = None
        return result

    return load_checkpoint


def prove_pending() -> None:
    """Prove the state of the last load, if not yet proven (:func:`_prove`; collective: every
    rank calls it at the same point: the first ``train_step``, a save before it, or the end of
    ``train()`` when it ran no step, e.g. a resume at ``--train-iters``)."""
    st = proof_state()
    if st is None or st.unproven is None:
        return
    ba, result, st.loaded = st.unproven
    st.unproven = None
    _prove(st, ba, result)


def _wrap_train_step(orig):
    @wraps_upstream(orig)
    def train_step(*a, **kw):
        """Upstream's; the first step after a load first proves the state it begins from equal
        to the saved one (megatron.training_ext.resume_proof)."""
        prove_pending()
        return orig(*a, **kw)

    return train_step


def _wrap_train(orig):
    @wraps_upstream(orig)
    def train(*a, **kw):
        """Upstream's; a load that no step or save followed (a resume at ``--train-iters``) is
        proven when it returns (megatron.training_ext.resume_proof)."""
        result = orig(*a, **kw)
        prove_pending()
        return result

    return train


_CKPT = "megatron.training.checkpointing"
_WHY_SAVE = "every save records a topology-independent digest of the live training state"
_WHY_LOAD = "every load is proven equal to the saved state before training"

#: What the component replaces, in order.
PATCHES = (
    Patch(
        f"{_CKPT}.save_checkpoint",
        _wrap_save_checkpoint,
        _WHY_SAVE,
        params=("iteration", "model", "optimizer", "opt_param_scheduler"),
    ),
    Patch(
        "megatron.training.training.save_checkpoint",
        alias_of(f"{_CKPT}.save_checkpoint", only_if_same=True),
        _WHY_SAVE + " (train()'s binding)",
    ),
    Patch(
        "torch.distributed.checkpoint.save",
        _wrap_dcp_save,
        "an fsdp_dtensor or torch_dcp save's digest is written before its .metadata and tracker",
    ),
    Patch(
        f"{_CKPT}.generate_state_dict",
        _wrap_generate_state_dict,
        "the digest travels in the checkpoint's common state (local checkpoints too)",
    ),
    Patch(
        f"{_CKPT}._load_base_checkpoint",
        _wrap_load_base_checkpoint,
        "remembers the digest and the tier of what a load read",
    ),
    Patch(
        f"{_CKPT}.load_checkpoint",
        _wrap_load_checkpoint,
        _WHY_LOAD,
        params=("ddp_model", "optimizer", "opt_param_scheduler", "skip_load_to_model_and_opt"),
    ),
    Patch(
        "megatron.training.training.load_checkpoint",
        alias_of(f"{_CKPT}.load_checkpoint", only_if_same=True, otherwise=_wrap_load_checkpoint),
        _WHY_LOAD + " (train()'s binding)",
    ),
    Patch(
        "megatron.training.training.train_step",
        _wrap_train_step,
        "the proof compares the state as the first training step after a load begins, so that "
        "what runs between the load and that step (e.g. building the data iterators) is covered",
    ),
    Patch(
        "megatron.training.training.train",
        _wrap_train,
        "a load that no training step or save follows (a resume at --train-iters) is proven "
        "when train() returns, so that no load of this fork's saves goes unproven",
    ),
)
