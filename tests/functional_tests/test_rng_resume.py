"""Resume of an MoE run on the real entrypoint is bitwise, RNG streams included (fixes
``rng_state_ep`` and the CPU backend's generator routing).

MoE with 4 experts on ``pretrain_gpt.py --cpu`` with 2 ranks, dropout on, the router drawing from
the expert-parallel stream (``--moe-router-force-load-balancing``) and input jitter
(``--moe-input-jitter-eps``): one uninterrupted 10-iteration run saving at 5 and 10, and a run
resumed from its checkpoint 5. Checked at EP=2 and EP=1: iterations 6-10 log exactly the same
losses and grad norms, each rank's tracker streams after the load equal (SHA-256) what that rank
saved (read back from the checkpoint), and upstream's "CPU RNG state changed within GPU RNG
context" warning never appears. The unfixed upstream paths are shown failing by the unit tests
(``tests/unit_tests/fixes/test_rng_state_ep.py``, ``tests/unit_tests/cpu/test_rng_routing.py``).
"""

from __future__ import annotations

import io
import re
import shutil

import pytest

from tests.helpers.launch import assert_bitwise_equal, run_pretrain

pytestmark = pytest.mark.slow

MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--disable-bias-linear",
    "--moe-router-force-load-balancing",
    "--moe-input-jitter-eps",
    "0.1",
    "--hidden-dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
    "--train-iters",
    "10",
    "--save-interval",
    "5",
    "--ckpt-format",
    "torch_dist",
]
WARNING = "CPU RNG state changed within GPU RNG context"
RESTORED = re.compile(r"rng_state: rank (\d+) loads (.*?); restored (.*)")


def saved_digests(iter_dir, world: int) -> dict[int, dict[str, str]]:
    """Per rank, per stream: digest of the RNG states stored in a torch_dist checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron.fixes.rng_state_ep import PER_RANK_KEY, stream_checksums

    keys = {r: f"{PER_RANK_KEY}/shard_{r}_{world}" for r in range(world)}
    sd = {k: io.BytesIO() for k in keys.values()}
    dcp.load(sd, checkpoint_id=str(iter_dir), no_dist=True)
    out = {}
    for r, k in keys.items():
        states = sd[k]
        if isinstance(states, io.BytesIO):
            states.seek(0)
            states = torch.load(states, weights_only=False)
        while isinstance(states, list):  # the object's data: [this rank's state dict]
            states = states[0]
        out[r] = stream_checksums(states)
    return out


def restored_digests(output: str) -> dict[int, dict[str, str]]:
    out = {}
    for m in RESTORED.finditer(output):
        out[int(m.group(1))] = dict(kv.split("=") for kv in m.group(3).split())
    return out


@pytest.fixture(scope="module", params=["2", "1"], ids=["ep2", "ep1"])
def runs(request, tmp_path_factory):
    ep = ["--expert-model-parallel-size", request.param]
    work = tmp_path_factory.mktemp(f"rng_ep{request.param}")
    straight = run_pretrain(work / "straight", *MOE, *ep, "--save", str(work / "straight" / "ckpt"))
    resume_ckpt = work / "resumed" / "ckpt"
    resume_ckpt.mkdir(parents=True)
    shutil.copytree(work / "straight" / "ckpt" / "iter_0000005", resume_ckpt / "iter_0000005")
    (resume_ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    resumed = run_pretrain(
        work / "resumed", *MOE, *ep, "--save", str(resume_ckpt), "--load", str(resume_ckpt)
    )
    return straight, resumed, saved_digests(resume_ckpt / "iter_0000005", 2)


def test_moe_resume_is_bitwise(runs):
    straight, resumed, _ = runs
    assert resumed.first_iteration() == 6
    assert_bitwise_equal(straight.losses, resumed.losses, range(6, 11))


def test_every_rank_restores_its_own_streams(runs):
    _, resumed, saved = runs
    restored = restored_digests(resumed.output)
    assert sorted(restored) == [0, 1], resumed.output[-3000:]
    for rank in (0, 1):
        assert restored[rank] == saved[rank], (rank, restored[rank], saved[rank])
    assert "its own states, all streams restored" in resumed.output


def test_no_cpu_rng_draws_inside_gpu_rng_forks(runs):
    straight, resumed, _ = runs
    assert WARNING not in straight.output and WARNING not in resumed.output
