"""Which checkpoint a resume loads, and whether this run's model fits it: the tracker
(``latest_checkpointed_iteration.txt``) is a hint and the newest complete iteration directory the
truth (:func:`resume_point`; upstream exits 0 on a garbage tracker, trains from scratch without
one); a damaged tracker is never read as "nothing to resume" (the wrapper of ``read_metadata``);
a model whose shape differs from the checkpoint's is refused with both values before any tensor
is read (:func:`check_model_shape`, :func:`check_resume_shape`).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from megatron.integrity import persistent_dirs
from megatron.overlay import Patch, wraps_upstream
from megatron.training_ext.console import rank0_line
from megatron.training_ext.persistent_tier.common import (
    LOG_PREFIX,
    NON_PERSISTENT,
    TRACKER,
    tier_state,
)

__all__ = ["MODEL_SHAPE", "PATCHES", "check_model_shape", "check_resume_shape", "resume_point"]


def resume_point(load_dir: Optional[str]) -> tuple:
    """Which iteration a load of ``load_dir`` must use instead of what its tracker says.

    Upstream trusts ``latest_checkpointed_iteration.txt`` alone: missing, it starts from scratch
    (and its saves overwrite the complete checkpoints); garbage, it exits with code 0 having
    trained nothing; naming a deleted directory, it fails with a ``FileNotFoundError``. Here the
    newest complete ``iter_*`` directory wins; its bytes are verified at load as usual, and a
    failure falls back to the previous complete one.

    Returns:
        ``(iteration, line)``: the iteration to load and the line that says why the tracker was
        overruled; ``(None, None)`` when the tracker is right (or names ``release``), or when the
        directory holds no complete checkpoint and no tracker (a first start).

    Raises:
        SystemExit: (code 1) the tracker is unusable and no complete checkpoint exists, naming
            the tracker and what to do. The file system is the same on every rank, so every rank
            raises together, before any collective of the load.
    """
    if not load_dir or not os.path.isdir(load_dir):
        return None, None
    tracker = persistent_dirs.read_tracker(load_dir)
    complete = persistent_dirs.complete_iterations(load_dir)
    newest = complete[-1] if complete else None
    if tracker.release or (tracker.iteration is not None and tracker.iteration == newest):
        return None, None
    path = os.path.join(load_dir, TRACKER)
    if tracker.problem is not None:
        why = tracker.problem
    elif not tracker.present:
        if newest is None:
            return None, None
        why = f"{path} is missing"
    elif tracker.iteration in complete:  # an older complete one; the newer save's tracker write
        why = (  # did not happen (the job was stopped in between)
            f"{path} names iteration {tracker.iteration}, but iter_{newest:07d} is complete and "
            f"newer (to resume from {tracker.iteration}, pass --ckpt-step {tracker.iteration})"
        )
    else:
        d = os.path.join(load_dir, f"iter_{tracker.iteration:07d}")
        why = f"{path} names iteration {tracker.iteration}, but {d} " + (
            "is incomplete" if os.path.isdir(d) else "does not exist"
        )
    if newest is None:
        raise SystemExit(
            f"pretrain_gpt.py: {why}, and {load_dir} holds no complete checkpoint (iter_<N> with "
            f"a finished save: .metadata) to resume from. Restore the checkpoint, or remove "
            f"{path} to start from scratch in {load_dir}"
        )
    return newest, (
        f"{why}: the tracker is a hint, not the truth; resuming from the newest complete "
        f"checkpoint, iter_{newest:07d} (the tracker is rewritten at the next save)"
    )


#: Settings that fix the shape of a model tensor: (args attribute, flag). A resume under another
#: value fails deep in the load (``CheckpointException`` with no word about the setting).
MODEL_SHAPE = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "--num-query-groups"),
    ("kv_channels", "--kv-channels"),
    ("max_position_embeddings", "--max-position-embeddings (with --seq-length)"),
    ("num_experts", "--num-experts"),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("swiglu", "--swiglu"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
)


def check_model_shape(iteration_dir: Union[str, os.PathLike], args: Any) -> None:
    """Refuse, before any tensor is read, a resume whose model shape differs from the checkpoint's:
    the ``args`` saved in the checkpoint's common state (the ``common_state`` object of a
    ``torch_dist`` checkpoint, or a legacy ``common.pt``, read by the restricted unpickler) against
    ``args`` for each setting of :data:`MODEL_SHAPE`. Nothing is checked without readable common
    state (the verification of the load then names what is wrong) or with ``--finetune`` /
    ``--use-checkpoint-args``.

    Raises:
        SystemExit: naming each setting with the checkpoint's value and this run's; the file
            system is the same on every rank, so every rank raises together.
    """
    if getattr(args, "finetune", False) or getattr(args, "use_checkpoint_args", False):
        return
    if not os.path.isdir(iteration_dir):
        return
    import warnings

    from megatron.integrity.persistent import read_common_state

    try:
        with warnings.catch_warnings():  # DCP's "no_dist" load of one small object warns
            warnings.simplefilter("ignore")
            saved = read_common_state(iteration_dir).get("args")
    except Exception:  # noqa: BLE001 - unreadable: the verification of the load names it
        return
    if saved is None:
        return
    diffs = [
        f"{flag}: {_effective(saved, attr)} (checkpoint) vs {_effective(args, attr)} (this run)"
        for attr, flag in MODEL_SHAPE
        if hasattr(saved, attr)
        and hasattr(args, attr)
        and _effective(saved, attr) != _effective(args, attr)
        and not (attr == "max_position_embeddings" and not _learned_positions(args))
    ]
    if diffs:
        raise SystemExit(
            f"pretrain_gpt.py: the model of this run differs from the checkpoint's in "
            f"{iteration_dir}: "
            + "; ".join(diffs)
            + ". Nothing was loaded or changed: give the checkpoint's values to resume it, or "
            "another --save (and no --load) for a new model"
        )


def _effective(args: Any, attr: str) -> Any:
    """The value of ``attr`` the model is built with: ``--num-query-groups`` counts only with
    ``--group-query-attention`` (upstream sets it to the head count during training, so a saved
    checkpoint holds that, while a start holds the flag's default)."""
    if attr == "num_query_groups" and not getattr(args, "group_query_attention", False):
        return getattr(args, "num_attention_heads", None)
    return getattr(args, attr)


def _learned_positions(args: Any) -> bool:
    return getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute"


def _wrap_read_metadata(orig):
    @wraps_upstream(orig)
    def read_metadata(tracker_filename):
        """megatron.training read_metadata that never exits with code 0 on a damaged tracker: one
        overruled by the newest complete checkpoint names nothing (``--ckpt-step`` then decides),
        a global non-persistent one names the newest complete checkpoint beside it
        (:func:`_damaged_non_persistent_tracker`), any other stops with the file named
        (megatron.training_ext.persistent_tier)."""
        problem = persistent_dirs.read_tracker(os.path.dirname(tracker_filename) or ".").problem
        if problem is None:
            return orig(tracker_filename)
        if os.path.realpath(tracker_filename) in tier_state().overruled:
            return -1, False
        non_persistent = _damaged_non_persistent_tracker(tracker_filename, problem)
        if non_persistent is not None:
            return non_persistent
        raise SystemExit(
            f"pretrain_gpt.py: {problem}; write the iteration to resume from into it, or remove it "
            f"(the newest complete checkpoint is then found by this fork)"
        )

    return read_metadata


def _is_global_non_persistent_dir(root: str) -> bool:
    """Whether ``root`` holds global non-persistent checkpoints: upstream's
    ``<save>/non_persistent`` subdirectory, or ``--non-persistent-global-ckpt-dir``."""
    if os.path.basename(os.path.normpath(root)) == NON_PERSISTENT:
        return True
    try:
        from megatron.training.global_vars import get_args

        given = getattr(get_args(), "non_persistent_global_ckpt_dir", None)
    except Exception:  # noqa: BLE001 - no parsed arguments (a tool): only the default name counts
        return False
    return bool(given) and os.path.realpath(given) == os.path.realpath(root)


def _damaged_non_persistent_tracker(tracker_filename: str, problem: str) -> Optional[tuple]:
    """``read_metadata``'s answer for a damaged tracker of global non-persistent checkpoints, else
    ``None``. Upstream writes that tracker in place (``open(..., 'w')``, then the number): a crash
    between the two leaves it empty, and no resume point overrules it (that is the persistent
    tracker's). Here, as for the persistent tracker, the newest complete directory beside it is
    the truth: ``(iteration, False)`` for it, or ``(-1, False)`` when there is none (upstream's
    "no non-persistent checkpoint": the persistent tier loads), each with one line on rank 0."""
    root = os.path.dirname(tracker_filename) or "."
    if not _is_global_non_persistent_dir(root):
        return None
    complete = persistent_dirs.complete_iterations(root)
    if complete:
        rank0_line(
            LOG_PREFIX,
            f"{problem} (a save stopped while writing it): the tracker is a hint, not the truth; "
            f"resuming from the newest complete non-persistent checkpoint, iter_{complete[-1]:07d}",
        )
        return complete[-1], False
    rank0_line(
        LOG_PREFIX,
        f"{problem} and {root} holds no complete checkpoint: no non-persistent checkpoint loads",
    )
    return -1, False


def check_resume_shape(args: Any) -> None:
    """:func:`check_model_shape` of the persistent checkpoint this start would resume
    (``--ckpt-step``, else :func:`resume_point`, else the tracker), called at start before the
    local tier decides anything: a wrong ``--hidden-size`` is named with both values instead of
    the local tier rejecting its checkpoint as another run's and the persistent load failing with
    a shape mismatch. Nothing without ``--load`` or a complete checkpoint in it.

    Raises:
        SystemExit: as :func:`check_model_shape`.
    """
    load = getattr(args, "load", None)
    if not load or not os.path.isdir(load):
        return
    step = getattr(args, "ckpt_step", None)
    if not step:
        try:
            step, _ = resume_point(load)
        except SystemExit:  # an unusable tracker: the load names it, on every rank
            return
        if step is None:
            step = persistent_dirs.read_tracker(load).iteration
    if step:
        check_model_shape(os.path.join(load, f"iter_{int(step):07d}"), args)


#: The patch of ``megatron.training.checkpointing.read_metadata``.
PATCHES = (
    Patch(
        "megatron.training.checkpointing.read_metadata",
        _wrap_read_metadata,
        "a damaged tracker stops the start with the file named (exit code 1, upstream exits 0) "
        "unless the newest complete checkpoint overrules it",
    ),
)
