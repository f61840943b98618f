"""Fix group ``fsdp_dtensor``: Megatron-FSDP checkpoints (``--use-megatron-fsdp --ckpt-format
fsdp_dtensor``) of megatron-core 0.19.2. Each part is its own :class:`~megatron.overlay.fix.Fix`
and stands aside on its own when the installed upstream already behaves:

* :mod:`.layout`: fused MLA down projection and MTP layers are saved in the unfused layout, with
  their optimizer state (Megatron-LM PR 6271: ``handle_mla_down_proj_in_state_dict``,
  ``handle_mtp_in_state_dict``; section views in :mod:`.sections`);
* :mod:`.legacy_planner`: checkpoints written by the unfixed 0.17-0.19.2 code still load;
* :mod:`.strictness`: partial loads honour ``--dist-ckpt-strictness``
  (``validate_fsdp_dtensor_model_load``) instead of silently keeping initial weights;
* :mod:`.empty_shards`: parameters with an empty local FSDP shard get optimizer state, so every
  rank runs the same collectives and the save/load no longer hangs.

Design notes: ``docs/fixes/fsdp_dtensor.md``.
"""

from __future__ import annotations

from megatron.fixes.fsdp_dtensor.empty_shards import (
    EmptyShardsFix,
    StepAgreement,
    agree_on_step,
    fill_empty_shard_states,
)
from megatron.fixes.fsdp_dtensor.layout import (
    LAYERNORM_MAP,
    MTP_DISK,
    MTP_LIVE,
    NEW_LAYOUT,
    Choice,
    MlaMtpLayoutFix,
    ModelLayout,
    Preparation,
    PreparedStateDict,
    find_mla_modules,
    find_model_layout,
    find_mtp_layers,
    handle_mla_down_proj_in_state_dict,
    handle_mtp_in_state_dict,
    map_key,
    mla_hit,
    prepare_state_dict,
    strip_wrappers,
)
from megatron.fixes.fsdp_dtensor.legacy_planner import (
    LegacyPlannerFix,
    detect_choice,
    resolve_layout,
)
from megatron.fixes.fsdp_dtensor.sections import (
    FUSED,
    KV_SECTION,
    Q_SECTION,
    MlaModule,
    MlaSectionSizes,
    intersect,
    mla_section_sizes,
    section_view,
    split_fused,
)
from megatron.fixes.fsdp_dtensor.strictness import (
    STRICTNESS_MODES,
    StrictnessFix,
    flatten_keys,
    handle_unexpected_keys,
    unexpected_model_keys,
    validate_fsdp_dtensor_model_load,
)
from megatron.overlay import FixGroup

__all__ = [
    "FIX",
    "FsdpDTensorFix",
    "EmptyShardsFix",
    "LegacyPlannerFix",
    "MlaMtpLayoutFix",
    "StrictnessFix",
    "Choice",
    "NEW_LAYOUT",
    "ModelLayout",
    "MlaModule",
    "MlaSectionSizes",
    "Preparation",
    "PreparedStateDict",
    "StepAgreement",
    "FUSED",
    "Q_SECTION",
    "KV_SECTION",
    "MTP_LIVE",
    "MTP_DISK",
    "LAYERNORM_MAP",
    "STRICTNESS_MODES",
    "agree_on_step",
    "detect_choice",
    "fill_empty_shard_states",
    "find_mla_modules",
    "find_model_layout",
    "find_mtp_layers",
    "flatten_keys",
    "handle_mla_down_proj_in_state_dict",
    "handle_mtp_in_state_dict",
    "handle_unexpected_keys",
    "intersect",
    "map_key",
    "mla_hit",
    "mla_section_sizes",
    "prepare_state_dict",
    "resolve_layout",
    "section_view",
    "split_fused",
    "strip_wrappers",
    "unexpected_model_keys",
    "validate_fsdp_dtensor_model_load",
]


class FsdpDTensorFix(FixGroup):
    """The ``fsdp_dtensor`` fix: its four parts, installed in this order (each probing upstream
    itself): empty shards, MLA/MTP layout, legacy planner, strictness."""

    name = "fsdp_dtensor"
    title = (
        "Megatron-FSDP fsdp_dtensor checkpoints: fused MLA down projection and MTP saved in "
        "the unfused layout, legacy layouts still load, partial loads honour strictness, "
        "empty FSDP shards no longer hang the save/load"
    )
    upstream_refs = (
        "Megatron-LM PR 6271",
        "megatron-core 0.19.2 ParamAndGradBuffer.update_main_grads (empty shard: no "
        "optimizer state, ranks issue different collectives)",
    )
    package = "megatron-core"

    def __init__(self) -> None:
        self.empty_shards = EmptyShardsFix()
        self.layout = MlaMtpLayoutFix()
        self.legacy_planner = LegacyPlannerFix()
        self.strictness = StrictnessFix()
        self.parts = (self.empty_shards, self.layout, self.legacy_planner, self.strictness)
        super().__init__()

    @property
    def last_unexpected_keys(self) -> frozenset:
        """Model keys the last partial load found missing (see :class:`StrictnessFix`)."""
        return self.strictness.last_unexpected_keys

    def layout_upstream_fixed(self) -> bool:
        """Upstream saves the fused MLA / MTP layout and validates partial loads itself (the
        layout, legacy-planner and strictness parts all stand aside)."""
        return all(
            p.upstream_behaves() for p in (self.layout, self.legacy_planner, self.strictness)
        )

    def empty_shards_upstream_fixed(self) -> bool:
        """Upstream gives empty-shard parameters optimizer state (the empty-shards part stands
        aside)."""
        return self.empty_shards.upstream_behaves()


FIX = FsdpDTensorFix()
