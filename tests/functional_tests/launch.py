"""Launch the real entrypoint (``pretrain_gpt.py``) under torchrun for functional tests.

CPU (``--cpu``, gloo) by default; on a machine with CUDA and ``MEGATRON_TEST_DEVICE=cuda`` the same
commands run on the GPU(s) without ``--cpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron.training_ext import loss_log
from tests.helpers.dist import free_port

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "pretrain_gpt.py"

#: A tiny GPT: 2 layers, hidden 64, dropout on (upstream defaults 0.1), 20 iterations of 4 samples.
TINY_GPT = (
    "--tokenizer-type NullTokenizer --vocab-size 257 --num-layers 2 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
    "--train-iters 20 --seed 1234"
).split()


def device(env: dict | None = None) -> str:
    """'cuda' when asked for (``MEGATRON_TEST_DEVICE=cuda`` in ``env`` or the environment) and a
    GPU is present, else 'cpu'."""
    if (env or {}).get("MEGATRON_TEST_DEVICE", os.environ.get("MEGATRON_TEST_DEVICE")) == "cuda":
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


@dataclass
class Run:
    returncode: int
    output: str
    losses: dict[int, dict]

    def first_iteration(self) -> int:
        return min(self.losses) if self.losses else -1


def run_pretrain(workdir: Path, *args: str, nproc: int = 2, mock: bool = True, loss_file: str = "losses.jsonl",
                 timeout: float = 600, env: dict | None = None, check: bool = True) -> Run:
    """Run ``torchrun --nproc-per-node N pretrain_gpt.py [--cpu] TINY_GPT ARGS --loss-log FILE``.

    Returns the exit code, the combined output and the losses this run logged (iteration -> record).
    Raises AssertionError (with the output tail) when ``check`` and the run failed.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / loss_file
    if log.exists():
        log.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(ENTRY)]
    if device(env) == "cpu":
        cmd.append("--cpu")
    else:
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            cmd += ["--transformer-impl", "local"]
    cmd += TINY_GPT + (["--mock-data"] if mock else []) + list(args) + ["--loss-log", str(log)]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                "CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=workdir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    losses = loss_log.read(str(log)) if log.exists() else {}
    result = Run(proc.returncode, proc.stdout, losses)
    if check:
        assert proc.returncode == 0, f"pretrain_gpt.py failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    return result


def both_tiers_at(work: Path, iteration: int) -> list[str]:
    """Arguments for a run of ``iteration`` iterations that ends with a local checkpoint
    (``work/local``, replicated: jump 1, factor 2) and a persistent ``torch_dist`` one
    (``work/ckpt``) of that same iteration: the local one at the last step, the persistent one at
    the end of training (``iteration`` is not a multiple of the save interval)."""
    return ["--train-iters", str(iteration), "--save", str(work / "ckpt"), "--save-interval", "1000",
            "--ckpt-format", "torch_dist", "--non-persistent-ckpt-type", "local",
            "--non-persistent-save-interval", str(iteration),
            "--non-persistent-local-ckpt-dir", str(work / "local"),
            "--replication", "--replication-jump", "1", "--replication-factor", "2"]


def assert_bitwise_equal(reference: dict[int, dict], other: dict[int, dict], iterations: range,
                         keys=("lm loss", "grad norm")) -> None:
    """Assert that ``other`` logged exactly (float.hex) the same values as ``reference``."""
    missing = [i for i in iterations if i not in other]
    assert not missing, f"iterations {missing} not logged by the resumed run"
    diffs = [(i, k, reference[i][k], other[i][k]) for i in iterations for k in keys
             if reference[i].get(k) != other[i].get(k)]
    assert not diffs, "not bitwise equal (iteration, key, reference, resumed):\n" + "\n".join(map(str, diffs))
