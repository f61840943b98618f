"""Fused MLA down projection and MTP layers in ``fsdp_dtensor`` checkpoints (Megatron-LM PR 6271).

megatron-core 0.19.2 builds ``fsdp_dtensor`` keys from ``named_parameters()`` and never calls
``sharded_state_dict``, so it saves ``FusedMLASelfAttention``'s ``linear_qkv_down_proj.weight``
(and its absorbed ``layer_norm_weight`` / ``layer_norm_bias``) under the fused key, which no
unfused checkpoint has, and the MTP inner layer as ``mtp_model_layer`` instead of
``transformer_layer``. :func:`handle_mla_down_proj_in_state_dict` and
:func:`handle_mtp_in_state_dict` backport upstream's later functions of those names: they return
``(model_state_dict, optimizer_state_dict)`` in the unfused layout (q / kv section views of
:mod:`.sections`, ``input_layernorm.*``, ``transformer_layer``; optimizer state alike), and the
returned model dict carries (``fsdp_fix``) what :mod:`.legacy_planner` needs to address an older
on-disk layout. :class:`MlaMtpLayoutFix` runs them after upstream's
``preprocess_fsdp_dtensor_state_dict``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from megatron.overlay import Fix
from megatron.fixes.fsdp_dtensor.probes import module_calls, upstream_function
from megatron.fixes.fsdp_dtensor.sections import (
    FUSED,
    KV_SECTION,
    Q_SECTION,
    MlaModule,
    join_key,
    split_fused,
)
from megatron.overlay.registry import Patcher, wraps_upstream

logger = logging.getLogger("megatron.fixes.fsdp_dtensor")

MTP_LIVE = "mtp_model_layer"
MTP_DISK = "transformer_layer"
# absorbed layernorm parameter of the fused linear -> parameter of the layer's input_layernorm
LAYERNORM_MAP = {"layer_norm_weight": "weight", "layer_norm_bias": "bias"}
_WRAPPER_NAMES = ("module", "model")
#: state-dict containers whose keys are parameter names, as paths from the top-level dict
CONTAINERS = (("model",), ("optimizer", "state"), ("optimizer", "param_to_group_meta"))
_HANDLERS = ("handle_mla_down_proj_in_state_dict", "handle_mtp_in_state_dict")


def strip_wrappers(key: str) -> str:
    """``key`` without leading wrapper components (``module.``, ``model.``), as upstream's
    SwiGLU handler normalises state-dict keys and module paths."""
    parts = key.split(".")
    i = 0
    while i < len(parts) - 1 and parts[i] in _WRAPPER_NAMES:
        i += 1
    return ".".join(parts[i:])


@dataclass(frozen=True)
class ModelLayout:
    """Fused MLA modules and renamed MTP layers of a model (normalised paths)."""

    mla: Mapping[str, MlaModule] = field(default_factory=dict)
    mtp: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.mla) or bool(self.mtp)

    def merged(self, other: "ModelLayout") -> "ModelLayout":
        """Both layouts' modules."""
        return ModelLayout({**self.mla, **other.mla}, tuple(dict.fromkeys(self.mtp + other.mtp)))


@dataclass(frozen=True)
class Choice:
    """On-disk layout to address: MLA modules kept fused and MTP layers kept under
    ``mtp_model_layer`` (both empty: the fixed layout, which is what a save writes)."""

    fused_legacy: frozenset = frozenset()
    mtp_legacy: frozenset = frozenset()


NEW_LAYOUT = Choice()


def _modules(model: Any):
    """``(normalised path, module)`` of every module of a (wrapped) model chunk."""
    if isinstance(model, (list, tuple)):
        model = model[0]
    for name, module in model.named_modules():
        path = strip_wrappers(name) if name else ""
        yield ("" if path in _WRAPPER_NAMES else path), module


def find_mla_modules(model: Any) -> dict[str, MlaModule]:
    """Fused MLA modules: any module with a child ``linear_qkv_down_proj`` that has a weight and a
    ``config`` whose ``q_lora_rank`` is set (``FusedMLASelfAttention``, also inside MTP and
    hybrid stacks), by normalised path."""
    found: dict[str, MlaModule] = {}
    for path, module in _modules(model):
        fused = getattr(module, FUSED, None)
        config = getattr(module, "config", None)
        if not (
            isinstance(fused, torch.nn.Module)
            and config is not None
            and getattr(config, "q_lora_rank", None)
        ):
            continue
        weight = getattr(fused, "weight", None)
        if weight is not None:
            found[path] = MlaModule(
                path=path,
                parent=path.rpartition(".")[0],
                q_rows=int(config.q_lora_rank),
                kv_rows=int(config.kv_lora_rank) + int(config.qk_pos_emb_head_dim),
                weight=weight,
            )
    return found


def find_mtp_layers(model: Any) -> tuple[str, ...]:
    """Paths of the MTP layers whose inner ``mtp_model_layer`` is ``transformer_layer`` on disk:
    modules with such a child and no ``mtp_layer_pattern`` (hybrid MTP keeps its native name)."""
    return tuple(
        path
        for path, module in _modules(model)
        if isinstance(getattr(module, MTP_LIVE, None), torch.nn.Module)
        and getattr(module, "mtp_layer_pattern", None) is None
    )


def find_model_layout(model: Any, *, mla: bool = True, mtp: bool = True) -> ModelLayout:
    """:func:`find_mla_modules` (if ``mla``) and :func:`find_mtp_layers` (if ``mtp``)."""
    return ModelLayout(
        find_mla_modules(model) if mla else {}, find_mtp_layers(model) if mtp else ()
    )


def mla_hit(norm_key: str, layout: ModelLayout) -> tuple[MlaModule, str] | None:
    """``(module, leaf)`` if the normalised key is ``<mla path>.linear_qkv_down_proj.<leaf>`` with
    leaf ``weight``, ``layer_norm_weight`` or ``layer_norm_bias`` of a fused module, else None."""
    marker = f"{FUSED}."
    if norm_key.startswith(marker):
        path, leaf = "", norm_key[len(marker) :]
    else:
        idx = norm_key.rfind(f".{marker}")
        if idx < 0:
            return None
        path, leaf = norm_key[:idx], norm_key[idx + len(marker) + 1 :]
    module = layout.mla.get(path)
    if module is None or (leaf != "weight" and leaf not in LAYERNORM_MAP):
        return None
    return module, leaf


def _mtp_rename(norm_key: str, layout: ModelLayout, choice: Choice) -> str:
    for path in layout.mtp:
        if path in choice.mtp_legacy:
            continue
        head = join_key(path, MTP_LIVE) + "."
        if norm_key.startswith(head):
            return join_key(path, MTP_DISK) + "." + norm_key[len(head) :]
    return norm_key


def map_key(
    key: str, layout: ModelLayout, choice: Choice = NEW_LAYOUT
) -> list[tuple[str, str | None]]:
    """The on-disk key(s) of one live state-dict key.

    Returns:
        ``[(disk_key, part)]`` where ``part`` is ``'q'`` / ``'kv'`` for a fused weight's sections,
        else None (the whole value). The key's wrapper prefix (``module.``...) is kept.
    """
    norm = strip_wrappers(key)
    prefix = key[: len(key) - len(norm)]
    out: list[tuple[str, str | None]] = [(norm, None)]
    hit = mla_hit(norm, layout)
    if hit is not None and hit[0].path not in choice.fused_legacy:
        module, leaf = hit
        if leaf == "weight":
            out = [
                (join_key(module.path, Q_SECTION, "weight"), "q"),
                (join_key(module.path, KV_SECTION, "weight"), "kv"),
            ]
        else:
            out = [(join_key(module.parent, "input_layernorm", LAYERNORM_MAP[leaf]), None)]
    return [(prefix + _mtp_rename(k, layout, choice), part) for k, part in out]


# --------------------------------------------------------------------------------------------
# Prepared state dict: render in a layout, re-render for another (legacy_planner)
# --------------------------------------------------------------------------------------------


@dataclass
class Preparation:
    """What a prepared state dict was made from, to render it again in another on-disk layout.

    Attributes:
        args: Megatron args of the save/load (read by the partial-load check).
        layout: the model's fused MLA modules and renamed MTP layers.
        originals: container path (:data:`CONTAINERS`) -> that dict as upstream prepared it.
        sections: ``(container path, live key[, optimizer sub-key])`` -> ``{'q', 'kv'}`` DTensors.
        choice: the layout rendered now.
        writeback: DCP object path -> ``(dict, key)`` receiving a loaded non-tensor value.
        installed: container path -> the rendered dict put in place.
    """

    args: Any
    layout: ModelLayout
    originals: dict
    sections: dict
    choice: Choice = NEW_LAYOUT
    writeback: dict = field(default_factory=dict)
    installed: dict = field(default_factory=dict)


class PreparedStateDict(dict):
    """A state dict (top level, or the ``model`` container) rendered by this fix, carrying
    (``fsdp_fix``) its :class:`Preparation`. Copies and pickles are plain dicts."""

    fsdp_fix: Preparation

    def __reduce_ex__(self, protocol):
        return (dict, (dict(self),))


def get_container(state_dict: dict, path: tuple[str, ...]):
    """The dict at ``path`` in ``state_dict``, or None."""
    node = state_dict
    for name in path:
        if not isinstance(node, dict) or name not in node:
            return None
        node = node[name]
    return node if isinstance(node, dict) else None


def _render(prep: Preparation, path: tuple[str, ...], choice: Choice) -> dict:
    orig = prep.originals[path]
    new: dict = {}
    for key, value in orig.items():
        for new_key, part in map_key(key, prep.layout, choice):
            if part is None:
                v = value
            elif path == ("model",):
                v = prep.sections[(path, key)][part]
            elif path == ("optimizer", "state"):
                v = dict(value)
                for sub in value:
                    split = prep.sections.get((path, key, sub))
                    if split is not None:
                        v[sub] = split[part]
            else:
                v = value
            if new_key in new:
                raise ValueError(f"fsdp_dtensor fix: two entries map to checkpoint key '{new_key}'")
            new[new_key] = v
            # DCP sets loaded non-tensor leaves into the dicts it was given; where those are our
            # copies under renamed keys, the planner writes them back to the live-key dicts that
            # Megatron restores after the load (tensors load in place, nested dicts are shared).
            if new_key != key and path != ("model",):
                if path == ("optimizer", "state") and isinstance(value, dict):
                    for sub, item in value.items():
                        if (path, key, sub) not in prep.sections and not isinstance(
                            item, (dict, torch.Tensor)
                        ):
                            prep.writeback[path + (new_key, sub)] = (value, sub)
                elif not isinstance(value, (dict, torch.Tensor)):
                    prep.writeback[path + (new_key,)] = (orig, key)
    return new


def install_choice(state_dict: dict, prep: Preparation, choice: Choice) -> None:
    """Render every container of ``prep`` in layout ``choice`` into ``state_dict`` (in place),
    except containers something else replaced since (e.g. upstream's GPT-compat retargeting)."""
    prep.writeback = {}
    for path in prep.originals:
        parent = state_dict if len(path) == 1 else get_container(state_dict, path[:-1])
        if parent is None:
            continue
        if path in prep.installed and parent.get(path[-1]) is not prep.installed[path]:
            continue
        rendered = _render(prep, path, choice)
        if path == ("model",):
            rendered = PreparedStateDict(rendered)
            rendered.fsdp_fix = prep
        parent[path[-1]] = prep.installed[path] = rendered
    prep.choice = choice


def _split_sections(originals: dict, layout: ModelLayout) -> dict:
    """Section DTensors of every fused weight of ``layout`` and of each optimizer state entry of
    the fused weight's shape (``exp_avg``, ``exp_avg_sq``...; scalars such as ``step`` are
    shared by both sections)."""
    sections: dict = {}
    for path in (("model",), ("optimizer", "state")):
        for key, value in (originals.get(path) or {}).items():
            hit = mla_hit(strip_wrappers(key), layout)
            if hit is None or hit[1] != "weight":
                continue
            module = hit[0]
            if path == ("model",):
                sections[(path, key)] = split_fused(value, module, key)
            elif isinstance(value, dict):
                for sub, item in value.items():
                    if (
                        hasattr(item, "shape")
                        and item.dim() > 0
                        and tuple(item.shape) == tuple(module.weight.shape)
                    ):
                        sections[(path, key, sub)] = split_fused(item, module, f"{key}.{sub}")
    return sections


def _prepare(
    model_state_dict: dict, optimizer_state_dict: dict | None, found: ModelLayout
) -> tuple[dict, dict | None]:
    """Render the state dicts in the fixed layout for ``found`` plus whatever an earlier handler
    rendered them for (its :class:`Preparation` rides on the model dict)."""
    if not found:
        return model_state_dict, optimizer_state_dict
    top: dict = {"model": model_state_dict}
    if isinstance(optimizer_state_dict, dict):
        top["optimizer"] = dict(optimizer_state_dict)
    earlier = getattr(model_state_dict, "fsdp_fix", None)
    if earlier is not None:
        prep = dataclasses.replace(
            earlier,
            layout=earlier.layout.merged(found),
            sections=dict(earlier.sections),
            installed=dict(earlier.installed),
            writeback={},
        )
    else:
        originals = {p: c for p in CONTAINERS if (c := get_container(top, p)) is not None}
        prep = Preparation(args=None, layout=found, originals=originals, sections={})
    prep.sections.update(_split_sections(prep.originals, found))
    install_choice(top, prep, NEW_LAYOUT)
    return top["model"], top.get("optimizer", optimizer_state_dict)


def handle_mla_down_proj_in_state_dict(
    model: Any, model_state_dict: dict, optimizer_state_dict: dict | None
):
    """Backport of upstream's function of this name (Megatron-LM PR 6271).

    Each fused ``<attn>.linear_qkv_down_proj.weight`` DTensor (global ``[q_lora_rank +
    kv_lora_rank + qk_pos_emb_head_dim, hidden]``), and each optimizer state of its shape, becomes
    ``<attn>.linear_q_down_proj.weight`` / ``<attn>.linear_kv_down_proj.weight`` (global
    ``[q_lora_rank, hidden]`` / ``[kv_lora_rank + qk_pos_emb_head_dim, hidden]``, same dtype,
    local tensors are views into the fused shard, so a load writes into the fused parameter); an
    absorbed ``layer_norm_weight`` / ``layer_norm_bias`` becomes the layer's
    ``input_layernorm.weight`` / ``.bias``. Inputs are not modified.

    Returns:
        ``(model_state_dict, optimizer_state_dict)``; unchanged for a model without fused MLA.

    Raises:
        TypeError, ValueError: see :func:`.sections.split_fused`.
    """
    return _prepare(
        model_state_dict, optimizer_state_dict, ModelLayout(mla=find_mla_modules(model))
    )


def handle_mtp_in_state_dict(model: Any, model_state_dict: dict, optimizer_state_dict: dict | None):
    """Backport of upstream's function of this name (Megatron-LM PR 6271): keys under an MTP
    layer's ``mtp_model_layer`` (model, optimizer state, param-group metadata) move to
    ``transformer_layer``, the name every other checkpoint format uses
    (``MultiTokenPredictionLayer.sharded_state_dict``); hybrid MTP layers keep theirs. Inputs are
    not modified; returns ``(model_state_dict, optimizer_state_dict)``."""
    return _prepare(model_state_dict, optimizer_state_dict, ModelLayout(mtp=find_mtp_layers(model)))


def prepare_state_dict(state_dict: dict, model: Any, args: Any = None) -> dict:
    """Put an upstream-preprocessed ``fsdp_dtensor`` state dict into the fixed on-disk layout.

    Runs :func:`handle_mla_down_proj_in_state_dict`, then :func:`handle_mtp_in_state_dict` (last,
    as MLA resolves live module paths), looked up at call time.

    Args:
        state_dict: result of upstream ``preprocess_fsdp_dtensor_state_dict``: ``{'model': {key:
            DTensor}, 'optimizer': {'state': {key: {'exp_avg': DTensor, ..., 'step': tensor}},
            'param_to_group_meta': {key: dict}}, ...}``; not modified.
        model: the (Megatron-FSDP wrapped) model chunk the keys belong to.
        args: Megatron args, kept for the partial-load check.

    Returns:
        ``state_dict`` itself if the model has nothing to handle, else a :class:`PreparedStateDict`.
    """
    msd, osd = handle_mla_down_proj_in_state_dict(
        model, state_dict["model"], state_dict.get("optimizer")
    )
    msd, osd = handle_mtp_in_state_dict(model, msd, osd)
    prep = getattr(msd, "fsdp_fix", None)
    if prep is None:
        return state_dict
    out = PreparedStateDict(state_dict)
    out["model"] = msd
    if "optimizer" in out:
        out["optimizer"] = osd
    prep.args = args
    out.fsdp_fix = prep
    return out


def _mtp_handler_renames(handler: Any) -> bool:
    """Upstream's ``handle_mtp_in_state_dict`` moves a one-layer MTP stand-in's keys."""
    layer = torch.nn.Module()
    layer.add_module(MTP_LIVE, torch.nn.Module())
    model = torch.nn.Module()
    model.add_module("mtp", torch.nn.ModuleList([layer]))
    try:
        out, _ = handler(model, {f"mtp.0.{MTP_LIVE}.w": torch.zeros(1)}, None)
    except Exception:
        return False
    return set(out) == {f"mtp.0.{MTP_DISK}.w"}


def upstream_handles_layout() -> bool:
    """Capability probe: megatron-core has its own ``handle_mla_down_proj_in_state_dict`` and
    ``handle_mtp_in_state_dict`` (``megatron.core.transformer.fsdp_dtensor_checkpoint``), the
    training checkpoint code calls both, and the MTP one renames ``mtp_model_layer`` keys."""
    try:
        from megatron.training import checkpointing
    except ImportError:
        return False
    handlers = [
        upstream_function("megatron.core.transformer.fsdp_dtensor_checkpoint", name)
        for name in _HANDLERS
    ]
    if any(h is None for h in handlers):
        return False
    if not all(module_calls(checkpointing, name) for name in _HANDLERS):
        return False
    return _mtp_handler_renames(handlers[1])


class MlaMtpLayoutFix(Fix):
    """Part of ``fsdp_dtensor``: wraps ``preprocess_fsdp_dtensor_state_dict`` (save and load)."""

    name = "fsdp_dtensor.mla_mtp_layout"
    title = (
        "fsdp_dtensor: fused MLA down projection and MTP layers saved in the unfused layout, "
        "with their optimizer state"
    )
    upstream_refs = ("Megatron-LM PR 6271",)
    package = "megatron-core"

    def upstream_behaves(self) -> bool:
        return upstream_handles_layout()

    def install(self, patcher: Patcher) -> None:
        from megatron.training import checkpointing

        upstream = checkpointing.preprocess_fsdp_dtensor_state_dict

        @wraps_upstream(upstream)
        def preprocess_fsdp_dtensor_state_dict(args, raw_state_dict, model):
            """Upstream's preprocessing (fp8 extra state, SwiGLU, experts, uneven-DTensor
            metadata), then :func:`prepare_state_dict`."""
            return prepare_state_dict(upstream(args, raw_state_dict, model), model, args)

        patcher.replace(
            checkpointing,
            "preprocess_fsdp_dtensor_state_dict",
            preprocess_fsdp_dtensor_state_dict,
            "fsdp_dtensor checkpoints saved linear_qkv_down_proj under the fused key and MTP "
            "layers as mtp_model_layer, so they could not round-trip with unfused models; now "
            "saved as linear_q_down_proj / linear_kv_down_proj views (+ input_layernorm) and "
            "transformer_layer, optimizer state included",
        )
