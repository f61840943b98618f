"""Model-spec adjustments the CPU backend needs (modules upstream's local spec cannot build)."""

from __future__ import annotations


def adapt_model_config(model_cfg) -> None:
    """Adjust a ``GPTModelConfig`` for the CPU backend in place (no change needed for dense/MoE
    GPT with the local spec)."""
