"""In-process restart (``--inprocess-restart``): NVRx's ``inprocess.Wrapper`` runs each attempt of
training in the same processes; an exception on any rank (or a collective that fails because a
peer aborted) restarts every rank in seconds instead of a relaunch.

On GPUs the Wrapper is configured as upstream's ``megatron/training/inprocess_restart.py`` does
(and honours ``--inprocess-max-iterations`` and ``--inprocess-progress-watchdog-interval``, which
upstream's configuration drops). On the CPU backend (``--cpu``, or no CUDA device) the CUDA-only
parts have CPU stand-ins: no GPU/NVLink/NIC health checks (NVRx adds them whenever ``LOCAL_RANK``
is set; they need NVML), a finalize thread without a CUDA device (NVRx's ``ThreadedFinalize``
raises without CUDA), ranks per node from ``LOCAL_WORLD_SIZE`` (not ``torch.cuda.device_count()``)
and no CUDA cache release. Process deaths stay with the launcher (``ft_launcher``'s in-job restart).

Every attempt starts clean (:func:`reset_between_attempts`, the Wrapper's finalize, after its
abort): upstream's global state, the loaded-iteration and checkpoint-version globals, the
TensorBoard writer (closed), the data checks' cache; async checkpoint workers are aborted with
upstream's (fixed) ``reset_persistent_async_worker``; the components are installed again by the
next attempt (each install refreshes its state), so its start decision is a fresh process's.
A NaN that the local tier's NaN window turns into exit code 75 restarts in process; the next
attempt sees the bad-tier marker and loads the persistent tier. Each rank prints one line per
attempt (:data:`LOG_PREFIX`). Design and figures: ``docs/inprocess-restart.md``.
"""

import datetime
import gc
import json
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch
from nvidia_resiliency_ext import inprocess

from megatron.overlay.errors import OverlayError
from megatron.training_ext.console import write_line

__all__ = [
    "LOG_PREFIX",
    "AttemptRestart",
    "CpuHealthCheck",
    "CpuThreadedFinalize",
    "build_wrapper",
    "check_args",
    "on_cpu",
    "reset_between_attempts",
    "run",
    "wrapper_kwargs",
]

LOG_PREFIX = "[inprocess-restart]"
_KEY = "megatron_inprocess_restart/attempt{attempt}/rank{rank}"
_STORE_TIMEOUT = datetime.timedelta(seconds=300)  # upstream's, for both stores
_FINALIZE_TIMEOUT = datetime.timedelta(seconds=10)  # upstream's
#: On CPU the reset collects the failed attempt's garbage (seconds on a loaded 2-core machine).
_CPU_FINALIZE_TIMEOUT = datetime.timedelta(seconds=60)


class AttemptRestart(OverlayError, RuntimeError):
    """An attempt that ended with an exit code meaning "start again" (the local tier's NaN window:
    75): raised instead, so that the Wrapper restarts in process."""


def on_cpu(args: Any) -> bool:
    """Whether the CPU stand-ins apply: ``--cpu``, or no usable CUDA device."""
    return bool(getattr(args, "cpu", False)) or not torch.cuda.is_available()


def check_args(args: Any, env: Optional[Dict[str, str]] = None) -> None:
    """Refuse, on every rank before any store or process group exists, an in-process restart
    that cannot work: no ``MASTER_ADDR``/``MASTER_PORT`` (the Wrapper's stores live at
    ``MASTER_PORT + 1`` and ``+ 2``), ``--inprocess-max-iterations`` < 1, or a ``--save`` that
    the attempts would not resume from (``--load`` unset or another directory: the second attempt
    would be refused, its ``--save`` holding checkpoints it does not load).

    Raises:
        SystemExit: naming the flag and what to give instead.
    """
    env = os.environ if env is None else env
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise SystemExit(
            f"pretrain_gpt.py: --inprocess-restart needs {' and '.join(missing)} in the "
            "environment (launch with torchrun or ft_launcher)"
        )
    most = getattr(args, "inprocess_max_iterations", None)
    if most is not None and most < 1:
        raise SystemExit(f"--inprocess-max-iterations must be >= 1 (got {most})")
    save, load = getattr(args, "save", None), getattr(args, "load", None)
    if save and (not load or os.path.realpath(load) != os.path.realpath(save)):
        raise SystemExit(
            f"pretrain_gpt.py: --inprocess-restart with --save {save} needs --load {save}: "
            f"every attempt resumes from the newest checkpoint (got --load {load})"
        )


# ------------------------------------------------------------------------------------------------
# the Wrapper's configuration
# ------------------------------------------------------------------------------------------------


class CpuHealthCheck(inprocess.health_check.HealthCheck):
    """CPU stand-in for ``CudaHealthCheck``: there is no device stream to synchronise."""

    def __call__(self, state):
        return state


class CpuThreadedFinalize(inprocess.finalize.Finalize):
    """CPU stand-in for NVRx's ``ThreadedFinalize`` (which raises ``CUDA is not available``): runs
    ``fn`` in a thread and raises ``TimeoutError`` when it takes longer than ``timeout``."""

    def __init__(self, timeout: datetime.timedelta, fn: Callable[[], Any]):
        self.timeout = timeout
        self.fn = fn

    def __call__(self, state):
        failure = []

        def target():
            try:
                self.fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                failure.append(e)

        thread = threading.Thread(target=target, name="CpuThreadedFinalize", daemon=True)
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():
            raise TimeoutError(f"{self.fn!r} did not finish within {self.timeout}")
        if failure:
            raise failure[0]
        return state


class AbortCheckpoint(inprocess.abort.Abort):
    """Upstream's ``AbortCheckpoint``: abort async checkpointing
    (``megatron.training.async_utils.reset_persistent_async_worker``, looked up at call time:
    the ``async_reset`` fix replaces it)."""

    def __init__(self, async_strategy: str):
        self.async_strategy = async_strategy

    def __call__(self, state):
        from megatron.training import async_utils

        async_utils.reset_persistent_async_worker(self.async_strategy)
        return state


def _ranks_per_node(cpu: bool) -> int:
    """Ranks per node for ``--inprocess-granularity node``: ``LOCAL_WORLD_SIZE`` on CPU (the CPU
    backend's ``torch.cuda.device_count()`` stand-in says 1), the GPU count as upstream."""
    if cpu:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return torch.cuda.device_count()


def wrapper_kwargs(args: Any, cpu: bool, reset: Callable[[], None]) -> Dict[str, Any]:
    """The keyword arguments of ``inprocess.Wrapper``: upstream's configuration
    (``megatron.training.inprocess_restart.inprocess_restart``), with ``reset`` as the finalize
    function and the CPU stand-ins when ``cpu``.

    Args:
        args: the run's arguments (``--inprocess-*``, ``--async-strategy``).
        cpu: use :class:`CpuHealthCheck`, :class:`CpuThreadedFinalize`, ranks per node from
            ``LOCAL_WORLD_SIZE`` and no ``--inprocess-empty-cuda-cache``.
        reset: what runs between attempts (:func:`reset_between_attempts`).
    """
    ip, sec = inprocess, lambda s: datetime.timedelta(seconds=s)
    active = args.inprocess_active_world_size
    reserve = ip.rank_assignment.LayerFlag.RESERVE
    layers = [ip.rank_assignment.Layer(min_ranks=active, max_ranks=active, flag=reserve)]
    if args.inprocess_granularity == "node":
        per_node = _ranks_per_node(cpu)
        layers.append(
            ip.rank_assignment.Layer(
                min_ranks=per_node,
                max_ranks=per_node,
                key_or_fn=lambda _: socket.gethostname(),
                flag=reserve,
            )
        )
    if cpu:
        finalize = [CpuThreadedFinalize(timeout=_CPU_FINALIZE_TIMEOUT, fn=reset)]
        health_check = CpuHealthCheck()
    else:
        finalize = [ip.finalize.ThreadedFinalize(timeout=_FINALIZE_TIMEOUT, fn=reset)]
        if args.inprocess_empty_cuda_cache:
            finalize.append(
                ip.finalize.ThreadedFinalize(timeout=_FINALIZE_TIMEOUT, fn=torch.cuda.empty_cache)
            )
        health_check = ip.health_check.CudaHealthCheck(timeout=sec(10))
    return dict(
        store_kwargs={"timeout": _STORE_TIMEOUT, "port": int(os.environ["MASTER_PORT"]) + 2},
        initialize=ip.Compose(
            ip.initialize.RetryController(
                max_iterations=args.inprocess_max_iterations, min_world_size=active
            ),
            ip.nested_restarter.NestedRestarterHandlingCompleted(),
        ),
        abort=ip.Compose(
            ip.abort.AbortTransformerEngine(),
            ip.abort.AbortTorchDistributed(),
            AbortCheckpoint(args.async_strategy),
            ip.nested_restarter.NestedRestarterHandlingStarting(),
        ),
        completion=ip.nested_restarter.NestedRestarterFinalized(),
        terminate=ip.nested_restarter.NestedRestarterAborted(),
        health_check=health_check,
        rank_assignment=ip.rank_assignment.Tree(layers=layers),
        finalize=ip.Compose(*finalize),
        heartbeat_interval=sec(args.inprocess_heartbeat_interval),
        heartbeat_timeout=sec(args.inprocess_heartbeat_timeout),
        barrier_timeout=sec(args.inprocess_barrier_timeout),
        completion_timeout=sec(args.inprocess_completion_timeout),
        monitor_process_interval=sec(args.inprocess_monitor_process_interval),
        monitor_thread_interval=sec(args.inprocess_monitor_thread_interval),
        progress_watchdog_interval=sec(args.inprocess_progress_watchdog_interval),
        last_call_wait=sec(args.inprocess_last_call_wait),
        soft_timeout=sec(args.inprocess_soft_timeout),
        hard_timeout=sec(args.inprocess_hard_timeout),
        termination_grace_time=sec(args.inprocess_termination_grace_time),
        enabled=True,
    )


def build_wrapper(args: Any, cpu: bool, reset: Callable[[], None]) -> "inprocess.Wrapper":
    """``inprocess.Wrapper(**wrapper_kwargs(...))``; on CPU with ``LOCAL_RANK`` hidden while it
    is built (the Wrapper adds NVML-based GPU, NVLink and NIC checks to its restart health check
    whenever ``LOCAL_RANK`` is set, and no argument turns them off)."""
    kwargs = wrapper_kwargs(args, cpu, reset)
    hidden = os.environ.pop("LOCAL_RANK", None) if cpu else None
    try:
        return inprocess.Wrapper(**kwargs)
    finally:
        if hidden is not None:
            os.environ["LOCAL_RANK"] = hidden


def app_store() -> torch.distributed.TCPStore:
    """The store the attempts' process groups are built on (``MASTER_PORT + 1``, rank 0 hosts it,
    created once per process as upstream's ``maybe_wrap_for_inprocess_restart`` does); the
    attempts' causes are kept in it too."""
    return torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 1,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        is_master=int(os.environ.get("RANK", "0")) == 0,
        timeout=_STORE_TIMEOUT,
        wait_for_workers=True,
        use_libuv=True,
    )


# ------------------------------------------------------------------------------------------------
# between attempts
# ------------------------------------------------------------------------------------------------


def _drop_leftover_groups() -> None:
    """Set to ``None`` every process group ``parallel_state.destroy_model_parallel`` leaves in a
    module global (megatron-core 0.19.2: ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its
    gloo twin; upstream main also ``..._WITH_GTP_REMAT``): a fresh process has none, and a kept
    gloo group keeps its peers blocked in a collective of the failed attempt."""
    from megatron.core import parallel_state

    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)


def _close_rank_monitor_client() -> None:
    """Close the failed attempt's connection to ``ft_launcher``'s rank monitor
    (``--enable-ft-package``) and drop upstream's client: ``ft_integration.setup`` asserts that
    none is set, so every later attempt failed at once with ``rank monitor client is already
    initialized`` (megatron-core 0.19.2) and used up the attempts. Upstream's
    ``ft_integration.shutdown`` is not called: it may update the timeouts (a collective of the
    failed attempt); closing the socket is local, and the next attempt connects anew."""
    from megatron.training import ft_integration

    cli = getattr(ft_integration, "_GLOBAL_RANK_MONITOR_CLIENT", None)
    if cli is None:
        return
    try:
        cli.shutdown_workload_monitoring()
    except OSError:  # the monitor is gone (the launcher is stopping): nothing left to close
        pass
    ft_integration._GLOBAL_RANK_MONITOR_CLIENT = None
    if hasattr(ft_integration, "_is_setup_section_open"):
        ft_integration._is_setup_section_open = False


def reset_between_attempts() -> None:
    """What a fresh process would not have: upstream's global state (``destroy_global_state``:
    arguments, tokenizer, writers, timers, microbatches calculator, memory buffer, model-parallel
    groups, rerun state machine), the TensorBoard writer (closed first: upstream drops it
    unflushed), ``ft_launcher``'s rank monitor client, the loaded-iteration and
    checkpoint-version globals of ``megatron.training.checkpointing`` (upstream keeps them), and
    the data checks' cache; the installed components get a fresh state (the next attempt
    installs them again), and garbage is collected so the failed attempt's process groups are
    freed."""
    from megatron.core import rerun_state_machine
    from megatron.training import checkpointing, global_vars, training

    from megatron.training_ext import data_checks
    from megatron.training_ext.components import declared_components

    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    if args is not None:  # fresh component states: nothing holds the old process groups
        for component in declared_components():
            if component.installed_at == "training" and component.installed:
                component.install(args)
    writer = getattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None)
    if writer is not None and hasattr(writer, "close"):
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - a writer of a failed attempt: best effort
            pass
    training.destroy_global_state()
    _drop_leftover_groups()
    _close_rank_monitor_client()
    rerun_state_machine.destroy_rerun_state_machine()
    checkpointing.set_loaded_iteration(None)
    checkpointing._CHECKPOINT_VERSION = None
    data_checks.clear_cache()
    gc.collect()  # the failed attempt's process groups freed: gloo peers are released


# ------------------------------------------------------------------------------------------------
# the attempts and their lines
# ------------------------------------------------------------------------------------------------


def _short(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def release_frames(e: BaseException) -> None:
    """Clear the local variables of the finished frames that ``e`` (and the exceptions it chains)
    keeps alive: the failed attempt's model, optimizer, data iterators and the process groups they
    hold. gloo has no abort that closes its connections: a peer blocked in a collective is
    released only when this rank's process group objects are freed, which these frames would
    prevent until the Wrapper's barrier, where the peer never arrives. (The Wrapper's finalize
    sees a copy of the exception without its traceback.)"""
    seen, todo = set(), [e]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        todo += [exc.__cause__, exc.__context__]


def _cause_of(e: BaseException) -> str:
    if isinstance(e, inprocess.exception.RestartError) or type(e).__name__ == "RankShouldRestart":
        return f"interrupted by the restart wrapper ({_short(e, 120)})"
    return f"{type(e).__name__}: {_short(e)}"


@dataclass
class _Run:
    """One process's attempts: the store, its rank, and what the last attempt recorded."""

    store: Any
    rank: int = field(default_factory=lambda: int(os.environ.get("RANK", "0")))
    world: int = field(default_factory=lambda: int(os.environ.get("WORLD_SIZE", "1")))
    started: float = field(default_factory=time.time)
    attempt: int = 0
    entered: float = 0.0
    reported: bool = False
    last_cause: Optional[str] = None
    previous: Dict[int, dict] = field(default_factory=dict)
    failed: Optional[BaseException] = None

    def reset(self) -> None:
        """The Wrapper's finalize: the failed attempt's frames released
        (:func:`release_frames`), then :func:`reset_between_attempts`."""
        failed, self.failed = self.failed, None
        if failed is not None:
            release_frames(failed)
        del failed
        reset_between_attempts()

    def record(self, cause: str) -> None:
        """This rank's cause of the end of this attempt, in the store (best effort)."""
        self.last_cause = cause
        value = json.dumps({"time": time.time(), "cause": cause})
        try:
            self.store.set(_KEY.format(attempt=self.attempt, rank=self.rank), value)
        except Exception:  # noqa: BLE001 - the store's host may be gone: the line says less
            pass

    def begin(self, attempt: int) -> None:
        """Start attempt ``attempt``: read every rank's cause of the previous one."""
        self.attempt, self.entered, self.reported = attempt, time.time(), False
        self.previous = {}
        if attempt == 0:
            return
        for r in range(self.world):
            key = _KEY.format(attempt=attempt - 1, rank=r)
            try:
                if self.store.check([key]):
                    self.previous[r] = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - a rank that recorded nothing
                continue

    def cause_text(self) -> tuple:
        """(what ended the previous attempt, the time of the first failure or ``None``)."""
        if not self.previous:
            return "no rank recorded a cause (a hang or a killed peer)", None
        first = min(self.previous, key=lambda r: self.previous[r]["time"])
        text = f"rank {first}: {self.previous[first]['cause']}"
        own = self.previous.get(self.rank)
        if own is not None and first != self.rank:
            text += f" (this rank: {_short(own['cause'], 100)})"
        return text, self.previous[first]["time"]


def _loaded(args: Any) -> str:
    """What the attempt's start loaded: the local tier, ``--load``, or nothing."""
    from megatron.training_ext import local_tier

    iteration = int(getattr(args, "iteration", 0) or 0)
    if iteration <= 0:
        return "no checkpoint (training from iteration 0)"
    if local_tier.loaded_local_iteration() == iteration:
        return f"local checkpoint at iteration {iteration}"
    if getattr(args, "non_persistent_ckpt_type", None) == "local" and not getattr(
        args, "local_tier_validation", True
    ):
        return f"checkpoint at iteration {iteration} (local tier unvalidated)"
    return f"persistent checkpoint at iteration {iteration} ({args.load})"


def _report(run: _Run, args: Any, most: Optional[int]) -> None:
    """The attempt's line, printed by every rank at its first training step."""
    run.reported = True
    of = f" of {most}" if most else ""
    head = f"{LOG_PREFIX} rank {run.rank}: attempt {run.attempt}{of} (pid {os.getpid()})"
    loaded = _loaded(args)
    if run.attempt == 0:
        took = time.time() - run.started
        write_line(f"{head}: first start; loaded {loaded}; start -> first iteration {took:.2f} s")
        return
    cause, fault = run.cause_text()
    since = fault if fault is not None else run.entered
    took = time.time() - since
    what = "fault" if fault is not None else "restart"
    write_line(
        f"{head}: after {cause}; loaded {loaded}; {what} -> first iteration {took:.2f} s",
    )


def _first_step_reporting(run: _Run, forward_step: Callable, most: Optional[int]) -> Callable:
    import functools

    @functools.wraps(forward_step)
    def forward_step_reporting(*a, **kw):
        """The entrypoint's ``forward_step``; the first call of an attempt prints its line."""
        if not run.reported:
            from megatron.training import get_args

            _report(run, get_args(), most)
        return forward_step(*a, **kw)

    return forward_step_reporting


def _attempt_fn(run: _Run, args: Any, parse_args: Callable, train: Callable, forward: Callable):
    """The function the Wrapper runs once per attempt."""
    from megatron.training_ext.local_tier import LOCAL_TIER_BAD_EXIT_CODE

    most = args.inprocess_max_iterations

    def attempt(store, call_wrapper: Optional[inprocess.CallWrapper] = None):
        from megatron.training_ext import lifetime

        lifetime.forks_outlive(False)  # the Wrapper's monitor daemon runs: helpers bound again
        number = call_wrapper.iteration if call_wrapper is not None else 0
        run.begin(number)
        try:
            attempt_args = args if number == 0 else parse_args()
            step = _first_step_reporting(run, forward, most)
            train(attempt_args, store=store, call_wrapper=call_wrapper, forward_step_func=step)
        except SystemExit as e:
            if e.code in (0, None):  # a planned exit (--exit-interval, ...): every rank ends
                return 0
            if e.code == LOCAL_TIER_BAD_EXIT_CODE:
                cause = f"exit code {e.code}: the local tier's NaN window marked it bad"
                run.record(cause)
                raise AttemptRestart(cause) from None
            run.record(f"SystemExit: {_short(e.code)}")
            raise
        except BaseException as e:
            run.record(_cause_of(e))
            run.failed = e  # its frames are released by the reset (no async interrupt there)
            if os.environ.get("MEGATRON_INPROCESS_TRACEBACKS"):
                traceback.print_exc()
            raise
        return 0

    return attempt


def run(args: Any, parse_args: Callable[[], Any], train: Callable[..., Any], forward) -> None:
    """Train under in-process restart (``pretrain_gpt.py --inprocess-restart``).

    Args:
        args: the first attempt's arguments (parsed; upstream's globals set).
        parse_args: parses and validates the command line again (sets upstream's globals): each
            later attempt starts from it, as a fresh process does.
        train: ``train(args, store=..., call_wrapper=..., forward_step_func=...)``: one attempt
            (the start checks, the components installed, ``pretrain``).
        forward: the entrypoint's ``forward_step``.

    Raises:
        SystemExit: code 1 on every rank after the configured attempts
            (``--inprocess-max-iterations``) or when too few ranks are left, with one line per
            rank saying why; a ``SystemExit`` of an attempt (a refused start) as it was raised.
    """
    from megatron.training_ext import arg_errors

    try:
        check_args(args)
    except SystemExit as e:
        raise arg_errors.mistake(str(e.code)) from None
    cpu = on_cpu(args)
    store = app_store()
    state = _Run(store)
    wrapper = build_wrapper(args, cpu, state.reset)
    wrapped = wrapper(_attempt_fn(state, args, parse_args, train, forward))
    from megatron.training_ext import lifetime

    lifetime.forks_outlive(True)  # the Wrapper forks its monitor daemon before the first attempt
    try:
        wrapped(store=store)
    except inprocess.exception.RestartAbort as e:
        most = args.inprocess_max_iterations
        why = (
            f"the configured {most} attempt(s) are used up (--inprocess-max-iterations)"
            if most is not None and state.attempt + 1 >= most
            else f"the restart wrapper aborted ({_short(e, 200)})"
        )
        last = state.last_cause or "unknown"
        write_line(
            f"{LOG_PREFIX} rank {state.rank}: giving up after {state.attempt + 1} attempt(s): "
            f"{why}; the last attempt ended with: {last}"
        )
        raise SystemExit(1) from None
