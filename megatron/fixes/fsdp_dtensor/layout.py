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
``preprocess_fsdp_dtensor_state_dict``; where upstream calls its own handlers there (upstream main,
whose split raises ``AttributeError`` without a ``Float16Module``, i.e. in fp32 runs), those pass
the state dicts through (:func:`defer_upstream_handler`). Its probe,
:func:`upstream_round_trips_layout`, runs upstream's preprocessing on a stand-in model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from megatron.fixes.fsdp_dtensor.probes import quiet_upstream, swapped, upstream_names, upstream_of
from megatron.fixes.fsdp_dtensor.sections import (
    FUSED,
    KV_SECTION,
    Q_SECTION,
    MlaModule,
    join_key,
    split_fused,
)
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import Patcher, wraps_upstream

logger = logging.getLogger("megatron.fixes.fsdp_dtensor")

MTP_LIVE = "mtp_model_layer"
MTP_DISK = "transformer_layer"
# absorbed layernorm parameter of the fused linear -> parameter of the layer's input_layernorm
LAYERNORM_MAP = {"layer_norm_weight": "weight", "layer_norm_bias": "bias"}
_WRAPPER_NAMES = ("module", "model")
#: state-dict containers whose keys are parameter names, as paths from the top-level dict
CONTAINERS = (("model",), ("optimizer", "state"), ("optimizer", "param_to_group_meta"))
#: upstream's own layout handlers, as ``megatron.training.checkpointing`` imports them (upstream
#: main, Megatron-LM PR 6271); absent in 0.19.2
_HANDLERS = ("handle_mla_down_proj_in_state_dict", "handle_mtp_in_state_dict")
_PREPROCESS = "megatron.training.checkpointing.preprocess_fsdp_dtensor_state_dict"


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


# --------------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------------


def wrap_preprocess_fsdp_dtensor_state_dict(upstream):
    """Factory of the replacement of ``checkpointing.preprocess_fsdp_dtensor_state_dict`` (save
    and load): upstream's preprocessing, then :func:`prepare_state_dict`."""

    @wraps_upstream(upstream)
    def preprocess_fsdp_dtensor_state_dict(args, raw_state_dict, model):
        """Upstream's preprocessing (fp8 extra state, SwiGLU, experts, uneven-DTensor
        metadata), then :func:`prepare_state_dict`."""
        return prepare_state_dict(upstream(args, raw_state_dict, model), model, args)

    return preprocess_fsdp_dtensor_state_dict


def defer_upstream_handler(upstream):
    """Factory of the replacement of one of upstream's own layout handlers as
    ``checkpointing`` calls it inside ``preprocess_fsdp_dtensor_state_dict`` (upstream main,
    Megatron-LM PR 6271): returns ``(model_state_dict, optimizer_state_dict)`` unchanged, since
    the wrapper of :func:`wrap_preprocess_fsdp_dtensor_state_dict` renders the whole layout after
    upstream's preprocessing. Upstream's split assumes a ``Float16Module`` under Megatron-FSDP
    (``model.get_parameter('module.' + key)``) and raises ``AttributeError`` in fp32 runs; it
    also renames the keys before :mod:`.legacy_planner` could address an older layout."""

    @wraps_upstream(upstream)
    def handler(model, model_state_dict, optimizer_state_dict):
        """Upstream's layout handler, deferred to the fix: the state dicts pass unchanged."""
        return model_state_dict, optimizer_state_dict

    return handler


# --------------------------------------------------------------------------------------------
# Probe: upstream's own preprocessing on a stand-in model
# --------------------------------------------------------------------------------------------

_PROBE_Q, _PROBE_KV, _PROBE_H = 2, 2, 2  # q_lora_rank, kv_lora_rank + qk_pos_emb_head_dim, hidden
_PROBE_ATTN = "decoder.layers.0.self_attention"


class _ProbeShard:
    """What a Megatron-FSDP DTensor offers upstream's split: ``shape`` and ``to_local()`` (a
    single rank owning the whole tensor)."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local
        self.shape = local.shape

    def to_local(self) -> torch.Tensor:
        return self.local

    def dim(self) -> int:
        return self.local.dim()


class _ProbeDistIndex:
    """A one-rank Megatron-FSDP dist index without tensor parallelism."""

    tp_dim = None

    def get_submesh(self, *args, **kwargs):
        return type("Mesh", (), {"mesh": torch.zeros(1), "get_local_rank": lambda self: 0})()


def _probe_make_fsdp_dtensor(local_tensor, *args, **kwargs):
    """Stand-in of ``make_fsdp_dtensor`` for the probe: the local view itself (one rank)."""
    return local_tensor


def _probe_model(float16: bool) -> tuple[torch.nn.Module, dict, dict]:
    """``(model, model_state_dict, optimizer_state_dict)`` of a one-rank stand-in of
    ``MegatronFSDP(GPTModel)`` (``float16``: ``MegatronFSDP(Float16Module(GPTModel))``) with one
    fused MLA down projection (``[q + kv, hidden]`` float32, rows numbered) and its absorbed
    ``layer_norm_weight``, and one MTP layer (``mtp.layers.0.mtp_model_layer.weight``); state-dict
    keys as Megatron-FSDP's (``module.<GPT key>``; ``Float16Module`` adds no component)."""
    gpt = torch.nn.Module()
    gpt.decoder = torch.nn.Module()
    gpt.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    attn = torch.nn.Module()
    gpt.decoder.layers[0].self_attention = attn
    attn.config = types.SimpleNamespace(
        q_lora_rank=_PROBE_Q, kv_lora_rank=_PROBE_KV - 1, qk_pos_emb_head_dim=1
    )
    fused = torch.nn.Module()
    rows = torch.arange((_PROBE_Q + _PROBE_KV) * _PROBE_H, dtype=torch.float32)
    fused.weight = torch.nn.Parameter(rows.view(_PROBE_Q + _PROBE_KV, _PROBE_H))
    fused.layer_norm_weight = torch.nn.Parameter(torch.ones(_PROBE_H))
    for p in (fused.weight, fused.layer_norm_weight):
        p.megatron_fsdp_slice = slice(0, p.numel())
        p.megatron_fsdp_dist_index = _ProbeDistIndex()
    attn.linear_qkv_down_proj = fused
    gpt.mtp = torch.nn.Module()
    gpt.mtp.layers = torch.nn.ModuleList([torch.nn.Module()])
    gpt.mtp.layers[0].mtp_layer_pattern = None
    gpt.mtp.layers[0].mtp_model_layer = torch.nn.Module()
    gpt.mtp.layers[0].mtp_model_layer.weight = torch.nn.Parameter(torch.full((_PROBE_H,), 5.0))
    root = torch.nn.Module()
    if float16:
        root.module = torch.nn.Module()
        root.module.module = gpt
    else:
        root.module = gpt
    msd = {f"module.{k}": _ProbeShard(v.detach()) for k, v in gpt.named_parameters()}
    return root, msd, {"state": {}, "param_to_group_meta": {}}


def _round_trips(upstream, float16: bool) -> bool:
    """Upstream's ``preprocess_fsdp_dtensor_state_dict`` on :func:`_probe_model`: the fused
    weight becomes ``linear_q_down_proj`` / ``linear_kv_down_proj`` views of its rows (a load
    writes into the fused parameter), ``layer_norm_weight`` becomes ``input_layernorm.weight`` and
    the MTP layer ``transformer_layer``; False when it raises or leaves another layout."""
    root, msd, osd = _probe_model(float16)
    fused = root.get_submodule(("module.module." if float16 else "module.") + _PROBE_ATTN)
    weight = fused.linear_qkv_down_proj.weight
    args = types.SimpleNamespace(swiglu=False, num_experts=None)
    try:
        out = upstream(args, {"model": msd, "optimizer": osd}, root)["model"]
    except Exception:  # noqa: BLE001 - upstream's path failing on this model is the defect
        logger.debug("fsdp_dtensor layout probe: upstream raised", exc_info=True)
        return False
    q_key = f"module.{_PROBE_ATTN}.{Q_SECTION}.weight"
    kv_key = f"module.{_PROBE_ATTN}.{KV_SECTION}.weight"
    want = {
        q_key,
        kv_key,
        "module.decoder.layers.0.input_layernorm.weight",
        f"module.mtp.layers.0.{MTP_DISK}.weight",
    }
    if set(out) != want:
        return False
    local = {k: getattr(out[k], "to_local", lambda v=out[k]: v)() for k in (q_key, kv_key)}
    expect = weight.detach().clone()
    if not (
        torch.equal(local[q_key], expect[:_PROBE_Q])
        and torch.equal(local[kv_key], expect[_PROBE_Q:])
    ):
        return False
    with torch.no_grad():  # a load writes the checkpoint's values into the sections
        local[q_key].fill_(-1.0)
        local[kv_key].fill_(-2.0)
    return bool((weight[:_PROBE_Q] == -1).all() and (weight[_PROBE_Q:] == -2).all())


def upstream_round_trips_layout() -> bool:
    """Behavioural probe: does upstream's own ``fsdp_dtensor`` preprocessing
    (``megatron.training.checkpointing.preprocess_fsdp_dtensor_state_dict``, this fix's wrappers
    peeled off) put a stand-in model with a fused MLA down projection and an MTP layer into the
    unfused layout, as views a load writes through, under ``MegatronFSDP(GPTModel)`` (fp32 runs)
    and ``MegatronFSDP(Float16Module(GPTModel))`` (bf16 / fp16)?

    megatron-core 0.19.2 keeps the fused and ``mtp_model_layer`` keys (False); upstream main
    (Megatron-LM PR 6271) raises ``AttributeError`` in fp32 runs, its split assuming a
    ``Float16Module`` (False). One rank, no process group: upstream's ``make_fsdp_dtensor`` is
    replaced, while the probe runs, by one returning the local view. The optimizer-state split
    is not exercised (its keys depend on the optimizer's parameter names).
    """
    from megatron.training import checkpointing

    upstream = upstream_of(checkpointing.preprocess_fsdp_dtensor_state_dict)
    try:
        from megatron.core.transformer import fsdp_dtensor_checkpoint as fdc
    except ImportError:
        fdc = None
    stub = (
        {"make_fsdp_dtensor": _probe_make_fsdp_dtensor}
        if fdc is not None and hasattr(fdc, "make_fsdp_dtensor")
        else {}
    )
    stubbed = swapped(fdc, **stub) if fdc is not None else contextlib.nullcontext()
    with upstream_names(checkpointing, *_HANDLERS), stubbed, quiet_upstream():
        return all(_round_trips(upstream, float16) for float16 in (False, True))


class MlaMtpLayoutFix(Fix):
    """Part of ``fsdp_dtensor``: wraps ``preprocess_fsdp_dtensor_state_dict`` (save and load).

    On an upstream whose ``checkpointing`` calls its own layout handlers (upstream main), those
    are deferred to this fix as well (:attr:`deferred_handlers`, installed only where upstream
    has them), so the layout is rendered once, by this fix, in every precision.
    """

    name = "fsdp_dtensor.mla_mtp_layout"
    title = (
        "fsdp_dtensor: fused MLA down projection and MTP layers saved in the unfused layout, "
        "with their optimizer state"
    )
    upstream_refs = ("Megatron-LM PR 6271",)
    package = "megatron-core"

    patches = (
        Patch(
            _PREPROCESS,
            wrap_preprocess_fsdp_dtensor_state_dict,
            "fsdp_dtensor checkpoints saved linear_qkv_down_proj under the fused key and MTP "
            "layers as mtp_model_layer, so they could not round-trip with unfused models; now "
            "saved as linear_q_down_proj / linear_kv_down_proj views (+ input_layernorm) and "
            "transformer_layer, optimizer state included",
            params=("args", "raw_state_dict", "model"),
        ),
    )
    deferred_handlers = tuple(
        Patch(
            f"megatron.training.checkpointing.{name}",
            defer_upstream_handler,
            "upstream's own fsdp_dtensor layout handler (Megatron-LM PR 6271) raises in fp32 "
            "runs (it assumes a Float16Module) and renames keys before an older checkpoint "
            "layout can be addressed; the fix renders the layout after upstream's preprocessing",
            params=("model", "model_state_dict", "optimizer_state_dict"),
        )
        for name in _HANDLERS
    )

    def upstream_behaves(self) -> bool:
        return upstream_round_trips_layout()

    def install(self, patcher: Patcher) -> None:
        """The declared patch, then :attr:`deferred_handlers` where upstream has them."""
        super().install(patcher)
        for p in self.deferred_handlers:
            if p.check() is None:
                p.install(patcher)
