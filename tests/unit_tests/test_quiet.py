"""megatron.overlay.quiet: upstream's known-harmless CPU-path warnings hidden behind one line on
rank 0; every other warning still shown; MEGATRON_SHOW_WARNINGS=1 shows them all."""

import os
import subprocess
import sys

_SCRIPT = r"""
import logging, warnings
from megatron.overlay import quiet
print("hidden:", quiet.hide_known_warnings())
warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
warnings.warn("Apex is not installed. Falling back to Torch Norm")
warnings.warn("`torch.jit.script` is deprecated. Please switch to `torch.compile`.", FutureWarning)
warnings.warn("something the user must see")
logging.basicConfig()
logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME")
logging.getLogger("megatron.core.dist_checkpointing.validation").warning(
    "Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
    "Keys only on 1: [], Mismatched keys: [(('args',), <class 'argparse.Namespace'>, "
    "<class 'argparse.Namespace'>)]")
logging.getLogger("megatron.core.dist_checkpointing.validation").warning(
    "Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
    "Keys only on 1: [], Mismatched keys: [(('iteration',), <class 'int'>, <class 'int'>)]")
"""


def _run(**env):
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "MEGATRON_SHOW_WARNINGS")}
    e.update(env)
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=e, timeout=60
    )


def test_known_warnings_hidden_behind_one_line_others_shown():
    r = _run()
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("[warnings] upstream's known-harmless CPU-path warnings are hidden") == 1
    assert "hidden: True" in r.stdout
    assert "something the user must see" in r.stderr
    assert "Mismatched keys: [(('iteration',)" in r.stderr  # a real mismatch is still shown
    for hidden in ("Transformer Engine", "Apex is not", "jit.script", "No CUDA runtime", "'args'"):
        assert hidden not in r.stderr, r.stderr


def test_rank_1_prints_no_line_and_the_switch_shows_everything():
    r = _run(RANK="1")
    assert "[warnings]" not in r.stdout and "Transformer Engine" not in r.stderr
    r = _run(MEGATRON_SHOW_WARNINGS="1")
    assert "hidden: False" in r.stdout and "[warnings]" not in r.stdout
    for shown in ("Transformer Engine", "Apex is not", "jit.script", "No CUDA runtime", "'args'"):
        assert shown in r.stderr, r.stderr
