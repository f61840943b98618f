"""Pretrain a GPT model (dense, MoE, MLA, MTP) with upstream Megatron-LM and this fork's fixes.

Takes upstream's full command line (``megatron.training.arguments``) plus this fork's flags
(``megatron.training_ext.args``): ``--cpu`` runs the real training loop on CPU with gloo.

    torchrun --nproc-per-node 2 pretrain_gpt.py --cpu --mock-data ...   # any machine
    torchrun --nproc-per-node 8 pretrain_gpt.py --data-path ... ...     # GPUs, as upstream

The fixes (``megatron.fixes.apply()``) are installed before anything else touches upstream.
Processes that ``multiprocessing`` spawns re-run this script as ``__mp_main__``; they skip its
imports of upstream's training modules (see ``SPAWNED``).
"""

from __future__ import annotations

import sys

from megatron.overlay import quiet

if "--cpu" in sys.argv:  # before upstream is imported: its CPU-path warnings, behind one line
    quiet.hide_known_warnings(announce=__name__ == "__main__")

import megatron.fixes
from megatron.training_ext import arg_errors
from megatron.training_ext import args as fork_args

if __name__ == "__main__":  # not in processes that re-import __main__ (multiprocessing spawn)
    megatron.fixes.apply()
    _CPU = fork_args.prepare_cpu_backend(sys.argv)  # activates megatron.cpu and adds its flags

SPAWNED = __name__ == "__mp_main__"
"""True in a process that ``multiprocessing`` spawned from a run of this script: it re-runs the
script under this name before it unpickles its task, and needs none of the training modules.
Every rank spawns one at its first ``torch_dist`` save: the ``Manager`` of megatron-core's
``filesystem_async.get_write_results_queue``. Skipping the imports there saves each rank seconds
of CPU and the memory of a second copy of upstream's modules (README, "Performance")."""

if SPAWNED:  # a rank's helper: killed when the rank dies, even by SIGKILL
    from megatron.training_ext import lifetime

    lifetime.die_with_parent()

if not SPAWNED:
    from functools import partial

    import torch
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import (
        GPTDataset,
        GPTDatasetConfig,
        MockGPTDataset,
    )
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.core.utils import (
        get_attr_wrapped_model,
        get_batch_on_this_cp_rank,
        get_batch_on_this_tp_rank,
    )
    from megatron.training import get_args, get_timers, pretrain, print_rank_0
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.utils.common_utils import (
        get_blend_and_blend_per_split,
        is_first_or_last_pipeline_stage,
    )

    from megatron.training_ext import data_checks
    from megatron.training_ext.shutdown import run_then_destroy_process_groups

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, config, vp_stage=None):
    """The micro-batch for this rank: TP rank 0 reads, the TP group receives by broadcast, and the
    sequence is sliced for context parallelism.

    Returns:
        config: the model's TransformerConfig (decides whether MTP layers live on this rank).

    Returns:
        (tokens, labels, loss_mask, attention_mask, position_ids): [b, s] int64 / float tensors
        (attention_mask may be None), or all None on middle pipeline stages.
    """
    args = get_args()
    mtp_here = mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return (None,) * len(_BATCH_KEYS)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {
            k: (v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()
        }
        batch.setdefault("attention_mask", None)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(
            ignore_virtual=False, vp_stage=vp_stage
        ),
        is_pipeline_last_stage=parallel_state.is_pipeline_last_stage(
            ignore_virtual=False, vp_stage=vp_stage
        ),
    )
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
    )
    return tuple(batch.get(k) for k in _BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Masked sum of per-token losses.

    Args:
        loss_mask: [b, s] float, 1 for tokens that count.
        output_tensor: [b, s] float per-token cross entropy.

    Returns:
        (loss sum, number of counted tokens (int tensor), {'lm loss': [loss, tokens]}).
    """
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rsm = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One forward pass; returns the per-token losses and the loss function to reduce them."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    config = get_attr_wrapped_model(model, "config")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, config, vp_stage
    )
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def is_dataset_built_on_rank(vp_stage=None):
    return (
        is_first_or_last_pipeline_stage(vp_stage)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build GPT train/valid/test datasets (``--mock-data`` or indexed ``--data-path``)."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    if not args.mock_data:  # token ids >= the vocabulary: refused now, not at the first such batch
        data_checks.check_token_ids(
            data_checks.data_prefixes(blend, blend_per_split), args.padded_vocab_size
        )
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config,
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True


def parse_args():
    """Parse and validate the command line (upstream's, then this fork's flags); sets upstream's
    global arguments, tokenizer, writers and timers."""
    args = arg_errors.parse_and_validate_args(  # upstream's; its bare asserts become messages
        parse_and_validate_args,
        fork_args.entrypoint_parser,
        extra_args_provider=fork_args.add_fork_args,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    fork_args.validate_fork_args(args)
    return args


def train(args, store=None, call_wrapper=None, forward_step_func=forward_step) -> None:
    """One start of training for parsed ``args``: the start checks, this fork's components, then
    upstream's ``pretrain``. With in-process restart, once per attempt: ``store`` and
    ``call_wrapper`` as upstream's ``pretrain`` takes them (``megatron.training_ext.inprocess``)."""
    fork_args.check_run_setup(args)
    model_cfg = gpt_config_from_args(args)
    if args.cpu:
        from megatron.cpu import specs

        specs.adapt_model_config(model_cfg)
    if args.restore_modelopt_state:  # quantized checkpoints (tools/quantize.py)
        from megatron.training_ext.modelopt import restore_modelopt_state_pre_wrap_hook

        model_cfg.pre_wrap_hooks.append(restore_modelopt_state_pre_wrap_hook)
    cfg = pretrain_cfg_container_from_args(args, model_cfg)
    fork_args.install_training_hooks(args)
    # destroy the process groups once training is done (gloo can otherwise abort at exit):
    # megatron.training_ext.shutdown
    run_then_destroy_process_groups(
        lambda: pretrain(
            cfg,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step_func,
            store=store,
            inprocess_call_wrapper=call_wrapper,
        )
    )


def main() -> None:
    from megatron.training_ext import lifetime

    lifetime.helpers_die_with_this_process()  # no checkpoint worker outlives this rank
    args = parse_args()
    if args.inprocess_restart:  # NVRx's Wrapper runs train() once per attempt
        from megatron.training_ext import inprocess

        inprocess.run(args, parse_args, train, forward_step)
        return
    train(args)


if __name__ == "__main__":
    main()
