"""ModelOpt quantizer checkpoint layouts mapped onto the model before ``dist_checkpointing.load``.

megatron-core 0.19.2 ``dist_checkpointing.load`` resolves every request by exact key, so a
checkpoint written before ModelOpt had per-expert weight quantizers (one tensor shared by the
experts of a grouped linear, ``...experts.experts.linear_fc1.weight_quantizer._amax``) cannot be
loaded into a per-expert model (``...experts.experts.<e>.linear_fc1.weight_quantizer._amax``), and
a layout that cannot be mapped fails rank-locally deep inside the load. ``load`` is wrapped: it
plans with :func:`plan_quantizer_layout` (pure), the ranks agree in one ``all_gather_object``, and
then either every rank raises :class:`QuantizerLayoutError` (naming the key and both layouts), or
each shared tensor is loaded once and every expert takes its value (logged). Only ``torch_dist``
checkpoints holding quantizer tensors are looked at; the rest goes straight to upstream. Probe:
:func:`probe_upstream_maps_legacy_layout`. Design notes: ``docs/fixes/modelopt_moe.md``.
"""

from __future__ import annotations

import inspect
import io
import logging
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from megatron.fixes.modelopt_moe._probe_group import private_process_group
from megatron.fixes.modelopt_tensors import checkpoint_tensors
from megatron.overlay import Fix, Patch, alias_of, collective
from megatron.overlay.collective import RankFailures
from megatron.overlay.registry import wraps_upstream

logger = logging.getLogger(__name__)

# Sharded keys of expert quantizer tensors. Per-expert: ``<head>experts.<e>.<tail>``; shared by
# the experts of a grouped linear (and the pre-per-expert layout): ``<head>experts.<tail>``.
# ``head`` must end in a path component named exactly ``experts`` (not ``shared_experts``).
_HEAD = r"(?P<head>(?:.*\.)?experts\.)"
_TAIL = r"(?P<tail>[^.\d][^.]*\..*quantizer.*)"
_PER_EXPERT_KEY = re.compile(rf"^{_HEAD}(?P<e>\d+)\.{_TAIL}$")
_SHARED_EXPERT_KEY = re.compile(rf"^{_HEAD}{_TAIL}$")

try:
    from megatron.core.dist_checkpointing.core import CheckpointingException as _CkptError
except ImportError:  # pragma: no cover - megatron-core is a pinned dependency
    _CkptError = RuntimeError


class QuantizerLayoutError(_CkptError, RankFailures):
    """The quantizer layout of a checkpoint cannot be mapped onto the model being loaded.

    Raised on every rank of the load's process group (``failures``: global rank -> messages). A
    subclass of Megatron's ``CheckpointingException``, so existing handlers catch it.
    """


def _walk(container: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, value) of every leaf of nested dicts/lists."""
    if isinstance(container, dict):
        for k, v in container.items():
            yield from _walk(v, path + (k,))
    elif isinstance(container, list):
        for i, v in enumerate(container):
            yield from _walk(v, path + (i,))
    else:
        yield path, container


def _set(container: Any, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        container = container[p]
    container[path[-1]] = value


def _describe(key: str, shape: tuple | None) -> str:
    if _PER_EXPERT_KEY.match(key):
        kind = "per-expert layout"
    elif _SHARED_EXPERT_KEY.match(key):
        kind = "one tensor shared by all experts of the linear"
    else:
        kind = "layout"
    return f"'{key}' ({kind}, global shape {tuple(shape) if shape is not None else '?'})"


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


@dataclass
class _Remap:
    """Per-expert entries on this rank that take their value from one shared checkpoint tensor."""

    ckpt_key: str
    ckpt_shape: tuple
    ckpt_dtype: torch.dtype
    entries: list[tuple[tuple, Any]] = field(default_factory=list)  # (path, ShardedTensor)


@dataclass
class LayoutPlan:
    """What :func:`plan_quantizer_layout` found for one rank.

    Attributes:
        errors: human-readable descriptions of quantizer tensors that cannot be mapped.
        remaps: checkpoint key -> per-expert entries to fill from it (pre-per-expert layout).
    """

    errors: list[str] = field(default_factory=list)
    remaps: dict[str, _Remap] = field(default_factory=dict)


def plan_quantizer_layout(
    sharded_state_dict: Any, ckpt: dict[str, tuple[tuple, torch.dtype]], checkpoint_dir: Any = ""
) -> LayoutPlan:
    """Compare the expert quantizer tensors a rank requests with what the checkpoint holds.

    Pure (no collectives). Requested keys that the checkpoint holds with the same global shape need
    nothing; requests whose quantizer is absent from the checkpoint in every layout are left to
    upstream's strictness handling.

    Args:
        sharded_state_dict: the (nested) sharded state dict passed to ``dist_checkpointing.load``.
        ckpt: key -> (global shape, dtype) of the checkpoint's tensors
            (:func:`megatron.fixes.modelopt_tensors.checkpoint_tensors`).
        checkpoint_dir: for messages only.

    Returns:
        :class:`LayoutPlan` with the remaps (pre-per-expert shared layout -> per-expert model) and
        the errors (layouts that cannot be mapped).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    planner = _LayoutPlanner(ckpt, checkpoint_dir)
    for path, st in _walk(sharded_state_dict):
        if type(st) is ShardedTensor:
            planner.request(path, st)
    return planner.plan


@dataclass
class _LayoutPlanner:
    """:func:`plan_quantizer_layout` under way: the checkpoint's tensors (``ckpt``: key ->
    (global shape, dtype)), the directory named in messages, and the plan so far."""

    ckpt: dict[str, tuple[tuple, torch.dtype]]
    checkpoint_dir: Any
    plan: LayoutPlan = field(default_factory=LayoutPlan)
    #: (head, tail) -> experts of the checkpoint's per-expert keys; built on first use.
    per_expert_index: dict[tuple[str, str], list[int]] | None = None

    def ckpt_experts(self, head: str, tail: str) -> list[int]:
        """Sorted experts ``e`` for which the checkpoint holds ``<head><e>.<tail>``."""
        if self.per_expert_index is None:
            self.per_expert_index = {}
            for k in self.ckpt:
                m = _PER_EXPERT_KEY.match(k)
                if m:
                    self.per_expert_index.setdefault((m["head"], m["tail"]), []).append(int(m["e"]))
        return sorted(self.per_expert_index.get((head, tail), []))

    def error(self, key: str, want: tuple, holds: str) -> None:
        """Plan an error: the model expects ``key`` of global shape ``want``, the checkpoint
        ``holds`` (the rest of the sentence)."""
        self.plan.errors.append(
            f"model expects {_describe(key, want)}, checkpoint {self.checkpoint_dir} holds {holds}"
        )

    def request(self, path: tuple, st: Any) -> None:
        """Plan one requested ``ShardedTensor`` ``st`` at ``path`` of the state dict: nothing
        for keys other than expert quantizers' and for keys the checkpoint holds with the same
        global shape (or ``allow_shape_mismatch``)."""
        key, want = st.key, tuple(st.global_shape)
        pe, sh = _PER_EXPERT_KEY.match(key), _SHARED_EXPERT_KEY.match(key)
        if not pe and not sh:
            return
        if key in self.ckpt:
            have = self.ckpt[key][0]
            if have != want and not st.allow_shape_mismatch:
                self.error(key, want, _describe(key, have))
        elif pe:
            self.per_expert_request(path, st, want, pe["head"], pe["tail"])
        else:
            self.shared_request(key, want, sh["head"], sh["tail"])

    def per_expert_request(self, path: tuple, st: Any, want: tuple, head: str, tail: str) -> None:
        """A per-expert request the checkpoint does not hold: a remap from the shared tensor
        ``<head><tail>`` when it fits (the expert's shape, or one value for a one-element
        quantizer), an error when it does not or when the checkpoint holds other experts only."""
        key, shared_key = st.key, head + tail
        if shared_key in self.ckpt:
            have, dtype = self.ckpt[shared_key]
            p = st.prepend_axis_num
            scalar = st.data is not None and st.data.numel() == 1 and _numel(have) == 1
            if have == want[p:] or scalar:
                remap = self.plan.remaps.setdefault(shared_key, _Remap(shared_key, have, dtype))
                remap.entries.append((path, st))
            else:
                self.error(key, want, _describe(shared_key, have))
            return
        experts = self.ckpt_experts(head, tail)
        if experts:
            self.error(
                key,
                want,
                f"the per-expert layout for experts {_ranges(experts)} only ('{head}<e>.{tail}')",
            )

    def shared_request(self, key: str, want: tuple, head: str, tail: str) -> None:
        """A request of a tensor shared by the experts that the checkpoint does not hold: an
        error when the checkpoint holds the per-expert layout instead (no one value to choose)."""
        experts = self.ckpt_experts(head, tail)
        if experts:
            have = self.ckpt[f"{head}{experts[0]}.{tail}"][0]
            self.error(
                key,
                want,
                f"the per-expert layout ('{head}<e>.{tail}', experts {_ranges(experts)}, global "
                f"shape {have} each); one value for all experts cannot be chosen",
            )


def _agree(plan: LayoutPlan, process_group: Any, checkpoint_dir: Any) -> dict[str, int]:
    """Collective: one ``all_gather_object`` on ``process_group`` (the group
    ``dist_checkpointing.load`` runs on).

    Returns:
        for each remapped checkpoint key, the lowest rank (in ``process_group``) requesting it:
        that rank's request is the main replica.

    Raises:
        QuantizerLayoutError: on every rank, if any rank's plan has errors (at most
            ``collective.MAX_PER_RANK`` messages per rank, then a count of the rest).
    """
    limit = collective.MAX_PER_RANK
    gathered = collective.all_gather_object(
        (plan.errors[:limit], len(plan.errors), sorted(plan.remaps)), process_group
    )
    ranks: list[int] = list(range(len(gathered)))
    if process_group is not None and torch.distributed.is_initialized():
        ranks = torch.distributed.get_process_group_ranks(process_group)
    failures = {}
    for rank, (errs, count, _) in zip(ranks, gathered):
        if count:
            failures[rank] = list(errs) + (
                [f"... and {count - len(errs)} more"] if count > len(errs) else []
            )
    if failures:
        total = sum(count for _, count, _ in gathered)
        raise QuantizerLayoutError.from_failures(
            f"Cannot map the ModelOpt quantizer state of checkpoint {checkpoint_dir} onto this "
            f"model ({total} tensor request(s) on all ranks):",
            failures,
            limit=limit + 1,
        )
    first_rank: dict[str, int] = {}
    for rank, (_, _, keys) in enumerate(gathered):
        for k in keys:
            first_rank.setdefault(k, rank)
    return first_rank


def _wrap_load(original: Callable) -> Callable:
    """Factory of the replacement of ``megatron.core.dist_checkpointing.serialization.load``:
    upstream's ``original``, after the quantizer layout of the checkpoint is mapped onto the
    request (:func:`plan_quantizer_layout`)."""
    signature = inspect.signature(original)

    @wraps_upstream(original)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        """Megatron's ``dist_checkpointing.load``, after mapping the checkpoint's ModelOpt expert
        quantizer layout onto the model; raises :class:`QuantizerLayoutError` on every rank."""
        ckpt = checkpoint_tensors(checkpoint_dir)
        # Every rank reads the same checkpoint metadata, so every rank takes the same branch and
        # the collective in _agree is entered by all or by none.
        if not ckpt or not any("quantizer" in k for k in ckpt):
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        bound = signature.bind_partial(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        process_group = bound.arguments.get("process_group")
        plan = plan_quantizer_layout(sharded_state_dict, ckpt, checkpoint_dir)
        first_rank = _agree(plan, process_group, checkpoint_dir)
        if not plan.remaps:
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        rank = (
            torch.distributed.get_rank(process_group)
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else 0
        )
        return _load_with_remaps(
            original, plan, first_rank, rank, sharded_state_dict, checkpoint_dir, args, kwargs
        )

    return load


_SYNTHETIC = "__modelopt_moe_shared_quantizer_state__"


def _load_with_remaps(
    original,
    plan: LayoutPlan,
    first_rank: dict[str, int],
    rank: int,
    sharded_state_dict: dict,
    checkpoint_dir,
    args,
    kwargs,
):
    """Load with each group of per-expert entries replaced by one request of the shared checkpoint
    tensor (whole tensor, main replica on the lowest requesting rank), then give every expert its
    part of it, in place (``ShardedTensor.data``) and in the returned state dict."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if not isinstance(sharded_state_dict, dict) or _SYNTHETIC in sharded_state_dict:
        raise QuantizerLayoutError(
            f"cannot remap quantizer state of {checkpoint_dir} into a {type(sharded_state_dict)}"
        )
    synthetic = {}
    for ckpt_key, remap in plan.remaps.items():
        buf = torch.empty(
            remap.ckpt_shape, dtype=remap.ckpt_dtype, device=remap.entries[0][1].data.device
        )
        replica = 0 if first_rank.get(ckpt_key) == rank else 1
        synthetic[ckpt_key] = ShardedTensor.from_rank_offsets(ckpt_key, buf, replica_id=replica)
        for path, st in remap.entries:
            # Placeholder: keeps the structure; loading returns it unchanged.
            _set(sharded_state_dict, path, LocalNonpersistentObject(st.data))
    sharded_state_dict[_SYNTHETIC] = synthetic
    try:
        loaded = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
    finally:
        sharded_state_dict.pop(_SYNTHETIC, None)
        for remap in plan.remaps.values():
            for path, st in remap.entries:
                _set(sharded_state_dict, path, st)
    values = loaded.pop(_SYNTHETIC)
    n = 0
    for ckpt_key, remap in plan.remaps.items():
        full = values[ckpt_key]
        for path, st in remap.entries:
            if full.numel() == 1 and st.data.numel() == 1:
                part = full
            else:
                p = st.prepend_axis_num
                part = full[
                    tuple(slice(o, o + s) for o, s in zip(st.global_offset[p:], st.local_shape))
                ]
            with torch.no_grad():
                st.data.copy_(part.to(st.data.dtype).reshape(st.data.shape))
            _set(loaded, path, st.data)
            n += 1
    example = next(iter(plan.remaps.values()))
    logger.warning(
        "modelopt_moe: checkpoint %s holds %d expert quantizer tensor(s) as one tensor shared by "
        "all experts of a linear (the layout from before per-expert weight quantizers, e.g. '%s'); "
        "loaded into %d per-expert tensor(s) on this rank, each expert taking the shared value "
        "(e.g. '%s').",
        checkpoint_dir,
        len(plan.remaps),
        example.ckpt_key,
        n,
        example.entries[0][1].key,
    )
    return loaded


_PROBE_PREFIX = "probe.mlp.experts.experts."
_LOAD = "megatron.core.dist_checkpointing.serialization.load"
_PACKAGE_LOAD = "megatron.core.dist_checkpointing.load"
_WHY = (
    "checkpoints from before per-expert weight quantizers could not be loaded into "
    "per-expert models, and unmappable quantizer layouts failed rank-locally"
)


def probe_upstream_maps_legacy_layout(load: Callable) -> bool | None:
    """Write a one-tensor ``torch_dist`` checkpoint in the shared layout
    (``probe.mlp.experts.experts.linear_fc1.weight_quantizer._amax`` = 2.0) to a temporary
    directory and ``load`` it into a per-expert request (expert 0) on a private 1-rank gloo group.

    Returns:
        True if expert 0 gets 2.0, False if the load fails or gives another value (megatron-core
        0.19.2: a missing-key ``CheckpointException``), None if the probe cannot run (with
        ``torch.distributed`` initialised the load would be a collective of the job).
    """
    if torch.distributed.is_initialized():
        return None
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    shared = f"{_PROBE_PREFIX}linear_fc1.weight_quantizer._amax"
    per_expert = f"{_PROBE_PREFIX}0.linear_fc1.weight_quantizer._amax"
    try:
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(), private_process_group():
            warnings.simplefilter("ignore")
            common = io.BytesIO()  # megatron's common state: a ShardedObject of [{}]
            torch.save([{}], common)
            common.seek(0)
            dcp.save(
                {
                    shared: torch.tensor([2.0]),
                    ShardedObject("common_state", None, (1,), (0,)).unique_key: common,
                },
                storage_writer=dcp.FileSystemWriter(d),
                no_dist=True,
            )
            save_config(CheckpointingConfig("torch_dist", 1), d)
            want = ShardedTensor.from_rank_offsets(per_expert, torch.zeros(1), replica_id=0)
            try:
                got = load({"amax": want}, d)["amax"]
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                return False
            return bool(torch.equal(got, torch.tensor([2.0])))
    except Exception as e:  # noqa: BLE001 - a probe that cannot run proves nothing
        logger.info("legacy layout probe could not run: %r", e)
        return None


class LegacyQuantizerLayoutFix(Fix):
    """Pre-per-expert quantizer checkpoints load into per-expert models; unmappable layouts raise
    on every rank."""

    name = "modelopt_moe.legacy_layout"
    title = "Pre-per-expert ModelOpt quantizer checkpoints mapped onto per-expert models on load"
    upstream_refs = (
        "ModelOpt issue 2209",
        "megatron-core dist_checkpointing.load resolves requests by exact key",
    )
    package = "megatron-core"
    patches = (
        Patch(_LOAD, _wrap_load, _WHY, params=("sharded_state_dict", "checkpoint_dir")),
        # the package's re-export, while it is one (``from megatron.core.dist_checkpointing
        # import load``)
        Patch(_PACKAGE_LOAD, alias_of(_LOAD, only_if_same=True), _WHY),
    )

    def upstream_behaves(self) -> bool | None:
        """True if upstream's own ``load`` fills a per-expert request from a shared-layout
        checkpoint, False if it does not (:func:`probe_upstream_maps_legacy_layout`), None when
        the probe cannot run (inside a job, where ``torch.distributed`` is initialised)."""
        import megatron.core.dist_checkpointing.serialization as serialization

        fn = inspect.unwrap(serialization.load)  # upstream's own, without overlay wrappers
        maps = probe_upstream_maps_legacy_layout(fn)
        logger.info("legacy layout probe: upstream maps the shared layout = %s", maps)
        return maps


FIX = LegacyQuantizerLayoutFix()
