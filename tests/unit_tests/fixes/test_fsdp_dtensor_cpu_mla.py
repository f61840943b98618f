"""MLA on the CPU backend (megatron/cpu/mla_attention.py): the core attention against an explicit
reference, and real MLA / fused-MLA transformer layers built from upstream's local spec."""

import os
import sys
import types

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron.cpu.mla_attention import CpuMLACoreAttention
from tests.helpers.dist import run_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_cpu_mla_bodies


def _config(**kw):
    base = dict(
        context_parallel_size=1,
        softmax_type="vanilla",
        window_size=None,
        kv_channels=8,
        attention_dropout=0.0,
        sequence_parallel=False,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def _reference(q, k, v, masked, scale):
    """Explicit attention as upstream's local DotProductAttention (masked scores -10000)."""
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    if masked is not None:
        scores = scores + masked.to(scores.dtype) * -10000.0
    probs = scores.softmax(-1)
    out = torch.einsum("bnst,tbnd->sbnd", probs, v)
    return out.reshape(q.size(0), q.size(1), -1)


@pytest.mark.parametrize("sq,sk,with_mask", [(6, 6, False), (6, 6, True), (2, 6, False)])
def test_core_attention_matches_reference(sq, sk, with_mask):
    torch.manual_seed(0)
    b, n, dk, dv = 2, 3, 12, 5  # query/key head size != value head size, as in MLA
    q, k, v = torch.randn(sq, b, n, dk), torch.randn(sk, b, n, dk), torch.randn(sk, b, n, dv)
    attn = CpuMLACoreAttention(
        _config(), 1, AttnMaskType.causal, "self", softmax_scale=0.3, k_channels=dk, v_channels=dv
    ).eval()
    causal = torch.ones(sq, sk, dtype=torch.bool).triu_(1 + sk - sq)  # bottom-right aligned
    mask = None
    if with_mask:
        mask = torch.rand(b, 1, sq, sk) > 0.7
        mask[..., 0] = False
    out = attn(q, k, v, mask)
    assert out.shape == (sq, b, n * dv)
    want = _reference(q, k, v, mask if with_mask else causal, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_core_attention_grouped_heads_no_mask_type():
    torch.manual_seed(1)
    q, k, v = torch.randn(4, 1, 4, 6), torch.randn(4, 1, 2, 6), torch.randn(4, 1, 2, 3)
    attn = CpuMLACoreAttention(
        _config(), 1, AttnMaskType.no_mask, "self", k_channels=6, v_channels=3
    ).eval()
    want = _reference(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), None, 6**-0.5)
    torch.testing.assert_close(attn(q, k, v, None), want, rtol=1e-5, atol=1e-6)


def test_core_attention_unsupported_inputs():
    attn = CpuMLACoreAttention(_config(), 1, AttnMaskType.causal, "self")
    x = torch.zeros(2, 1, 1, 8)
    with pytest.raises(NotImplementedError, match="packed"):
        attn(x, x, x, None, packed_seq_params=object())
    with pytest.raises(NotImplementedError, match="context parallel"):
        CpuMLACoreAttention(_config(context_parallel_size=2), 1, AttnMaskType.causal, "self")


@pytest.mark.slow
def test_mla_layers_from_local_spec_on_cpu_backend():
    """Upstream's local spec fails on k_channels; swapped, MLA and fused MLA layers build, run
    forward/backward, and agree when the fused weight is the concatenation of the unfused ones."""
    run_distributed(fsdp_cpu_mla_bodies.mla_layers, 1, timeout=300)


@pytest.mark.slow
@pytest.mark.upstream_defect(
    "megatron-core==0.20.0",
    "Megatron-LM PR 5748 on upstream main: MultiTokenPredictionLayer cannot be built without "
    "Transformer Engine (isinstance() on the mocked Inference* classes)",
)
def test_gpt_builder_builds_fused_mla_and_mtp_after_adapt_model_config():
    """megatron.cpu.specs.adapt_model_config: upstream's GPTModelBuilder builds (fused) MLA in the
    decoder and in the MTP layer with CpuMLACoreAttention; forward/backward finite."""
    run_distributed(fsdp_cpu_mla_bodies.gpt_builder_mla_mtp, 1, timeout=300)


def test_adapt_model_config_no_op_and_errors():
    import dataclasses

    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.cpu import specs

    dense = fsdp_cpu_mla_bodies._mla_gpt_config(False)
    dense.transformer = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    specs.adapt_model_config(dense)
    assert dense.transformer_layer_spec is None and not specs.COMPONENT.installed

    cfg = fsdp_cpu_mla_bodies._mla_gpt_config(True)
    cfg.transformer = dataclasses.replace(cfg.transformer, q_lora_rank=None)
    with pytest.raises(ValueError, match="needs --q-lora-rank"):
        specs.adapt_model_config(cfg)
    cfg = fsdp_cpu_mla_bodies._mla_gpt_config(False)
    cfg.transformer.attention_backend = AttnBackend.local
    with pytest.raises(ValueError, match="attention-backend local"):
        specs.adapt_model_config(cfg)
    assert cfg.transformer_layer_spec is None and not specs.COMPONENT.installed
    with pytest.raises(ValueError, match="not adapted"):
        specs.cpu_transformer_layer_spec(cfg)
