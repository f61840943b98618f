"""The persistent tier you can trust: ``--save`` is never overwritten by a run that did not load it,
``torch_dist`` checkpoints carry checksums by default and are verified before their bytes are used,
and a checkpoint that fails verification gives way to the previous complete one.

Upstream (megatron-core 0.19.2) starts from scratch when ``--load`` has a typo and then overwrites
``--save``; it writes and checks ``integrity.json`` only with ``--verify-integrity`` (SHA-256, all
files hashed by rank 0), so a flipped byte loads silently and a truncated file fails deep in the
load with a bare ``EOFError``. What this module changes, and the flags that restore upstream's
behaviour, are in ``docs/persistent-tier.md``.

The component :data:`COMPONENT` (:class:`PersistentTier`) declares the patch points
(:data:`PATCHES`): ``megatron.core.dist_checkpointing.save``, ``load`` and
``load_common_state_dict`` (package attributes and ``serialization``'s), the checkpoint writers'
``open``, ``get_save_function_and_args`` and ``finish``, and ``read_metadata`` and
``load_checkpoint`` in ``megatron.training.checkpointing`` and ``megatron.training.training``; what
one install decided (the policy, the directories verified, the trackers overruled) is its
:class:`PersistentTierState`.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from megatron.integrity import manifest as mf
from megatron.integrity import persistent_dirs
from megatron.integrity.checksum import written as written_checksums
from megatron.integrity.manifest import CheckpointIntegrityError
from megatron.overlay import Patch, Patcher, alias_of, wraps_upstream
from megatron.overlay.component import Component
from megatron.training_ext import resume_proof
from megatron.training_ext.console import rank0_line

logger = logging.getLogger("megatron.training_ext.persistent_tier")

__all__ = [
    "COMPONENT",
    "LOG_PREFIX",
    "OVERWRITE_FLAG",
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
]

LOG_PREFIX = "[persistent-tier]"
OVERWRITE_FLAG = "--overwrite-save"
TRACKER = persistent_dirs.TRACKER
_ITER = re.compile(r"iter_(\d{7})$")
_NON_PERSISTENT = "non_persistent"  # upstream's _NON_PERSISTENT_CKPT_SUBDIR


# ---------------------------------------------------------------------------------------------
# --save is never overwritten by a run that did not load it
# ---------------------------------------------------------------------------------------------


def saved_checkpoints(directory: Optional[str]) -> List[str]:
    """What in ``directory`` a start from scratch would overwrite: the tracker file, ``iter_*``
    and ``release`` directories, and global non-persistent checkpoints (names, sorted)."""
    if not directory or not os.path.isdir(directory):
        return []
    out = []
    for e in os.scandir(directory):
        if e.name == TRACKER or (e.is_dir() and (_ITER.match(e.name) or e.name == "release")):
            out.append(e.name)
        elif (
            e.is_dir()
            and e.name == _NON_PERSISTENT
            and any(_ITER.match(x) for x in os.listdir(e.path))
        ):
            out.append(e.name + "/")
    return sorted(out)


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _shown(names: List[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_save_dir(args: Any) -> None:
    """Refuse a start that would overwrite checkpoints in ``--save`` without having loaded them.

    Allowed: ``--save`` holds no checkpoint (a first start, also with a ``--load`` that does not
    exist yet: that is how auto-resume begins), or ``--load`` is the same directory as ``--save``
    (upstream then resumes from it), or ``--overwrite-save``.

    Refused (``--save`` holds checkpoints): no ``--load``, or a ``--load`` of another directory
    (a typo, an empty directory, another run's checkpoints, a ``--pretrained-checkpoint`` start).

    Raises:
        SystemExit: naming both directories, what ``--save`` holds, and the choices; raised on
            every rank before any process group or model exists (it only reads the file system).
    """
    save = getattr(args, "save", None)
    if not save or getattr(args, "overwrite_save", False):
        return
    held = saved_checkpoints(save)
    if not held:
        return
    load = getattr(args, "load", None)
    if load and _same_dir(load, save):
        return
    if load is None:
        why = "no --load was given, so this run starts from scratch"
    elif not os.path.exists(load):
        why = f"--load {load} does not exist (a typo?), so this run would start from scratch"
    elif not saved_checkpoints(load):
        why = f"--load {load} holds no checkpoint, so this run would start from scratch"
    else:
        why = f"this run would resume from --load {load}, another directory"
    raise SystemExit(
        f"pretrain_gpt.py: --save {save} already holds checkpoints ({_shown(held)}), but {why}; "
        f"its saves would overwrite them. To resume that run, pass --load {save}. To keep them, "
        f"choose another --save. To start over in {save} and overwrite them, add {OVERWRITE_FLAG}."
    )


# ---------------------------------------------------------------------------------------------
# Checksums at save, verification at load, fallback
# ---------------------------------------------------------------------------------------------


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


def _state() -> PersistentTierState:
    """The installed state, else a fresh default one (the wrappers called while not installed:
    write and verify, nothing remembered)."""
    state = COMPONENT.state
    return state if state is not None else PersistentTierState()


def _ensure_verified(checkpoint_dir: Any, require: bool, group=None) -> None:
    """Verify ``checkpoint_dir`` once per process; collective over ``group`` (default: the world)
    when distributed is initialised, as megatron-core's loads are (every rank of the group reads
    the same directory). Before ``torch.distributed`` exists (``--use-checkpoint-args`` reads the
    checkpoint's args first) only the sizes are checked, on this process alone; the collective
    load verifies later."""
    import torch.distributed as dist

    state = _state()
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
        state = _state()
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


def _previous_complete(failed: Path, tried: set) -> Optional[int]:
    """The newest ``iter_*`` below ``failed``'s iteration in the same directory that is complete
    (:func:`~megatron.integrity.persistent_dirs.is_complete`) and not tried yet, else ``None``."""
    m = _ITER.match(failed.name)
    if not m:
        return None
    below = int(m.group(1))
    cands = [
        it
        for it in persistent_dirs.complete_iterations(failed.parent)
        if it < below and os.path.realpath(failed.parent / f"iter_{it:07d}") not in tried
    ]
    return max(cands, default=None)


# ---------------------------------------------------------------------------------------------
# The tracker is a hint: the newest complete iteration directory is the truth
# ---------------------------------------------------------------------------------------------


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
    the ``args`` saved in the checkpoint's common state (upstream's ``load_common_state_dict``:
    the ``common_state`` object of a ``torch_dist`` checkpoint, or a legacy ``common.pt``) against
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

    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    try:
        with warnings.catch_warnings():  # DCP's "no_dist" load of one small object warns
            warnings.simplefilter("ignore")
            saved = load_common_state_dict(str(iteration_dir)).get("args")
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
        any other stops with the file named (megatron.training_ext.persistent_tier)."""
        problem = persistent_dirs.read_tracker(os.path.dirname(tracker_filename) or ".").problem
        if problem is None:
            return orig(tracker_filename)
        if os.path.realpath(tracker_filename) in _state().overruled:
            return -1, False
        raise SystemExit(
            f"pretrain_gpt.py: {problem}; write the iteration to resume from into it, or remove it "
            f"(the newest complete checkpoint is then found by this fork)"
        )

    return read_metadata


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


def _wrap_load_checkpoint(orig, get_args):
    @wraps_upstream(orig)
    def load_checkpoint(*args, **kwargs):
        """megatron.training load_checkpoint that falls back to the previous complete persistent
        checkpoint when the newest fails verification (megatron.training_ext.persistent_tier)."""
        margs = get_args()
        user_step = getattr(margs, "ckpt_step", None)
        tried: set = set()
        failures: List[CheckpointIntegrityError] = []
        load_dir = getattr(margs, _bound_load_arg(args, kwargs), None)
        if not user_step:
            step, line = resume_point(load_dir)
            if step is not None:
                rank0_line(LOG_PREFIX, line)
                _state().overruled.add(os.path.realpath(os.path.join(load_dir, TRACKER)))
                margs.ckpt_step = step
        if load_dir:
            target = margs.ckpt_step or persistent_dirs.read_tracker(load_dir).iteration
            if target:
                check_model_shape(os.path.join(load_dir, f"iter_{int(target):07d}"), margs)
        try:
            while True:
                try:
                    return orig(*args, **kwargs)
                except CheckpointIntegrityError as e:
                    failed = Path(e.checkpoint_dir)
                    failures.append(e)
                    tried.add(os.path.realpath(failed))
                    nxt = None
                    if not user_step and failed.parent.name != _NON_PERSISTENT:
                        nxt = _previous_complete(failed, tried)
                    if nxt is None:
                        raise CheckpointIntegrityError(
                            failed,
                            e.problems,
                            e.detail,
                            _no_fallback_advice(failed, user_step, failures),
                        ) from None
                    rank0_line(
                        LOG_PREFIX,
                        f"{failed.name} failed verification:\n"
                        + "\n".join(f"  {p}" for p in e.problems)
                        + f"\n{LOG_PREFIX} falling back to the previous complete checkpoint, "
                        f"iter_{nxt:07d}",
                    )
                    margs.ckpt_step = nxt
        finally:
            margs.ckpt_step = user_step

    return load_checkpoint


def _bound_load_arg(args, kwargs) -> str:
    """``load_arg`` of a ``load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg,
    ...)`` call (default ``"load"``)."""
    if "load_arg" in kwargs:
        return kwargs["load_arg"]
    return args[3] if len(args) > 3 else "load"


def _no_fallback_advice(failed: Path, user_step, failures) -> str:
    earlier = (
        ""
        if len(failures) == 1
        else (
            "; earlier checkpoints also failed: "
            + ", ".join(Path(f.checkpoint_dir).name for f in failures[:-1])
        )
    )
    if user_step:
        why = f"--ckpt-step {user_step} asks for this one"
    elif failed.parent.name == _NON_PERSISTENT:
        why = "a global non-persistent checkpoint; remove it to resume from the persistent tier"
    else:
        why = f"no earlier complete checkpoint in {failed.parent} to fall back to"
    return (
        f"{why}{earlier}. Restore the files from a copy, or choose another --ckpt-step; "
        f"--no-verify-integrity loads without checksums, as upstream does (not recommended)"
    )


def _wrap_load_checkpoint_of_run(upstream):
    """Factory: :func:`_wrap_load_checkpoint` of ``upstream`` with the run's arguments."""
    import megatron.training.checkpointing as ckpt

    return _wrap_load_checkpoint(upstream, lambda: ckpt.get_args())


_LOAD_WHY = (
    "a checkpoint that fails verification falls back to the previous complete one, on "
    "every rank together; a missing, damaged or stale tracker is overruled by the newest "
    "complete checkpoint"
)
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


_DC, _SER = "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.serialization"

#: What :func:`install` replaces, in order.
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
) + (
    _OPEN_PATCH,
    *(
        p
        for writer in (_FSA, _NVRX_FSA)  # --async-save uses NVRx's writer, other saves megatron's
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
    Patch(
        "megatron.training.checkpointing.read_metadata",
        _wrap_read_metadata,
        "a damaged tracker stops the start with the file named (exit code 1, upstream exits 0) "
        "unless the newest complete checkpoint overrules it",
    ),
    Patch(
        "megatron.training.checkpointing.load_checkpoint", _wrap_load_checkpoint_of_run, _LOAD_WHY
    ),
    Patch(
        "megatron.training.training.load_checkpoint",
        alias_of("megatron.training.checkpointing.load_checkpoint"),
        _LOAD_WHY + " (train()'s own binding)",
    ),
)


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
        logger.info(
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
