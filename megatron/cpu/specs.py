"""Model-spec adjustments the CPU backend needs (modules upstream's local spec cannot build).

``pretrain_gpt.py --cpu`` calls :func:`adapt_model_config` on the ``GPTModelConfig`` built by
upstream's ``gpt_config_from_args``, before ``pretrain()``. Dense and MoE GPT (also with MTP) need
nothing. Multi-Latent Attention (``--multi-latent-attention``) does: upstream's local spec builds
its core attention as ``DotProductAttention``, which rejects MLA's ``k_channels`` / ``v_channels``
(``TypeError``), and the local spec cannot express the fused down projection
(``--mla-down-proj-fusion``; upstream builds it only from Transformer Engine modules and silently
falls back to the unfused attention otherwise). So for MLA the core attention is swapped for
:mod:`megatron.cpu.mla_attention`'s, with the fused down projection when asked for; the MTP block
spec is wrapped by the component :data:`COMPONENT` (:class:`CpuMlaSpec`, ``cpu_mla``), which
:func:`adapt_model_config` installs for an MLA model.

Design notes: ``docs/cpu-backend.md``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from megatron.overlay import Patch, wraps_upstream
from megatron.overlay.component import Component

#: Attribute set on an adapted ``GPTModelConfig``: ``{'fuse_down_proj': bool, 'base': spec}``.
MARK = "_cpu_backend_mla"


def _fuse(model_cfg) -> bool:
    return bool(getattr(model_cfg.transformer, "mla_down_proj_fusion", False))


def _resolve(spec, model_cfg, vp_stage):
    """A spec value as ``GPTModelBuilder.build_model`` resolves it (ModuleSpec, block spec, or a
    callable taking the config and optionally ``vp_stage``)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is None:
        from megatron.training.models.gpt import default_layer_spec

        return default_layer_spec(model_cfg, vp_stage)
    if not isinstance(spec, ModuleSpec) and callable(spec):
        if "vp_stage" in inspect.signature(spec).parameters:
            return spec(model_cfg, vp_stage=vp_stage)
        return spec(model_cfg)
    return spec


def cpu_transformer_layer_spec(model_cfg, vp_stage: int | None = None):
    """Layer (or block) spec for a config adapted by :func:`adapt_model_config`: upstream's spec
    with every MLA attention swapped for the CPU one (a fresh copy per call).

    Raises:
        ValueError: ``model_cfg`` was not adapted by :func:`adapt_model_config`.
    """
    from megatron.cpu.mla_attention import cpu_mla_layer_spec

    mark = getattr(model_cfg, MARK, None)
    if mark is None:
        raise ValueError(
            "cpu_transformer_layer_spec: config not adapted by "
            "megatron.cpu.specs.adapt_model_config"
        )
    return cpu_mla_layer_spec(
        _resolve(mark["base"], model_cfg, vp_stage), fuse_down_proj=mark["fuse_down_proj"]
    )


def wrap_mtp_block_spec(original):
    """Factory: upstream's ``mtp_block_spec`` with the MTP inner layer of an MLA model rebuilt by
    ``cpu_mla_layer_spec`` for configs marked by :func:`adapt_model_config`."""
    from megatron.cpu.mla_attention import cpu_mla_layer_spec

    @wraps_upstream(original)
    def cpu_mtp_block_spec(config, transformer_layer_spec, vp_stage=None):
        """Upstream's MTP block spec, its inner layer rebuilt by ``cpu_mla_layer_spec`` for
        configs marked by :func:`adapt_model_config`."""
        spec = original(config, transformer_layer_spec, vp_stage=vp_stage)
        mark = getattr(config, MARK, None)
        if spec is None or mark is None:
            return spec
        return cpu_mla_layer_spec(spec, fuse_down_proj=mark["fuse_down_proj"])

    return cpu_mtp_block_spec


#: What :data:`COMPONENT` replaces.
PATCHES = (
    Patch(
        "megatron.training.models.gpt.mtp_block_spec",
        wrap_mtp_block_spec,
        "the MTP inner layer of an MLA model is rebuilt from the local spec, whose "
        "DotProductAttention cannot build MLA",
        params=("config", "transformer_layer_spec", "vp_stage"),
    ),
)


@dataclass
class CpuMlaState:
    """An install of :class:`CpuMlaSpec` (it holds nothing: the adapted config carries the mark)."""


def _is_mla(model_cfg: Any) -> bool:
    return bool(getattr(getattr(model_cfg, "transformer", None), "multi_latent_attention", False))


class CpuMlaSpec(Component[CpuMlaState]):
    """The MTP inner layer of an MLA model rebuilt with the CPU attention; installed by
    :func:`adapt_model_config` (``pretrain_gpt.py --cpu``) when the model config has Multi-Latent
    Attention, not by the training hooks."""

    name = "cpu_mla"
    title = (
        "--cpu with Multi-Latent Attention: the MTP inner layer built with the CPU MLA attention"
    )
    installed_at = "model"
    patches = PATCHES

    def enabled(self, model_cfg: Any) -> bool:
        """A ``GPTModelConfig`` with ``multi_latent_attention`` (``None``: :func:`install`)."""
        return model_cfg is None or _is_mla(model_cfg)

    def new_state(self, model_cfg: Any) -> CpuMlaState:
        return CpuMlaState()


#: The component (entry point ``cpu_mla``).
COMPONENT = CpuMlaSpec()


def install() -> None:
    """Wrap upstream's ``mtp_block_spec`` (idempotent; :func:`reset` undoes it)."""
    COMPONENT.install()


def reset() -> None:
    """Undo :func:`install` (tests)."""
    COMPONENT.uninstall()


def adapt_model_config(model_cfg) -> None:
    """Adjust a ``GPTModelConfig`` for the CPU backend in place.

    No change for models without Multi-Latent Attention. With ``multi_latent_attention``: marks
    the config, sets ``transformer_layer_spec`` to :func:`cpu_transformer_layer_spec` (keeping a
    spec given before, e.g. ``--spec``, as the base) and installs the MTP wrapper. Idempotent.

    Raises:
        ValueError: ``mla_down_proj_fusion`` without ``q_lora_rank`` (the fused projection needs a
            q latent), or ``--attention-backend local`` (upstream's builder would put the local
            ``DotProductAttention`` back, which cannot build MLA). Every rank calls this with the
            same arguments, so every rank raises.
    """
    transformer = model_cfg.transformer
    if not _is_mla(model_cfg):
        return
    if getattr(model_cfg, MARK, None) is not None:
        return
    fuse = _fuse(model_cfg)
    if fuse and not getattr(transformer, "q_lora_rank", None):
        raise ValueError(
            "--cpu: --mla-down-proj-fusion needs --q-lora-rank (the fused down "
            "projection holds the q and kv latents)"
        )
    from megatron.core.transformer.enums import AttnBackend

    if getattr(transformer, "attention_backend", None) == AttnBackend.local:
        raise ValueError(
            "--cpu: --attention-backend local replaces the core attention by "
            "DotProductAttention, which cannot build Multi-Latent Attention; leave "
            "the attention backend at its default"
        )
    object.__setattr__(
        model_cfg, MARK, {"fuse_down_proj": fuse, "base": model_cfg.transformer_layer_spec}
    )
    model_cfg.transformer_layer_spec = cpu_transformer_layer_spec
    COMPONENT.install(model_cfg)
