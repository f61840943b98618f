"""Post-training quantization of a Megatron GPT ``torch_dist`` checkpoint with NVIDIA ModelOpt.

Loads the checkpoint that ``--load`` names (dense or MoE GPT, any TP/PP/EP/ETP), inserts ModelOpt
fake quantizers with the chosen ``--recipe``, calibrates them (max calibration: ``_amax``) on
``--calib-batches`` global batches of an indexed dataset (``--data-path``, as written by
``tools/preprocess_data.py``; ``--mock-data`` for smoke tests), and saves a ``torch_dist``
checkpoint to ``--save`` that holds the weights, the quantizer tensors and the ModelOpt state
(``<ckpt>/modelopt_state``). Train on from it, under any TP/EP/ETP, with::

    torchrun ... pretrain_gpt.py <model flags> --load <quantized ckpt> --restore-modelopt-state \\
        --no-load-optim ...

The quantized checkpoint keeps the iteration and consumed-sample count of the input; it holds no
optimizer or LR-scheduler state (``--no-load-optim`` or ``--finetune`` when training from it).

Takes upstream's full command line (the model flags must match the checkpoint, as for
``pretrain_gpt.py``) plus ``--recipe``/``--calib-batches`` and this fork's ``--cpu`` (CPU/gloo;
fake quantization runs on CPU for the FP8 and INT8 recipes)::

    torchrun --nproc-per-node 2 tools/quantize.py --cpu <model flags> \\
        --load ckpt --save ckpt_fp8 --recipe fp8 --data-path data/corpus --calib-batches 4

Bad input (unknown recipe, a recipe that needs CUDA under ``--cpu``, a missing or already
quantized checkpoint, ``--save`` equal to ``--load`` ...) exits with a message on every rank before
any process group exists.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

if __name__ == "__main__":  # run as a script: the repository root (pretrain_gpt, megatron.fixes)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron.fixes
from megatron.training_ext import args as fork_args

if __name__ == "__main__":
    megatron.fixes.apply()
    _CPU = fork_args.prepare_cpu_backend(sys.argv)


@dataclass(frozen=True)
class Recipe:
    """One ModelOpt quantization recipe.

    Attributes:
        config: name of the config in ``modelopt.torch.quantization`` (a dict of quantizer
            patterns and the calibration algorithm).
        needs_cuda: ModelOpt's fake quantization for it needs CUDA kernels.
        what: one line for ``--help``.
    """

    config: str
    needs_cuda: bool
    what: str


#: ``--recipe`` name -> recipe. Output layer, router and embeddings stay unquantized (ModelOpt's
#: defaults for every config).
RECIPES: dict[str, Recipe] = {
    "fp8": Recipe("FP8_DEFAULT_CFG", False, "FP8 E4M3, per-tensor weight and activation scales"),
    "fp8_per_channel": Recipe(
        "FP8_PER_CHANNEL_PER_TOKEN_CFG",
        False,
        "FP8 E4M3, per-channel weights, per-token dynamic activations",
    ),
    "int8": Recipe("INT8_DEFAULT_CFG", False, "INT8, per-channel weights, per-tensor activations"),
    "int8_sq": Recipe("INT8_SMOOTHQUANT_CFG", False, "INT8 with SmoothQuant"),
    "int8_weight_only": Recipe("INT8_WEIGHT_ONLY_CFG", False, "INT8 per-channel weights only"),
    "nvfp4": Recipe("NVFP4_DEFAULT_CFG", True, "NVFP4 (E2M1, 16-element blocks, FP8 scales)"),
    "mxfp8": Recipe("MXFP8_DEFAULT_CFG", True, "MXFP8 (32-element blocks, E8M0 scales)"),
}


def add_quantize_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider``: this fork's flags plus ``--recipe`` and ``--calib-batches``."""
    fork_args.add_fork_args(parser)
    group = parser.add_argument_group("quantize", "tools/quantize.py")
    group.add_argument(
        "--recipe",
        default=None,
        metavar="NAME",
        help="ModelOpt recipe: "
        + "; ".join(
            f"{k} ({r.what}{', CUDA only' if r.needs_cuda else ''})" for k, r in RECIPES.items()
        ),
    )
    group.add_argument(
        "--calib-batches",
        type=int,
        default=4,
        metavar="N",
        help="calibration: N global batches (--global-batch-size samples each) of "
        "the training split of --data-path, run forward only (default 4)",
    )
    return parser


def _tracked_checkpoint(load_dir: str, ckpt_step: int | None) -> tuple[str, str]:
    """(description, directory) of the checkpoint ``load_checkpoint`` would read from
    ``load_dir``; no collectives. Raises ``SystemExit`` if there is none."""
    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        raise SystemExit(f"quantize.py: no checkpoint in --load {load_dir} (missing {tracker})")
    text = open(tracker).read().strip()
    if ckpt_step:
        text = str(ckpt_step)
    if text == "release":
        sub = "release"
    else:
        try:
            sub = "iter_{:07d}".format(int(text))
        except ValueError:
            raise SystemExit(f"quantize.py: {tracker} holds {text!r}, not an iteration") from None
    path = os.path.join(load_dir, sub)
    if not os.path.isdir(path):
        raise SystemExit(
            f"quantize.py: --load {load_dir} names checkpoint {sub}, but {path} does not exist"
        )
    return sub, path


def validate_quantize_args(args: argparse.Namespace) -> Recipe:
    """Check the command line before any process group exists (every rank runs this).

    Returns:
        the :class:`Recipe` of ``--recipe``.

    Raises:
        SystemExit: with the reason: no or unknown ``--recipe``; a CUDA-only recipe with ``--cpu``;
            ``--load`` without a checkpoint, or with one that already holds ModelOpt state;
            ``--save`` missing or equal to ``--load``; ``--ckpt-format`` other than ``torch_dist``;
            no ``--data-path``/``--mock-data``; ``--calib-batches`` < 1; virtual pipeline.
    """
    if not args.recipe:
        raise SystemExit(f"quantize.py: --recipe is required (one of {', '.join(RECIPES)})")
    recipe = RECIPES.get(args.recipe)
    if recipe is None:
        raise SystemExit(
            f"quantize.py: unknown --recipe {args.recipe!r}; known: {', '.join(RECIPES)}"
        )
    if recipe.needs_cuda and args.cpu:
        raise SystemExit(
            f"quantize.py: --recipe {args.recipe} needs CUDA (ModelOpt's "
            f"{recipe.config} fake quantization has no CPU kernels); drop --cpu and "
            "run on GPUs, or pick one of "
            + ", ".join(k for k, r in RECIPES.items() if not r.needs_cuda)
        )
    if args.calib_batches < 1:
        raise SystemExit(f"quantize.py: --calib-batches must be >= 1 (got {args.calib_batches})")
    if args.ckpt_format != "torch_dist":
        raise SystemExit(f"quantize.py: --ckpt-format must be torch_dist (got {args.ckpt_format})")
    if args.virtual_pipeline_model_parallel_size is not None:
        raise SystemExit(
            "quantize.py: ModelOpt state does not support virtual pipeline parallelism"
        )
    if not args.load:
        raise SystemExit("quantize.py: --load (the torch_dist checkpoint to quantize) is required")
    if not args.save:
        raise SystemExit("quantize.py: --save (where the quantized checkpoint goes) is required")
    if os.path.realpath(args.save) == os.path.realpath(args.load):
        raise SystemExit(f"quantize.py: --save must differ from --load ({args.load})")
    if not args.mock_data and not args.data_path:
        raise SystemExit(
            "quantize.py: calibration data needed: --data-path PREFIX (indexed "
            "dataset from tools/preprocess_data.py) or --mock-data"
        )
    name, path = _tracked_checkpoint(args.load, getattr(args, "ckpt_step", None))
    if name.startswith("iter_") and not getattr(args, "ckpt_step", None):
        args.ckpt_step = int(name[len("iter_") :])  # load exactly the checkpoint named here
    if os.path.isdir(os.path.join(path, "modelopt_state")):
        raise SystemExit(
            f"quantize.py: checkpoint {path} already holds ModelOpt state "
            "(modelopt_state/); quantize the unquantized checkpoint"
        )
    return recipe


def build_model(args: argparse.Namespace) -> list:
    """The model chunks as ``pretrain_gpt.py`` builds them (same config and spec), without DDP
    (mixed-precision wrapper as in training)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args

    model_cfg = gpt_config_from_args(args)
    if args.cpu:
        from megatron.cpu import specs

        specs.adapt_model_config(model_cfg)
    builder = model_cfg.get_builder_cls()(model_cfg)
    return builder.build_distributed_models(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        wrap_with_ddp=False,
        data_parallel_random_init=False,
    )


def calibration_loop(args: argparse.Namespace, model: list):
    """A ModelOpt ``forward_loop``: ``--calib-batches`` global batches of the training split,
    forward only through Megatron's pipeline schedule with ``pretrain_gpt.forward_step``, the model
    in eval mode (no dropout)."""
    import torch
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    from pretrain_gpt import forward_step, train_valid_test_datasets_provider

    samples = args.calib_batches * args.global_batch_size
    # Sizes None for valid/test (one epoch, no sample target): a target of 0 samples on a split
    # that received no documents loops forever in GPTDataset._get_num_epochs.
    train_ds, _, _ = train_valid_test_datasets_provider([samples, None, None])
    loader = build_pretraining_data_loader(train_ds, 0)

    def forward_loop(_unwrapped=None) -> None:
        data = iter(loader) if loader is not None else None
        for m in model:
            m.eval()
        # pretrain_gpt.loss_func's NaN/Inf check goes through the rerun state machine, which
        # only runs inside a training step; calibration has none.
        nan_check, args.check_for_nan_in_loss_and_grad = args.check_for_nan_in_loss_and_grad, False
        try:
            fb = get_forward_backward_func()
            with torch.no_grad():
                for _ in range(args.calib_batches):
                    fb(
                        forward_step_func=forward_step,
                        data_iterator=data,
                        model=model,
                        num_microbatches=get_num_microbatches(),
                        seq_length=args.seq_length,
                        micro_batch_size=args.micro_batch_size,
                        decoder_seq_length=args.decoder_seq_length,
                        forward_only=True,
                    )
        finally:
            args.check_for_nan_in_loss_and_grad = nan_check
            for m in model:
                m.train()

    return forward_loop


def quantize(args: argparse.Namespace, recipe: Recipe) -> dict:
    """Load ``--load``, quantize and calibrate with ``recipe``, save to ``--save`` (every rank,
    after ``initialize_megatron``).

    Returns:
        this rank's quantizer counts (:func:`megatron.training_ext.modelopt.quantizer_summary`).

    Raises:
        RuntimeError: on every rank (the ranks agree through one ``all_gather_object`` before
            saving): no quantizer enabled anywhere, or a static quantizer left without an amax by
            calibration (an expert that received no token: raise ``--calib-batches``); nothing is
            saved then. Also if the loaded model already carries ModelOpt state, or the saved
            checkpoint lacks ``modelopt_state``.
    """
    import modelopt.torch.quantization as mtq
    import torch
    from megatron.core.utils import unwrap_model
    from megatron.training import checkpointing, print_rank_0

    from megatron.training_ext import modelopt as modelopt_ext

    model = build_model(args)
    iteration, flops = checkpointing.load_checkpoint(model, None, None)
    if modelopt_ext.is_modelopt_converted(model):
        raise RuntimeError(
            f"quantize.py: the model loaded from {args.load} already carries ModelOpt state"
        )
    print_rank_0(
        f"quantize.py: loaded iteration {iteration} from {args.load}; applying "
        f"{recipe.config} ({args.recipe}), calibrating on {args.calib_batches} "
        f"global batch(es)"
    )
    forward_loop = calibration_loop(args, model)
    (chunk,) = unwrap_model(model)
    quantized = mtq.quantize(chunk, getattr(mtq, recipe.config), forward_loop)
    if quantized is not chunk:
        raise RuntimeError("quantize.py: ModelOpt replaced the root module; not supported")
    counts = modelopt_ext.quantizer_summary(model)
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, counts)
    problems = [
        f"rank {r}: {c['static'] - c['calibrated']} quantizer(s) without amax, e.g. "
        f"{c['uncalibrated'][:3]}"
        for r, c in enumerate(everyone)
        if c["uncalibrated"]
    ]
    if sum(c["enabled"] for c in everyone) == 0:
        problems.append(f"{recipe.config} enabled no quantizer on any rank")
    if problems:
        raise RuntimeError(
            "quantize.py: calibration incomplete, nothing saved (raise "
            "--calib-batches if experts saw no tokens):\n  " + "\n  ".join(problems)
        )
    # The quantized checkpoint holds no optimizer state; its args say so, so that loading it
    # does not look for one.
    args.no_save_optim = True
    checkpointing.save_checkpoint(iteration, model, None, None, flops)
    saved = checkpointing.get_checkpoint_name(args.save, iteration, return_base_dir=True)
    if not checkpointing.has_nvidia_modelopt:  # fix modelopt_state (in modelopt_moe) disabled
        from modelopt.torch.opt.plugins import save_sharded_modelopt_state

        save_sharded_modelopt_state(model, saved, (args.ckpt_format, 1))
    torch.distributed.barrier()
    if not os.path.isdir(os.path.join(saved, "modelopt_state")):
        raise RuntimeError(f"quantize.py: {saved} was written without modelopt_state")
    print_rank_0(f"quantize.py: saved quantized checkpoint {saved} (rank 0: {counts})")
    return counts


def main() -> None:
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.initialize import initialize_megatron

    # --save-interval: upstream's validation wants one with --save; quantize.py saves once.
    args = parse_and_validate_args(
        extra_args_provider=add_quantize_args,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer", "save_interval": 1},
    )
    fork_args.validate_fork_args(args)
    recipe = validate_quantize_args(args)
    from megatron.training_ext import persistent_tier

    persistent_tier.install(
        args
    )  # verify --load, write integrity.json with the quantized checkpoint
    initialize_megatron(allow_no_cuda=args.cpu)
    quantize(args, recipe)


if __name__ == "__main__":
    main()
