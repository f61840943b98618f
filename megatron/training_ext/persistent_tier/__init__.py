"""The persistent tier you can trust: ``--save`` is never overwritten by a run that did not load it,
``torch_dist`` checkpoints carry checksums by default and are verified before their bytes are used,
and a checkpoint that fails verification gives way to the previous complete one.

Upstream (megatron-core 0.19.2) starts from scratch when ``--load`` has a typo and then overwrites
``--save``; it writes and checks ``integrity.json`` only with ``--verify-integrity`` (SHA-256, all
files hashed by rank 0), so a flipped byte loads silently and a truncated file fails deep in the
load with a bare ``EOFError``. What this package changes, and the flags that restore upstream's
behaviour, are in ``docs/persistent-tier.md``.

The component :data:`COMPONENT` (:class:`PersistentTier`) declares the patch points
(:data:`PATCHES`): ``megatron.core.dist_checkpointing.save``, ``load`` and
``load_common_state_dict`` (package attributes and ``serialization``'s), the checkpoint writers'
``open``, ``get_save_function_and_args`` and ``finish``, and ``read_metadata`` and
``load_checkpoint`` in ``megatron.training.checkpointing`` and ``megatron.training.training``; what
one install decided (the policy, the directories verified, the trackers overruled) is its
:class:`PersistentTierState`. Modules: :mod:`.start` (the start check of ``--save``),
:mod:`.verify` (checksums at save, verification at load), :mod:`.resume` (the resume point and
the model shape), :mod:`.fallback` (``load_checkpoint``'s fallback), :mod:`.restricted` (DCP's
``.metadata``, byte objects and ``common.pt`` read by the restricted unpickler), :mod:`.writer`
(files hashed as written), :mod:`.common` (what they share; the wrappers read this package's
state at call time through :func:`~.common.tier_state`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict

from megatron.integrity import manifest as mf
from megatron.integrity.manifest import CheckpointIntegrityError
from megatron.overlay import Patcher
from megatron.overlay.component import Component
from megatron.training_ext.persistent_tier import fallback, restricted, resume, verify, writer
from megatron.training_ext.persistent_tier.common import LOG_PREFIX, TRACKER
from megatron.training_ext.persistent_tier.resume import (
    MODEL_SHAPE,
    check_model_shape,
    check_resume_shape,
    resume_point,
)
from megatron.training_ext.persistent_tier.start import (
    OVERWRITE_FLAG,
    check_save_dir,
    saved_checkpoints,
)
from megatron.training_ext.persistent_tier.verify import IntegrityPolicy
from megatron.training_ext.persistent_tier.writer import write_with_token

logger = logging.getLogger("megatron.training_ext.persistent_tier")

__all__ = [
    "COMPONENT",
    "LOG_PREFIX",
    "MODEL_SHAPE",
    "OVERWRITE_FLAG",
    "PATCHES",
    "TRACKER",
    "CheckpointIntegrityError",
    "IntegrityPolicy",
    "PersistentTier",
    "PersistentTierState",
    "check_model_shape",
    "check_resume_shape",
    "check_save_dir",
    "install",
    "installed",
    "resume_point",
    "saved_checkpoints",
    "uninstall",
    "write_with_token",
]


@dataclass
class PersistentTierState:
    """What one install of the persistent tier decided (this process).

    Attributes:
        policy: the checksum policy of this install's arguments.
        verified: real path of a checkpoint directory -> what its verification found (each
            directory is verified once per install: a new start verifies afresh).
        overruled: real paths of the trackers :func:`resume_point` overruled (their
            ``read_metadata`` names no iteration: ``--ckpt-step`` decides).
    """

    policy: IntegrityPolicy = field(default_factory=IntegrityPolicy)
    verified: Dict[str, mf.VerifySummary] = field(default_factory=dict)
    overruled: set = field(default_factory=set)


#: What :func:`install` replaces, in order.
PATCHES = verify.PATCHES + writer.PATCHES + resume.PATCHES + fallback.PATCHES + restricted.PATCHES


class PersistentTier(Component[PersistentTierState]):
    """The persistent tier: checksums at save, verification at load, the fallback to the previous
    complete checkpoint and the tracker overruled by the newest complete one; on for every run
    (``--no-verify-integrity`` writes and hashes nothing, sizes are still checked).

    Attributes:
        writer_patcher: what :func:`write_with_token` installs in a process that runs the
            checkpoint writer without having installed the component (a spawned worker); undone
            with the component.
    """

    name = "persistent_tier"
    title = (
        "the persistent tier: integrity.json at every torch_dist save, verified before a load, "
        "fallback to the previous complete checkpoint, the tracker as a hint"
    )
    patches = PATCHES

    def __init__(self) -> None:
        super().__init__()
        self.writer_patcher = Patcher("persistent_tier (writer process)")

    def new_state(self, args: Any) -> PersistentTierState:
        """``args.persistent_integrity`` False (``--no-verify-integrity``): no manifest written,
        sizes still checked at load; ``args.verify_integrity`` (upstream's flag): the manifest is
        required. Missing attributes take those defaults (True, False)."""
        integrity = bool(getattr(args, "persistent_integrity", True))
        return PersistentTierState(
            IntegrityPolicy(
                write=integrity,
                verify=integrity,
                require=bool(getattr(args, "verify_integrity", False)),
            )
        )

    def started(self, state: PersistentTierState) -> None:
        policy = state.policy
        logger.debug(
            "persistent_tier: installed (write=%s verify=%s require=%s)",
            policy.write,
            policy.verify,
            policy.require,
        )

    def stopped(self, state: PersistentTierState) -> None:
        self.writer_patcher.restore()


#: The component (entry point ``persistent_tier``).
COMPONENT = PersistentTier()


def installed() -> bool:
    """Whether the persistent tier is installed in this process."""
    return COMPONENT.installed


def install(args: Any) -> None:
    """Install checksums at save, verification at load and the fallback, for ``args``
    (``install_training_hooks`` installs :data:`COMPONENT`). Idempotent: a second call (a new
    start of training in the same process) replaces the policy and forgets which directories were
    verified and which trackers overruled, so each attempt verifies what it loads afresh.

    Raises:
        UnsupportedUpstreamError: the upstream functions wrapped here are missing or lack the
            parameters relied on (a megatron-core other than the proven ones), naming the
            function; nothing is installed.
    """
    COMPONENT.install(args)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    COMPONENT.uninstall()
