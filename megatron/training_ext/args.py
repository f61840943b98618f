"""This fork's command-line flags, added to upstream's parser through ``extra_args_provider``.

``--cpu`` is special: it must take effect before upstream touches CUDA, so
:func:`prepare_cpu_backend` reads it from ``sys.argv`` before parsing, activates
:mod:`megatron.cpu.runtime` and adds the flags the CPU backend needs (unless given explicitly).
"""

from __future__ import annotations

import argparse
import logging
import os

from megatron.training_ext.components import declared_components

logger = logging.getLogger("megatron.training_ext")

#: Flags ``--cpu`` adds when the command line does not set them: gloo, CPU initialisation, the local
#: (non-Transformer-Engine) layer spec and no fused CUDA kernels.
CPU_DEFAULT_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--distributed-backend", "gloo"),
    ("--use-cpu-initialization",),
    ("--transformer-impl", "local"),
    ("--no-gradient-accumulation-fusion",),
    ("--no-bias-gelu-fusion",),
    ("--no-bias-swiglu-fusion",),
    ("--no-bias-dropout-fusion",),
    ("--no-masked-softmax-fusion",),
    ("--no-persist-layer-norm",),
    ("--no-rope-fusion",),
    ("--no-gradient-reduce-div-fusion",),
)
#: Values of upstream flags the CPU backend cannot honour: flag -> allowed values.
CPU_REQUIRED_VALUES = {
    "--distributed-backend": {"gloo"},
    "--transformer-impl": {"local"},
}
CPU_REJECTED_FLAGS = {
    "--fp8-format": "FP8 needs Transformer Engine and a GPU",
    "--fp8-param-gather": "FP8 parameters need Transformer Engine and a GPU",
    "--sequence-parallel": "sequence parallelism needs the fused LayerNorm of TE/apex",
    "--tp-comm-overlap": "communication overlap needs Transformer Engine userbuffers",
}


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


#: What ``--async-save`` needs on CPU: upstream 0.19.2 turns ``--async-save`` off without the
#: persistent worker (``validate_args``: "not supported without --use-persistent-ckpt-worker"), and
#: NVRx's persistent worker initialises CUDA (``rank % torch.cuda.device_count()``: it dies and the
#: trainer waits for it forever) unless it runs in CPU shared-memory mode.
CPU_ASYNC_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--use-persistent-ckpt-worker",),
    ("--async-ckpt-use-cpu-shm",),
)


def _cpu_async_flags(argv: list[str]) -> tuple[tuple[str, ...], ...]:
    """:data:`CPU_ASYNC_FLAGS` when ``argv`` asks for ``--async-save``, else nothing.

    Raises:
        SystemExit: ``--async-strategy mcore`` with ``--async-save`` (megatron-core's persistent
            worker always initialises CUDA and dies on CPU; its per-save worker is disabled
            upstream).
    """
    if "--async-save" not in argv:
        return ()
    if _flag_value(argv, "--async-strategy") == "mcore":
        raise SystemExit(
            "pretrain_gpt.py --cpu: --async-save --async-strategy mcore is not supported "
            "on CPU: megatron-core's checkpoint worker sets a CUDA device at start and "
            "dies, and the trainer would wait for it forever; use the default "
            "--async-strategy nvrx (its worker runs with --async-ckpt-use-cpu-shm), or "
            "drop --async-save"
        )
    return CPU_ASYNC_FLAGS


#: Flags of upstream's FSDP implementations, which refuse ``CUDA_DEVICE_MAX_CONNECTIONS=1``.
_FSDP_FLAGS = ("--use-megatron-fsdp", "--use-torch-fsdp2")


def prepare_cpu_backend(argv: list[str]) -> bool:
    """If ``--cpu`` is on the command line, activate the CPU backend and add its default flags to
    ``argv`` in place.

    Returns:
        True if the CPU backend is active.

    Raises:
        SystemExit: a flag the CPU backend cannot honour (message names it and why); raised on every
            rank, before any process group exists.
    """
    if "--cpu" not in argv:
        return False
    for flag, allowed in CPU_REQUIRED_VALUES.items():
        value = _flag_value(argv, flag)
        if value is not None and value not in allowed:
            raise SystemExit(
                f"pretrain_gpt.py --cpu: {flag} {value} is not supported on CPU "
                f"(use {' or '.join(sorted(allowed))}, or drop --cpu to run on GPUs)"
            )
    for flag, why in CPU_REJECTED_FLAGS.items():
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise SystemExit(f"pretrain_gpt.py --cpu: {flag} is not supported on CPU: {why}")
    added = []
    for entry in CPU_DEFAULT_FLAGS + _cpu_async_flags(argv):
        if not any(a == entry[0] or a.startswith(entry[0] + "=") for a in argv):
            argv.extend(entry)
            added.append(" ".join(entry))
    # Upstream asserts it for TP/CP (a CUDA scheduling knob; meaningless on CPU), and asserts it is
    # not 1 for FSDP (where TP/CP only warn): left unset for FSDP.
    if not any(a in argv for a in _FSDP_FLAGS):
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.cpu import runtime

    runtime.activate()
    import torch

    if os.environ.get("RANK", "0") == "0":  # one line for the job (before any process group)
        logger.info(
            "cpu backend: active (torch %s, %d thread(s) per rank; the CUDA calls it answers are "
            "logged at --logging-level 10); added flags: %s",
            torch.__version__,
            torch.get_num_threads(),
            " ".join(added) or "(none)",
        )
    return True


def add_fork_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for upstream's parser: this fork's flags, in one argument group."""
    group = parser.add_argument_group("megatron-lm-fixed", "flags of this fork (see README)")
    for add in (
        _add_run_flags,
        _add_local_tier_flags,
        _add_proof_flags,
        _add_save_dir_flags,
        _add_unpickling_flags,
    ):
        add(group)
    return parser


def _add_unpickling_flags(group: argparse._ArgumentGroup) -> None:
    """``--unrestricted-unpickling``, ``--accept-shared-local-ckpt-dir``
    (:mod:`megatron.integrity.unpickle`)."""
    group.add_argument(
        "--unrestricted-unpickling",
        action="store_true",
        help="Unpickle checkpoint files without the allowlist of megatron.integrity.unpickle (a "
        "file may then run code): for checkpoints of code the allowlist does not know, e.g. a "
        "custom optimizer's state. Default: a file naming any other global is not loaded.",
    )
    group.add_argument(
        "--accept-shared-local-ckpt-dir",
        action="store_true",
        help="Start although the local checkpoint directory or a file in it is writable by other "
        "users or owned by another user (refused by default: whoever can write it can change "
        "what this job loads).",
    )


def _add_run_flags(group: argparse._ArgumentGroup) -> None:
    """``--cpu``, ``--loss-log``, ``--restore-modelopt-state``."""
    group.add_argument(
        "--cpu",
        action="store_true",
        help="Run the real training loop on CPU with gloo (megatron.cpu backend). "
        "Adds --distributed-backend gloo --use-cpu-initialization "
        "--transformer-impl local and the --no-*-fusion flags unless given.",
    )
    group.add_argument(
        "--loss-log",
        default=None,
        metavar="PATH",
        help="Append each iteration's reduced training losses and grad norm to PATH "
        "as JSON lines, exact (float.hex) and decimal; written by the last rank.",
    )
    group.add_argument(
        "--restore-modelopt-state",
        action="store_true",
        help="Before loading --load (torch_dist), restore the ModelOpt state it holds "
        "(<ckpt>/modelopt_state, e.g. written by tools/quantize.py) into the "
        "freshly built model, so quantizers load and train under any TP/EP/ETP. "
        "Upstream 0.19.2 lacks this step (megatron.post_training).",
    )


def _add_local_tier_flags(group: argparse._ArgumentGroup) -> None:
    """The validated local checkpoint tier (megatron/training_ext/local_tier/)."""
    group.add_argument(
        "--no-local-tier-validation",
        dest="local_tier_validation",
        action="store_false",
        help="With --non-persistent-ckpt-type local: load local checkpoints as "
        "upstream does (no checksum/finiteness verification, no fallback to "
        "the persistent checkpoint, bad-tier markers ignored, no NaN window).",
    )
    group.add_argument(
        "--local-tier-nan-window",
        type=int,
        default=None,
        metavar="N",
        help="With local checkpoints: for N iterations after resuming from the local "
        "tier, a NaN/Inf loss or grad norm marks the local tier bad (marker "
        "file LOCAL_TIER_BAD.json in each rank's local checkpoint directory) and "
        "exits with code 75, so that the next start loads the persistent "
        "checkpoint. Default 50; 0 disables.",
    )
    group.add_argument(
        "--local-tier-run-id",
        default=None,
        metavar="ID",
        help="With local checkpoints: the run identity stored in every local file "
        "and required of the files a start may use. Default: derived from "
        "the settings that define the experiment (seed, data, tokenizer, "
        "model, and a run token kept in --save; see docs/local-tier.md), so a "
        "requeued or restarted "
        "job is the same run and a new experiment is not. Set it to keep "
        "using local checkpoints across a deliberate change of those "
        "settings, or to tell apart runs that share all of them.",
    )


def _add_proof_flags(group: argparse._ArgumentGroup) -> None:
    """Checksums of the persistent tier (megatron/training_ext/persistent_tier/) and the resume
    proof (megatron/training_ext/resume_proof/)."""
    group.add_argument(
        "--no-verify-integrity",
        dest="persistent_integrity",
        action="store_false",
        help="torch_dist checkpoints: write no integrity.json at save and do not "
        "hash the files at load (upstream's default). By default every save "
        "writes per-block xxh3 checksums and every load verifies them first, "
        "falling back to the previous complete checkpoint when the newest "
        "fails. File sizes are checked at load either way. Upstream's "
        "--verify-integrity additionally requires integrity.json at load.",
    )
    group.add_argument(
        "--resume-proof",
        choices=("error", "warn", "off"),
        default="error",
        help="Every save records a digest of the training state (model, optimizer "
        "state in model space, iteration, consumed samples, scheduler, RNG) in "
        "state_digest.json; every load recomputes it under the new topology "
        "before training. error (default): a load whose state differs stops "
        "every rank naming the tensors; warn: continue, loudly; off: neither.",
    )


def _add_save_dir_flags(group: argparse._ArgumentGroup) -> None:
    """One job per ``--save`` (megatron/training_ext/save_hold.py) and ``--overwrite-save``
    (megatron/training_ext/persistent_tier/start.py)."""
    group.add_argument(
        "--take-save-hold",
        action="store_true",
        help="Start even though another job holds --save (its JOB_HOLD.json has a fresh "
        "heartbeat): for a job known to be gone whose hold is not yet stale. Both jobs "
        "would otherwise overwrite each other's checkpoints.",
    )
    group.add_argument(
        "--save-hold-timeout",
        type=float,
        default=None,
        metavar="S",
        help="Seconds without heartbeat after which the hold of a job on another host (or "
        "container) is stale and taken over (default 30; a holder on this host is "
        "taken over as soon as its process is gone).",
    )
    group.add_argument(
        "--no-save-hold",
        dest="save_hold",
        action="store_false",
        help="Write no JOB_HOLD.json and do not check for one (file systems without "
        "atomic link); nothing then stops a second job with the same --save.",
    )
    group.add_argument(
        "--overwrite-save",
        action="store_true",
        help="Start even though --save holds checkpoints that this run does not "
        "load (no --load, or --load of another directory); its saves then "
        "overwrite them. Without it such a start is refused.",
    )


def entrypoint_parser() -> argparse.ArgumentParser:
    """``pretrain_gpt.py``'s argument parser as upstream's ``parse_args`` builds it (upstream's
    flags, then this fork's); :mod:`megatron.training_ext.arg_errors` maps a failed check's
    ``args`` attributes to flags with it."""
    from megatron.training.arguments import add_megatron_arguments

    return add_fork_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def validate_fork_args(args: argparse.Namespace) -> None:
    """Cross-check this fork's flags against upstream's; raises ``SystemExit`` with the reason."""
    if getattr(args, "restore_modelopt_state", False):
        if args.ckpt_format != "torch_dist":
            raise SystemExit(
                f"--restore-modelopt-state needs --ckpt-format torch_dist (got {args.ckpt_format})"
            )
        if args.virtual_pipeline_model_parallel_size is not None:
            raise SystemExit(
                "--restore-modelopt-state: ModelOpt state does not support virtual "
                "pipeline parallelism"
            )

    _validate_local_tier_args(args)
    async_formats = ("torch_dist", "torch_dcp", "fsdp_dtensor")
    if (
        getattr(args, "async_save", False)
        and getattr(args, "ckpt_format", "torch_dist") not in async_formats
    ):
        # upstream raises NotImplementedError only at the first save, after training time is spent
        raise SystemExit(
            f"--async-save needs --ckpt-format {', '.join(async_formats)} (got "
            f"{args.ckpt_format}: upstream has no async save for it and would fail at "
            "the first save); change the format or drop --async-save"
        )
    if (
        getattr(args, "async_save", False)
        and getattr(args, "non_persistent_ckpt_type", None) == "local"
        and not getattr(args, "local_tier_validation", True)
    ):
        # upstream's local tier hands the save to the persistent worker (spawned); the validated
        # tier (the default) writes asynchronous local saves in a background thread instead
        raise SystemExit(
            "--async-save with --non-persistent-ckpt-type local and --no-local-tier-validation "
            "is not supported: upstream's local checkpoint save request holds a process group, "
            "which cannot be sent to the persistent checkpoint worker (TypeError: cannot "
            "pickle 'ProcessGroup' at the first local save); drop --no-local-tier-validation "
            "(the validated local tier saves asynchronously in a background thread) or "
            "--async-save"
        )
    hold_timeout = getattr(args, "save_hold_timeout", None)
    if hold_timeout is not None and not hold_timeout > 0:
        raise SystemExit(f"--save-hold-timeout must be > 0 seconds (got {hold_timeout})")
    if getattr(args, "verify_integrity", False) and not getattr(args, "persistent_integrity", True):
        raise SystemExit(
            "--verify-integrity (integrity.json required at load) and "
            "--no-verify-integrity (no checksums) contradict each other: give one"
        )


def check_run_setup(args: argparse.Namespace) -> None:
    """Refuse, on every rank and before any model is built, a start whose setup would fail late or
    lose work: no training data (:func:`megatron.training_ext.data_checks.check_data_args`), a
    ``--load`` naming an iteration directory, a model shape other than the checkpoint's
    (:func:`megatron.training_ext.persistent_tier.check_resume_shape`), a ``--save`` or local
    checkpoint directory that cannot take a checkpoint (:mod:`megatron.training_ext.start_checks`),
    or a ``--save`` holding checkpoints this run does
    not load (:func:`megatron.training_ext.persistent_tier.check_save_dir`), or a ``--save`` held
    by another job (:func:`megatron.training_ext.save_hold.acquire`, which then holds it).

    Raises:
        SystemExit: with the reason and what to give instead.
    """
    from megatron.integrity import unpickle
    from megatron.training_ext import (
        arg_errors,
        data_checks,
        persistent_tier,
        save_hold,
        start_checks,
    )

    unpickle.POLICY.unrestricted = bool(getattr(args, "unrestricted_unpickling", False))
    try:
        data_checks.check_data_args(args)
        start_checks.check_load_dir(args)
        persistent_tier.check_resume_shape(args)
        start_checks.check_directories(args)
        start_checks.check_local_ownership(args)
        restored = start_checks.check_run_token(args)
        if restored:
            print(restored, flush=True)
        persistent_tier.check_save_dir(args)
        save_hold.acquire(args)  # last: a start refused above leaves no hold behind
    except SystemExit as e:  # every rank names it, also when a launcher stops the others early
        if isinstance(e.code, str):
            raise arg_errors.mistake(e.code) from None
        raise


def _validate_local_tier_args(args: argparse.Namespace) -> None:
    """``--local-tier-nan-window``: >= 0; > 0 needs local-tier validation (markers are honoured
    by the validated load path). Resolves the default (50, or 0 with --no-local-tier-validation)."""
    window = getattr(args, "local_tier_nan_window", None)
    validation = getattr(args, "local_tier_validation", True)
    run_id = getattr(args, "local_tier_run_id", None)
    if run_id is not None and (not run_id.strip() or not validation):
        raise SystemExit(
            "--local-tier-run-id needs a non-empty ID and local-tier validation (it "
            "is checked only by the validated load path; drop --no-local-tier-validation)"
            if run_id.strip()
            else "--local-tier-run-id must not be empty"
        )
    if window is None:
        from megatron.training_ext.local_tier import DEFAULT_NAN_WINDOW

        args.local_tier_nan_window = DEFAULT_NAN_WINDOW if validation else 0
    elif window < 0:
        raise SystemExit(f"--local-tier-nan-window must be >= 0 (got {window})")
    elif window > 0 and not validation:
        raise SystemExit(
            "--local-tier-nan-window > 0 needs local-tier validation: the bad-tier "
            "marker it writes is honoured only by the validated load path (drop "
            "--no-local-tier-validation or set --local-tier-nan-window 0)"
        )


def install_training_hooks(args: argparse.Namespace) -> None:
    """Install the training-path behaviour this fork's flags switch on (called before pretrain):
    every declared component installed by the training hooks (``installed_at == "training"``:
    the persistent tier, the resume proof, the validated local tier, the loss log), in their
    declared order (each after those it names in ``after``), each deciding by its own
    ``enabled(args)``. The CPU backend is installed before parsing (:func:`prepare_cpu_backend`)
    and the CPU MLA spec by the model config (:func:`megatron.cpu.specs.adapt_model_config`).

    Raises:
        UnsupportedUpstreamError: a component's patch point changed upstream, naming it.
        TypeError, ValueError: a component's declaration is wrong (see
            :func:`megatron.training_ext.components.declared_components`).
    """
    for component in declared_components():
        if component.installed_at == "training":
            component.install(args)


#: A command line that switches every component on that flags switch on, for the listing.
LISTING_ARGV = (
    "pretrain_gpt.py",
    "--non-persistent-ckpt-type",
    "local",
    "--loss-log",
    os.devnull,
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
)


def install_for_listing() -> list[str]:
    """Install the declared components as ``pretrain_gpt.py`` would for :data:`LISTING_ARGV`
    (every component a flag switches on), with ``--cpu`` when no CUDA device is present, for
    ``python -m megatron.fixes``; returns the names of the components installed, in declared
    order. A component switched on by something other than flags (``cpu_mla``: an MLA model
    config) stays uninstalled; the listing shows its declaration. Registered as the
    ``megatron.overlay.listing`` entry point ``training_ext`` (pyproject.toml)."""
    import sys

    import torch
    from megatron.training.arguments import parse_args

    argv = list(LISTING_ARGV)
    if not torch.cuda.is_available():
        argv.append("--cpu")
        prepare_cpu_backend(argv)
    saved = sys.argv
    sys.argv = argv
    try:
        args = parse_args(extra_args_provider=add_fork_args)
    finally:
        sys.argv = saved
    validate_fork_args(args)
    install_training_hooks(args)
    return [c.name for c in declared_components() if c.installed]
