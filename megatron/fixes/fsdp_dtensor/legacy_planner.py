"""Load ``fsdp_dtensor`` checkpoints written before the layout fix (megatron-core 0.17-0.19.2).

Those hold the fused ``linear_qkv_down_proj.*`` and ``mtp_model_layer.*`` keys.
:class:`LegacyPlannerFix` replaces ``megatron.training.checkpointing.default_planner`` (where
``_load_base_checkpoint``'s ``fsdp_dtensor`` branch takes ``DefaultLoadPlanner`` from) by a
namespace whose planner first re-renders a request prepared by :mod:`.layout` in the layout the
checkpoint was written in, read from its DCP metadata keys, never guessed from flags
(:func:`resolve_layout`). An MLA section whose shape differs from the checkpoint's raises
``ValueError`` naming the key and both shapes, on every rank (all ranks check the same global
shapes). Limitation: a legacy fused checkpoint written with TP > 1 stores rows in TP-interleaved
order; it loads correctly only at the TP size it was written with.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Iterable, Mapping

import torch

from megatron.fixes.fsdp_dtensor.layout import (
    MTP_LIVE,
    NEW_LAYOUT,
    Choice,
    MlaModule,
    Preparation,
    get_container,
    install_choice,
    logger,
    map_key,
    mla_hit,
    strip_wrappers,
)
from megatron.fixes.fsdp_dtensor.probes import is_ours
from megatron.fixes.fsdp_dtensor.sections import FUSED, KV_SECTION, Q_SECTION, join_key
from megatron.overlay import Fix, Patch


def metadata_keys(metadata) -> Mapping:
    """``state_dict_metadata`` of DCP ``Metadata`` (or the mapping itself)."""
    return getattr(metadata, "state_dict_metadata", metadata)


def detect_choice(prep: Preparation, md_keys: Mapping | Iterable[str]) -> Choice:
    """The on-disk layout of a checkpoint, from its DCP metadata keys (``model.<key>`` ...).

    Per MTP layer: legacy (``mtp_model_layer``) if the checkpoint holds some of its weights under
    that name and none under ``transformer_layer``. Per fused MLA module: legacy (fused) if the
    checkpoint lacks a section key but holds the fused key. Otherwise the fixed layout.
    """
    md = md_keys if isinstance(md_keys, (set, frozenset, dict)) else set(md_keys)
    layout = prep.layout
    model = prep.originals.get(("model",), {})
    mtp_legacy = set()
    for path in layout.mtp:
        head = join_key(path, MTP_LIVE) + "."
        new_hits = old_hits = 0
        for key in model:
            if not strip_wrappers(key).startswith(head):
                continue
            new_hits += sum(f"model.{k}" in md for k, _ in map_key(key, layout, NEW_LAYOUT))
            old_hits += sum(
                f"model.{k}" in md
                for k, _ in map_key(key, layout, Choice(mtp_legacy=frozenset([path])))
            )
        if new_hits == 0 and old_hits > 0:
            mtp_legacy.add(path)
    base = Choice(mtp_legacy=frozenset(mtp_legacy))
    fused_legacy = set()
    for key in model:
        hit = mla_hit(strip_wrappers(key), layout)
        if hit is None or hit[1] != "weight":
            continue
        split_keys = [f"model.{k}" for k, _ in map_key(key, layout, base)]
        fused_keys = [
            f"model.{k}"
            for k, _ in map_key(key, layout, Choice(frozenset([hit[0].path]), base.mtp_legacy))
        ]
        if not all(k in md for k in split_keys) and all(k in md for k in fused_keys):
            fused_legacy.add(hit[0].path)
    return Choice(frozenset(fused_legacy), base.mtp_legacy)


def _check_shapes(state_dict: dict, prep: Preparation, md: Mapping) -> None:
    """Raise ValueError if a requested MLA-related entry has another shape in the checkpoint."""
    related: dict[str, tuple[MlaModule, str | None]] = {}
    for key in prep.originals.get(("model",), {}):
        hit = mla_hit(strip_wrappers(key), prep.layout)
        if hit is not None:
            for disk_key, part in map_key(key, prep.layout, prep.choice):
                related[strip_wrappers(disk_key)] = (hit[0], part)
    problems: dict[str, list[str]] = {"model": [], "optimizer": []}
    for path in (("model",), ("optimizer", "state")):
        prefix = ".".join(path)
        for key, value in (get_container(state_dict, path) or {}).items():
            info = related.get(strip_wrappers(key))
            if info is None:
                continue
            if path == ("model",):
                entries = {f"{prefix}.{key}": value}
            elif isinstance(value, dict):
                entries = {f"{prefix}.{key}.{sub}": item for sub, item in value.items()}
            else:
                continue
            module, part = info
            for flat, item in entries.items():
                size = getattr(md.get(flat), "size", None)
                if size is None or not hasattr(item, "shape") or tuple(size) == tuple(item.shape):
                    continue
                what = {
                    "q": f"q section ({Q_SECTION}, q_lora_rank={module.q_rows})",
                    "kv": f"kv section ({KV_SECTION}, kv_lora_rank + qk_pos_emb_head_dim="
                    f"{module.kv_rows})",
                }.get(part, "entry")
                problems[path[0]].append(
                    f"checkpoint key '{flat}' has shape {tuple(size)} but the model's {what} of "
                    f"'{join_key(module.path, FUSED)}' has shape {tuple(item.shape)}"
                )
    named = problems["model"] or problems["optimizer"]
    if named:
        extra = len(problems["optimizer"]) if problems["model"] else 0
        raise ValueError(
            "fsdp_dtensor checkpoint does not match the model's fused MLA down projection "
            "(written with another q_lora_rank / kv_lora_rank / qk_pos_emb_head_dim or hidden "
            "size?): "
            + "; ".join(sorted(named))
            + (f"; and {extra} optimizer-state entries of these sections" if extra else "")
        )


def resolve_layout(state_dict: dict, metadata) -> Choice | None:
    """Address the layout the checkpoint was written in (legacy fused / ``mtp_model_layer`` keys)
    and check MLA section shapes. No-op (None) for a state dict this fix did not prepare.

    Args:
        metadata: DCP ``Metadata`` or its ``state_dict_metadata`` mapping.

    Raises:
        ValueError: an MLA section's shape differs from the checkpoint's (names key and shapes).
    """
    prep = getattr(state_dict, "fsdp_fix", None)
    if prep is None:
        return None
    md = metadata_keys(metadata)
    choice = detect_choice(prep, md)
    if choice != prep.choice:
        install_choice(state_dict, prep, choice)
        if choice.fused_legacy or choice.mtp_legacy:
            logger.warning(
                "fsdp_dtensor checkpoint written by megatron-core <= 0.19.2 without the fix: "
                "loading fused MLA down projections of %s and MTP layers %s under their legacy "
                "names",
                sorted(choice.fused_legacy) or "none",
                sorted(choice.mtp_legacy) or "none",
            )
    _check_shapes(state_dict, prep, md)
    return choice


def _make_load_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class FsdpDTensorLoadPlanner(DefaultLoadPlanner):
        """``DefaultLoadPlanner`` that first addresses the checkpoint's on-disk layout
        (:func:`resolve_layout`) and writes loaded non-tensor entries of renamed optimizer keys
        back to the live-key dicts Megatron restores after the load."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            if metadata is not None:
                resolve_layout(state_dict, metadata)
            super().set_up_planner(state_dict, metadata, is_coordinator)

        def load_bytes(self, read_item, value):
            super().load_bytes(read_item, value)
            prep = getattr(self.original_state_dict, "fsdp_fix", None)
            if prep is None or not self.flatten_state_dict:
                return
            path = tuple(self.mappings.get(read_item.dest_index.fqn, ()))
            target = prep.writeback.get(path)
            if target is None:
                return
            node = self.original_state_dict
            for name in path:
                node = node[name]
            target[0][target[1]] = node

    return FsdpDTensorLoadPlanner


class _PlannerNamespace:
    """Stands in for ``torch.distributed.checkpoint.default_planner`` inside
    ``megatron.training.checkpointing``: same attributes, fixed ``DefaultLoadPlanner``."""

    def __init__(self, module, planner_cls):
        self._module = module
        self.DefaultLoadPlanner = planner_cls

    def __getattr__(self, name):
        return getattr(self._module, name)


def planner_namespace(_original) -> _PlannerNamespace:
    """Factory of the replacement of ``checkpointing.default_planner``: a
    :class:`_PlannerNamespace` over torch's ``default_planner`` whose ``DefaultLoadPlanner``
    first addresses the checkpoint's layout (:func:`resolve_layout`)."""
    from torch.distributed.checkpoint import default_planner

    return _PlannerNamespace(default_planner, _make_load_planner_class())


# --------------------------------------------------------------------------------------------
# Probe: upstream's load planner on a checkpoint written in the legacy layout
# --------------------------------------------------------------------------------------------

_PROBE_ATTN = "module.decoder.layers.0.self_attention"
_PROBE_MTP = "module.mtp.layers.0"


def _upstream_load_planner() -> type:
    """The ``DefaultLoadPlanner`` that upstream's ``fsdp_dtensor`` load uses
    (``checkpointing.default_planner``), this fix's namespace peeled off."""
    from megatron.training import checkpointing

    namespace = checkpointing.default_planner
    if is_ours(type(namespace)):
        namespace = namespace._module
    return namespace.DefaultLoadPlanner


def _loads_legacy(planner_cls: type, allow_partial_load: bool) -> bool:
    """Write a one-rank DCP checkpoint in the legacy layout (fused ``linear_qkv_down_proj.weight``
    ``[4, 2]`` float32, ``mtp_model_layer.weight`` ``[2]``) into a temporary directory, then load
    it through ``planner_cls`` into a request in the fixed layout (q / kv views of the live fused
    weight, ``transformer_layer``); True when the live tensors then hold the checkpoint's
    values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    legacy_fused = torch.arange(8, dtype=torch.float32).view(4, 2)
    legacy_mtp = torch.full((2,), 3.0)
    live_fused = torch.zeros(4, 2)
    live_mtp = torch.zeros(2)
    written = {
        "model": {
            f"{_PROBE_ATTN}.{FUSED}.weight": legacy_fused,
            f"{_PROBE_MTP}.{MTP_LIVE}.weight": legacy_mtp,
        }
    }
    request = {
        "model": {
            f"{_PROBE_ATTN}.{Q_SECTION}.weight": live_fused[:2],
            f"{_PROBE_ATTN}.{KV_SECTION}.weight": live_fused[2:],
            f"{_PROBE_MTP}.transformer_layer.weight": live_mtp,
        }
    }
    with (
        tempfile.TemporaryDirectory(prefix="fsdp_dtensor_probe_") as root,
        warnings.catch_warnings(),
    ):
        # DCP warns that no_dist means one process even when asked for it: the probe's own call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(written, checkpoint_id=root, no_dist=True)
        try:
            dcp.load(
                request,
                checkpoint_id=root,
                planner=planner_cls(allow_partial_load=allow_partial_load),
                no_dist=True,
            )
        except (Exception, CheckpointException):  # noqa: BLE001 - failing to load: the defect
            logger.debug("fsdp_dtensor legacy-planner probe: load raised", exc_info=True)
            return False
    return torch.equal(live_fused, legacy_fused) and torch.equal(live_mtp, legacy_mtp)


def upstream_loads_legacy_layout() -> bool:
    """Behavioural probe: does upstream's ``fsdp_dtensor`` load planner
    (``checkpointing.default_planner.DefaultLoadPlanner``, this fix's peeled off) load a
    checkpoint written in the legacy layout (fused ``linear_qkv_down_proj`` and
    ``mtp_model_layer`` keys, as megatron-core 0.17-0.19.2 wrote) into a state dict in the fixed
    layout (what a save writes once fused MLA / MTP are handled), both strictly and with
    ``allow_partial_load`` (``--no-strict-fsdp-dtensor-load``)?

    megatron-core 0.19.2 and upstream main (Megatron-LM PR 6271) cannot: a strict load raises on
    the missing unfused keys and a partial one leaves the weights unloaded (False). Independent
    of the layout part's verdict. One rank, no process group; writes a few bytes to a temporary
    directory, removed before it returns.
    """
    planner_cls = _upstream_load_planner()
    return all(_loads_legacy(planner_cls, partial) for partial in (False, True))


class LegacyPlannerFix(Fix):
    """Part of ``fsdp_dtensor``: replaces ``checkpointing.default_planner``."""

    name = "fsdp_dtensor.legacy_planner"
    title = (
        "fsdp_dtensor: checkpoints written by the unfixed 0.17-0.19.2 code (fused / "
        "mtp_model_layer keys) still load; MLA section shape mismatches are named"
    )
    upstream_refs = ("Megatron-LM PR 6271",)
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.training.checkpointing.default_planner",
            planner_namespace,
            "with the layout fix, fsdp_dtensor checkpoints written by the unfixed 0.17-0.19.2 "
            "code (fused linear_qkv_down_proj / mtp_model_layer keys) would no longer load; the "
            "load planner now requests the layout the checkpoint's metadata shows",
        ),
    )

    def upstream_behaves(self) -> bool:
        return upstream_loads_legacy_layout()
