"""Test-only entrypoint: ``pretrain_gpt.py`` plus the fault hooks of
:mod:`tests.helpers.fault_injection`, armed by ``MEGATRON_TEST_*`` variables (with none
set it trains exactly as ``pretrain_gpt.py`` does). Same command line:

    MEGATRON_TEST_FAULT=rank=1,iteration=4 \\
        torchrun --nproc-per-node 2 tests/functional_tests/pretrain_gpt_faults.py --cpu ...

Same order as ``pretrain_gpt.py``: the fixes, then the CPU backend, then upstream's modules
(``import pretrain_gpt``), then its ``main()``. The fault hooks are installed right after this
fork's training hooks, through a wrapper of
``megatron.training_ext.args.install_training_hooks`` (patch registry, owner ``fault_injection``).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    # as for ``python pretrain_gpt.py``: the repository root first on sys.path, not this directory
    _HERE = Path(__file__).resolve().parent
    if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:
        del sys.path[0]
    sys.path.insert(0, str(_HERE.parents[1]))

import megatron.fixes
from megatron.training_ext import args as fork_args

if __name__ == "__main__":  # not in processes that re-import __main__ (multiprocessing spawn)
    megatron.fixes.apply()
    fork_args.prepare_cpu_backend(sys.argv)  # activates megatron.cpu and adds its flags

from megatron.overlay.registry import Patcher, wraps_upstream

if __name__ != "__mp_main__":  # as pretrain_gpt.SPAWNED: spawned processes need none of these
    import pretrain_gpt  # (imports upstream's training modules)
    from tests.helpers import fault_injection
else:  # a rank's helper, as in pretrain_gpt.py: killed when the rank dies
    from megatron.training_ext import lifetime
    from tests.helpers import fs_trace

    lifetime.die_with_parent()
    from tests.helpers import fault_injection

    fault_injection.install_async_worker_kill_from_env()  # MEGATRON_TEST_KILL_ASYNC_WORKER
    fs_trace.install(main=False)  # the async checkpoint worker's file operations (if armed)

_PATCHER = Patcher("fault_injection")


def install() -> None:
    """Make ``install_training_hooks`` (called by ``pretrain_gpt.main`` after parsing the
    arguments) also install the fault hooks the ``MEGATRON_TEST_*`` variables arm."""
    upstream = fork_args.install_training_hooks

    @wraps_upstream(upstream)
    def install_training_hooks_and_faults(args):
        """This fork's training hooks, then :func:`fault_injection.install_from_env` (so the fault
        hooks wrap the local tier's replacements)."""
        upstream(args)
        fault_injection.install_from_env(args)

    _PATCHER.replace(
        fork_args,
        "install_training_hooks",
        install_training_hooks_and_faults,
        "test entrypoint only: after this fork's training hooks, install the fault "
        "hooks that MEGATRON_TEST_* variables arm (crash, NaN, SIGKILL, async abort).",
    )


def main() -> None:
    install()
    pretrain_gpt.main()


if __name__ == "__main__":
    main()
