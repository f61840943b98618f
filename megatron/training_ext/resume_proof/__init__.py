"""Resume proof: every save records a topology-independent digest of the training state taken from
memory before anything is serialized, and every load recomputes it from the state it rebuilt and
compares when the first training step after the load begins (what runs between the load and
that step, such as building the data iterators, is covered).

Byte checksums prove that a checkpoint's files hold what was written; they cannot see a writer that
wrote the wrong values (Megatron-LM PR 5077: the fully-reshardable distributed optimizer read the
state of every parameter after the first grad bucket at a shifted offset) or a load that puts
values in the wrong place. The digest covers every model tensor and, in model space (the
parameter's global coordinates, whatever the optimizer's flat layout), every optimizer state of it
(``fp32_param``, ``exp_avg``, ``exp_avg_sq``, ...), plus the scalar state (iteration, consumed
samples, scheduler, optimizer step) and the per-rank RNG states (compared when the layout is the
same). The element digest is :mod:`megatron.integrity.digest.state`; the record is
``state_digest.json`` in the iteration directory (:mod:`megatron.integrity.digest.record`) and the
``state_digest`` entry of the checkpoint's common state (so local checkpoints carry it too).
``--resume-proof error|warn|off``.

Modules: :mod:`.digest` (the digest of the live state), :mod:`.exchange` (the ranks' shares
combined), :mod:`.compare` (saved against loaded), :mod:`.hooks` (the wrappers of
``save_checkpoint``, ``generate_state_dict``, ``_load_base_checkpoint`` and ``load_checkpoint`` of
``megatron.training.checkpointing``, and ``training``'s own bindings). Design notes:
``docs/resume-proof.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from megatron.integrity.digest import record as digest_record
from megatron.overlay.component import Component
from megatron.training_ext.resume_proof.compare import SHOWN, Comparison, compare
from megatron.training_ext.resume_proof.digest import (
    FORMAT,
    PartialDigest,
    digest_training_state,
    no_torch_function,
)
from megatron.training_ext.resume_proof.exchange import DigestExchange, DigestUnavailable
from megatron.training_ext.resume_proof.hooks import (
    LOG_PREFIX,
    PATCHES,
    STATE_KEY,
    ResumeProofError,
    digest_of_save,
    write_pending,
)

__all__ = [
    "COMPONENT",
    "DIGEST_FNAME",
    "FORMAT",
    "LOG_PREFIX",
    "PATCHES",
    "SHOWN",
    "STATE_KEY",
    "Comparison",
    "DigestExchange",
    "DigestUnavailable",
    "PartialDigest",
    "ResumeProof",
    "ResumeProofError",
    "ResumeProofState",
    "compare",
    "digest_of_save",
    "digest_training_state",
    "install",
    "no_torch_function",
    "read_record",
    "uninstall",
    "write_pending",
    "write_record",
]

DIGEST_FNAME = digest_record.DIGEST_FNAME
read_record = digest_record.read_record
write_record = digest_record.write_record


@dataclass
class ResumeProofState:
    """The resume proof of one install.

    Attributes:
        mode: ``error`` (a differing load stops every rank) or ``warn``.
        pending: the digest record of the save in progress (``None`` outside a save).
        written: whether ``pending`` was written into the save's iteration directory.
        deferred: the digest share of the asynchronous local save in progress, its sums not
            computed yet (the local tier's background thread finishes it from the snapshot).
        loaded: ``(record or None, checkpoint name, checkpoint type)`` of what the last
            ``_load_base_checkpoint`` read, until ``load_checkpoint`` returns.
        unproven: ``(bound arguments, result, loaded)`` of the last ``load_checkpoint`` whose
            state is still to be proven: at the first ``train_step`` after it, a save before,
            or the end of ``train()`` when it ran no step.
        exchange: combines the ranks' shares of every digest of this install (keeps the layout
            of its cheap exchange between digests).
    """

    mode: str = "error"
    pending: Optional[dict] = None
    written: bool = False
    deferred: Any = None
    loaded: Optional[Tuple[Optional[dict], Any, Any]] = None
    unproven: Optional[Tuple[Any, Any, Any]] = None
    exchange: DigestExchange = field(default_factory=DigestExchange)


def _mode(args: Any) -> str:
    return getattr(args, "resume_proof", "error") or "error"


class ResumeProof(Component[ResumeProofState]):
    """``--resume-proof error|warn|off``: the digest at every save, the proof at every load."""

    name = "resume_proof"
    title = "--resume-proof: every save digests the live state, every load is proven equal to it"
    patches = PATCHES
    after = ("persistent_tier",)  # its load proof wraps the persistent tier's fallbacks

    def enabled(self, args: Any) -> bool:
        return _mode(args) not in ("off",)

    def new_state(self, args: Any) -> ResumeProofState:
        return ResumeProofState(mode=_mode(args))


#: The component (entry point ``resume_proof``).
COMPONENT = ResumeProof()


def install(args: Any) -> None:
    """Install the digest at save and the proof at load for ``args.resume_proof`` (``error``,
    the default and for ``None``: a differing load stops every rank; ``warn``; ``off``: nothing
    is installed, and an installed proof is uninstalled). Idempotent; a second install starts
    from a fresh state."""
    COMPONENT.install(args)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    COMPONENT.uninstall()
