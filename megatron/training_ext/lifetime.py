"""No process outlives its rank. A rank's helpers (NVRx's persistent checkpoint worker and the
``multiprocessing`` ``Manager`` of the checkpoint write results, both spawned; the writers and
async callers they fork) are stopped by the rank's ``atexit`` only: a rank killed with ``SIGKILL``
(``ft_launcher`` on a fault, a node's OOM killer) leaves them running under init, holding memory
(1.87 GB measured for one killed 2-rank ``--async-save`` run), and every in-job restart adds
more. Here each helper asks the kernel to kill it when its parent dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``; Linux, a no-op elsewhere).

Stdlib only: it runs first in every spawned helper (``pretrain_gpt.py`` as ``__mp_main__``).
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["PARENT_ENV", "die_with_parent", "forks_outlive", "helpers_die_with_this_process"]

#: The pid of the process a helper was started by (set by the parent before it spawns or forks):
#: a helper whose parent died before it could ask to die with it leaves at once.
PARENT_ENV = "MEGATRON_HELPER_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def _prctl_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int | None = None) -> None:
    """In a helper process: be killed (``SIGKILL``) when the process that started it dies; leave
    at once (``os._exit(0)``) if it is already gone. ``parent``: its pid (default
    ``$MEGATRON_HELPER_PARENT_PID``, which a spawned helper inherits). The helper then names
    itself as the parent of its own helpers."""
    if parent is None:
        value = os.environ.get(PARENT_ENV, "")
        parent = int(value) if value.isdigit() else None
    if not _prctl_pdeathsig():
        return
    if parent is not None and os.getppid() != parent:
        os._exit(0)  # the parent died before the prctl: the kernel would not signal any more
    os.environ[PARENT_ENV] = str(os.getpid())


_forking_parent = [0]


def _before_fork() -> None:
    _forking_parent[0] = os.getpid()


def _after_fork_in_child() -> None:
    if not _outlive[0]:
        die_with_parent(_forking_parent[0])


_outlive = [False]


def forks_outlive(on: bool) -> None:
    """While ``on``, processes this one forks (and what they fork) are not bound to it: NVRx's
    in-process restart monitor, a daemon started by a double fork whose middle process exits at
    once, must outlive its parents to watch the rank (bound, it is killed as soon as it starts
    and the rank waits for it forever). Set it back to False once that daemon runs."""
    _outlive[0] = bool(on)


_installed = [False]


def helpers_die_with_this_process() -> None:
    """In a rank (``pretrain_gpt.py``'s ``main()``): every process it forks from now on dies with
    it, and every process it spawns does too once that process runs this module's
    :func:`die_with_parent` (``pretrain_gpt.py`` does, as ``__mp_main__``). Idempotent."""
    os.environ[PARENT_ENV] = str(os.getpid())
    if not _installed[0]:
        _installed[0] = True
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
