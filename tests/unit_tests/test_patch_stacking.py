"""Upstream attributes replaced by more than one owner: the order of the wrappers (innermost
first) is declared here and checked on the entrypoint's full setup, so a change of fix order or a
new stacked replacement is a decision, not an accident."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

#: target -> owners, innermost (applied first) to outermost. The persistent tier is outermost on
#: the load path among the tiers, so its verification and fallback see the fixed loaders, and the
#: resume proof is outside it, so it proves what the fallback finally loaded; the loss log is
#: outside training_log's fix, so it records the values the fixed function is called with.
DECLARED_STACKS = {
    "megatron.core.dist_checkpointing.serialization.load": [
        "modelopt_moe.legacy_layout",
        "persistent_tier",
    ],
    "megatron.core.dist_checkpointing.load": [
        "modelopt_moe.legacy_layout",
        "rng_state_ep",
        "persistent_tier",
    ],
    "megatron.training.checkpointing.generate_state_dict": [
        "modelopt_state",
        "rng_state_ep",
        "resume_proof",
    ],
    "megatron.training.checkpointing.save_checkpoint": [
        "modelopt_state",
        "async_worker_death",
        "resume_proof",
    ],
    "megatron.training.training.save_checkpoint": [
        "modelopt_state",
        "async_worker_death",
        "resume_proof",
    ],
    "megatron.training.checkpointing._load_base_checkpoint": [
        "modelopt_state",
        "missing_checkpoint_exit",
        "resume_proof",
    ],
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
    "._set_main_param_and_optimizer_states": ["distopt_resume", "distopt_reshard"],
    "megatron.training.checkpointing.load_checkpoint": [
        "distopt_reshard",
        "pretrained_redirect",
        "persistent_tier",
        "resume_proof",
    ],
    "megatron.training.training.load_checkpoint": [
        "distopt_reshard",
        "pretrained_redirect",
        "persistent_tier",
        "resume_proof",
    ],
    "megatron.training.training.training_log": ["training_log", "loss_log"],
    "megatron.training.checkpointing.get_rng_state": ["rng_state_ep", "fsdp_rng"],
    # the teardown fix drops the closed queue; the final-save fix defers train()'s terminate
    # outside it (its deferred terminate goes through async_utils, wrapped by the first)
    # the local tier's asynchronous local saves are finalised in this process (outermost); the
    # persistent worker's requests go on to upstream's function through the two fixes
    "megatron.training.training.maybe_finalize_async_save": [
        "async_queue_teardown",
        "async_final_save",
        "local_tier",
    ],
    "megatron.training.async_utils.maybe_finalize_async_save": [
        "async_queue_teardown",
        "local_tier",
    ],
    # the resume proof compares the state as the first step begins, before the local tier's
    # step wrapper (rerun exit codes, the iteration it trains) runs
    "megatron.training.training.train_step": ["local_tier", "resume_proof"],
    # the final-save fix keeps train()'s worker up inside; a load no step followed is proven
    # when the wrapped train() returns
    "megatron.training.training.train": ["async_final_save", "resume_proof"],
}


@pytest.mark.slow
def test_stacked_replacements_are_the_declared_ones_in_the_declared_order(fixes_cli):
    out = fixes_cli["json"]  # python -m megatron.fixes --json (tests/unit_tests/conftest.py)
    assert out.returncode == 0, out.stderr[-3000:]
    owners = defaultdict(list)
    for r in json.loads(out.stdout)["replacements"]:
        owners[r["target"]].append((r["depth"], r["owner"]))
    stacked = {t: [o for _, o in sorted(v)] for t, v in owners.items() if len(v) > 1}
    assert stacked == DECLARED_STACKS
