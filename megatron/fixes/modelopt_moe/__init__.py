"""ModelOpt-quantized MoE models in Megatron checkpoints (ModelOpt issue 2209): the fix group
``modelopt_moe`` (one name for ``$MEGATRON_FIXES_DISABLE``).

Its parts, each a :class:`~megatron.overlay.fix.Fix` with its own pin and capability probe (a part
stands aside on its own when upstream behaves for it):

* :mod:`.expert_sharding`: quantizer tensors of expert linears sharded over ETP/EP/EDP;
* :mod:`.legacy_layout`: pre-per-expert quantizer checkpoints mapped onto per-expert models on
  load, unmappable layouts raised on every rank (:class:`QuantizerLayoutError`);
* :mod:`.extra_state_cuda_sync`: ModelOpt extra state serialised without CUDA;
* :mod:`megatron.fixes.modelopt_state`: ModelOpt state in persistent and local checkpoints (a
  megatron-core defect; a part here so that the CLI keeps listing ten fixes).

Quantizer inspection: :mod:`megatron.fixes.modelopt_tensors`; user helpers (summary, restore):
:mod:`megatron.training_ext.modelopt`. Design notes and limits:
``docs/fixes/modelopt_moe.md``.
"""

from __future__ import annotations

from megatron.fixes import modelopt_state
from megatron.fixes.modelopt_moe import expert_sharding, extra_state_cuda_sync, legacy_layout
from megatron.fixes.modelopt_moe.expert_sharding import (
    ExpertCoords,
    expert_quantizer_sharded_tensor,
    probe_upstream_expert_replica_ids,
    regroup_expert_linear_entries,
)
from megatron.fixes.modelopt_moe.legacy_layout import (
    LayoutPlan,
    QuantizerLayoutError,
    plan_quantizer_layout,
)
from megatron.overlay import FixGroup

__all__ = [
    "FIX",
    "ExpertCoords",
    "LayoutPlan",
    "ModeloptMoeFix",
    "QuantizerLayoutError",
    "expert_quantizer_sharded_tensor",
    "plan_quantizer_layout",
    "probe_upstream_expert_replica_ids",
    "regroup_expert_linear_entries",
]


class ModeloptMoeFix(FixGroup):
    """Per-expert ModelOpt quantizer state: sharding, legacy layouts, CPU, ModelOpt state."""

    name = "modelopt_moe"
    title = "Per-expert ModelOpt quantizer state: expert-group sharding, layout mapping on load"
    upstream_refs = ("ModelOpt issue 2209",)
    package = "nvidia-modelopt"
    parts = (expert_sharding.FIX, legacy_layout.FIX, extra_state_cuda_sync.FIX, modelopt_state.FIX)


FIX = ModeloptMoeFix()
