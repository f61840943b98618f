"""``--dist-ckpt-strictness`` for partial ``fsdp_dtensor`` loads (Megatron-LM PR 6271).

With ``--no-strict-fsdp-dtensor-load`` megatron-core 0.19.2 loads through DCP with
``allow_partial_load=True`` and only logs the key differences (``print_diff_in_state_dicts``, at
INFO): every model weight the checkpoint lacks silently keeps its initial value.
:func:`validate_fsdp_dtensor_model_load` backports upstream's later function of that name;
:class:`StrictnessFix` wraps ``print_diff_in_state_dicts`` (called only in the partial-load branch
of ``_load_base_checkpoint``) to run it on the request in the checkpoint's layout. In a raising
mode every rank raises together (:mod:`megatron.overlay.collective`), none is left alone in the
load's collectives.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

import torch

from megatron.fixes.fsdp_dtensor.layout import logger
from megatron.fixes.fsdp_dtensor.legacy_planner import metadata_keys, resolve_layout
from megatron.fixes.fsdp_dtensor.probes import quiet_upstream, swapped, upstream_of
from megatron.overlay import Fix, Patch
from megatron.overlay.collective import RankFailures, agree_on_failures
from megatron.overlay.registry import Patcher, wraps_upstream

STRICTNESS_MODES = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)
_RAISE_MODES = ("assume_ok_unexpected", "raise_unexpected", "raise_all")
_LOG_MODES = ("log_unexpected", "log_all")
_KEY_LIMIT = 100  # keys named in one message
_VALIDATE = "validate_fsdp_dtensor_model_load"


def flatten_keys(obj: Any, prefix: str) -> list[str]:
    """DCP's flattened keys of a nested dict/list (components joined with '.')."""
    if isinstance(obj, dict):
        out = []
        for k, v in obj.items():
            out += flatten_keys(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(obj, list):
        out = []
        for i, v in enumerate(obj):
            out += flatten_keys(v, f"{prefix}.{i}" if prefix else str(i))
        return out
    return [prefix]


def unexpected_model_keys(state_dict: Mapping, metadata) -> set[str]:
    """Model entries this rank requests that the checkpoint lacks (Megatron's 'unexpected' keys;
    keys the checkpoint holds but this rank does not request are normal under PP/TP/EP)."""
    md = metadata_keys(metadata)
    return {k for k in flatten_keys(state_dict.get("model", {}), "model") if k not in md}


def _describe(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_KEY_LIMIT])
    return shown + (f", ... and {len(keys) - _KEY_LIMIT} more" if len(keys) > _KEY_LIMIT else "")


@functools.cache
def partial_load_error() -> type:
    """The class ``PartialLoadError``: upstream's ``CheckpointingException`` that is also a
    :class:`~megatron.overlay.collective.RankFailures` (``failures``: rank -> its message).
    Made on first use, so that importing this module does not import megatron-core."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    class PartialLoadError(CheckpointingException, RankFailures):
        """A partial ``fsdp_dtensor`` load would keep model weights at their initial values
        (raised on every rank)."""

    PartialLoadError.__module__ = __name__
    PartialLoadError.__qualname__ = "PartialLoadError"
    return PartialLoadError


def __getattr__(name: str) -> Any:  # ``strictness.PartialLoadError`` (and pickles of it)
    if name == "PartialLoadError":
        return partial_load_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def handle_unexpected_keys(
    unexpected: Iterable[str],
    strictness: str = "assume_ok_unexpected",
    finetune: bool = False,
    *,
    sync: bool = True,
    checkpoint_path: str | None = None,
) -> set[str]:
    """Apply ``--dist-ckpt-strictness`` to a partial ``fsdp_dtensor`` load.

    Only 'unexpected' keys exist here (requested model weights the checkpoint lacks), so the
    ``*_all`` modes act like ``*_unexpected``.

    * ``raise_*`` and the default ``assume_ok_unexpected``: raise on every rank if any rank has
      such keys (``sync``: the ranks of the default process group agree first, a collective);
    * ``log_*``: warning naming the keys, returns them;
    * ``return_*``: returns them (``FIX.last_unexpected_keys`` keeps them after a load);
    * ``ignore_all``: returns an empty set (the old, silent behaviour);
    * ``finetune``: no check.

    Raises:
        CheckpointingException: (:func:`partial_load_error`, also a ``RankFailures``) in a raising
            mode, naming this rank's keys (up to 100) and the ranks affected.
        ValueError: unknown strictness value.
    """
    mode = getattr(strictness, "value", strictness) or "assume_ok_unexpected"
    if mode not in STRICTNESS_MODES:
        raise ValueError(
            f"unknown --dist-ckpt-strictness {strictness!r}; one of {STRICTNESS_MODES}"
        )
    unexpected = set(unexpected)
    if finetune or mode == "ignore_all":
        return set()
    if mode in _RAISE_MODES:
        mine = (
            [
                f"{len(unexpected)} model weight(s) requested here are not in the checkpoint "
                f"and would keep their initial values: {_describe(unexpected)}"
            ]
            if unexpected
            else []
        )
        failures = agree_on_failures(mine) if sync else ({0: mine} if mine else {})
        if failures:
            here = mine[0] if mine else "no weights are missing on this rank"
            of = f" of {checkpoint_path}" if checkpoint_path else ""
            raise partial_load_error()(
                f"fsdp_dtensor partial load{of} (--no-strict-fsdp-dtensor-load): {here}. Ranks "
                f"with missing weights: {sorted(failures)}. --dist-ckpt-strictness={mode}; use "
                "log_unexpected, return_unexpected or ignore_all to load anyway, or --finetune.",
                failures,
            )
        return set()
    if mode in _LOG_MODES and unexpected:
        logger.warning(
            "fsdp_dtensor partial load: %d model weight(s) are not in the checkpoint and keep "
            "their initial values: %s",
            len(unexpected),
            _describe(unexpected),
        )
    return unexpected


def validate_fsdp_dtensor_model_load(
    state_dict_metadata,
    load_state_dict: Mapping,
    checkpoint_path: str | None = None,
    strict: str = "assume_ok_unexpected",
    *,
    finetune: bool = False,
    sync: bool = True,
) -> set[str]:
    """Backport of upstream's function of this name (Megatron-LM PR 6271): the model weights this
    rank requests that the checkpoint lacks (:func:`unexpected_model_keys`), handled per
    ``strict`` (``--dist-ckpt-strictness``) by :func:`handle_unexpected_keys`; a collective when
    ``sync`` and ``strict`` raises.

    Args:
        state_dict_metadata: DCP ``Metadata`` or its ``state_dict_metadata`` mapping.
        load_state_dict: the state dict about to be loaded (``{'model': ..., ...}``).
        checkpoint_path: named in the error message when given.
    """
    return handle_unexpected_keys(
        unexpected_model_keys(load_state_dict, state_dict_metadata),
        strict,
        finetune,
        sync=sync,
        checkpoint_path=checkpoint_path,
    )


class _PeerConsulted(Exception):
    """Raised by the probe's stand-in collectives: the function asked the other ranks."""


def _raise_consulted(*args, **kwargs):
    raise _PeerConsulted()


#: ``torch.distributed`` collectives a cross-rank agreement could use (the probe's stand-ins)
_COLLECTIVES = (
    "all_gather_object",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "reduce",
    "barrier",
    "monitored_barrier",
)


def _upstream_checks() -> list:
    """Upstream's checks of a partial ``fsdp_dtensor`` load as ``checkpointing`` calls them, in
    order, as ``check(metadata, state_dict)``: ``print_diff_in_state_dicts``, then
    ``validate_fsdp_dtensor_model_load`` where upstream has it (this fix's wrappers peeled
    off)."""
    from megatron.training import checkpointing

    checks = []
    diff = upstream_of(getattr(checkpointing, "print_diff_in_state_dicts", None))
    if diff is not None:
        checks.append(diff)
    validate = upstream_of(getattr(checkpointing, _VALIDATE, None))
    if validate is not None:
        checks.append(
            lambda md, sd: validate(md, sd, "strictness-probe", strict="assume_ok_unexpected")
        )
    return checks


def _run_checks(checks, metadata, state_dict) -> Exception | None:
    """The exception the checks raise (None if none does); a ``TypeError`` (the checks' calling
    convention changed) propagates."""
    try:
        for check in checks:
            check(metadata, state_dict)
    except TypeError:
        raise
    except Exception as exc:  # noqa: BLE001 - what upstream raises is what the probe observes
        return exc
    return None


def upstream_validates_partial_loads() -> bool:
    """Behavioural probe: does upstream's partial ``fsdp_dtensor`` load (its checks run before
    DCP's ``allow_partial_load=True`` load, :func:`_upstream_checks`) stop a load that would
    keep a model weight at its initial value, on every rank together?

    1. Under the default ``--dist-ckpt-strictness`` a request for ``model.module.w`` from a
       checkpoint without it must raise. megatron-core 0.19.2 only logs the difference (False).
    2. In a stand-in world of two ranks (``torch.distributed`` collectives replaced, while the
       probe runs, by functions that record being called), a rank whose own request is complete
       must ask the other ranks before going on: a peer may be the one that raises, and this rank
       would then enter the load's collectives alone. Upstream main (Megatron-LM PR 6271) raises
       only on the ranks with missing keys (False).

    Raises:
        TypeError: upstream's checks take other arguments (the probe cannot tell).
    """
    checks = _upstream_checks()
    request = {"model": {"module.w": torch.zeros(1)}}
    with quiet_upstream():
        if _run_checks(checks, {}, request) is None:
            return False
    import torch.distributed as dist

    world = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "get_world_size": lambda group=None: 2,
        "get_rank": lambda group=None: 0,
        "get_global_rank": lambda group, rank: rank,
        **{name: _raise_consulted for name in _COLLECTIVES if hasattr(dist, name)},
    }
    with swapped(dist, **world), quiet_upstream():
        raised = _run_checks(checks, {"model.module.w": object()}, request)
    return isinstance(raised, _PeerConsulted)


def _load_args(load_state_dict: Mapping) -> Any:
    """Megatron args of this load: those the layout part kept, else the global ones."""
    prep = getattr(load_state_dict, "fsdp_fix", None)
    if prep is not None and prep.args is not None:
        return prep.args
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except Exception:  # noqa: BLE001 - no megatron args outside a run
        return None


def wrap_print_diff_in_state_dicts(upstream):
    """Factory of the replacement of ``checkpointing.print_diff_in_state_dicts`` (called only in
    the partial-load branch of ``_load_base_checkpoint``): the request in the checkpoint's layout
    (:func:`resolve_layout`), upstream's key-difference log, then
    :func:`validate_fsdp_dtensor_model_load` under ``--dist-ckpt-strictness``; the keys it
    reports are kept in :data:`FIX_STATE` (``StrictnessFix.last_unexpected_keys``)."""

    @wraps_upstream(upstream)
    def print_diff_in_state_dicts(state_dict_metadata, load_state_dict, *args, **kwargs):
        """Upstream's key-difference log of the request in the checkpoint's layout, then
        :func:`validate_fsdp_dtensor_model_load` under ``--dist-ckpt-strictness``."""
        resolve_layout(load_state_dict, state_dict_metadata)
        upstream(state_dict_metadata, load_state_dict, *args, **kwargs)
        margs = _load_args(load_state_dict)
        FIX_STATE.last_unexpected_keys = frozenset(
            validate_fsdp_dtensor_model_load(
                state_dict_metadata,
                load_state_dict,
                strict=getattr(margs, "dist_ckpt_strictness", None) or "assume_ok_unexpected",
                finetune=bool(getattr(margs, "finetune", False)),
            )
        )

    return print_diff_in_state_dicts


class _FixState:
    """What the replacement of ``print_diff_in_state_dicts`` reports back (module-level, as the
    replacement is built by a module-level factory).

    Attributes:
        last_unexpected_keys: the keys the last partial load reported (``return_*``/``log_*``
            modes; upstream discards what the wrapped function returns).
    """

    last_unexpected_keys: frozenset = frozenset()


FIX_STATE = _FixState()


class StrictnessFix(Fix):
    """Part of ``fsdp_dtensor``: wraps ``checkpointing.print_diff_in_state_dicts``.

    Attributes:
        last_unexpected_keys: the keys the last partial load reported (``return_*``/``log_*``
            modes; upstream discards what the wrapped function returns).
    """

    name = "fsdp_dtensor.strictness"
    title = (
        "fsdp_dtensor: partial loads (--no-strict-fsdp-dtensor-load) honour "
        "--dist-ckpt-strictness instead of silently keeping initial weights"
    )
    upstream_refs = ("Megatron-LM PR 6271",)
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.training.checkpointing.print_diff_in_state_dicts",
            wrap_print_diff_in_state_dicts,
            "a partial load (--no-strict-fsdp-dtensor-load) silently kept model weights missing "
            "from the checkpoint at their initial values; it now raises on every rank by default "
            "and honours --dist-ckpt-strictness",
            params=("state_dict_metadata", "load_state_dict"),
        ),
    )

    @property
    def last_unexpected_keys(self) -> frozenset:
        return FIX_STATE.last_unexpected_keys

    @last_unexpected_keys.setter
    def last_unexpected_keys(self, keys) -> None:
        FIX_STATE.last_unexpected_keys = frozenset(keys)

    def upstream_behaves(self) -> bool:
        return upstream_validates_partial_loads()

    def install(self, patcher: Patcher) -> None:
        """The declared patch, where upstream has the function (an upstream without
        Megatron-FSDP has no ``fsdp_dtensor`` loads at all)."""
        from megatron.training import checkpointing

        if getattr(checkpointing, "print_diff_in_state_dicts", None) is None:
            return
        super().install(patcher)
