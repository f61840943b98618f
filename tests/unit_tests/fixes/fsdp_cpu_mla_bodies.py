"""Spawned body of ``test_fsdp_dtensor_cpu_mla.py`` (needs the CPU backend and parallel state)."""

import torch


def mla_layers(rank, world):
    from megatron.cpu import runtime

    runtime.activate()
    try:
        _mla_layers()
    finally:
        runtime.deactivate()


def _mla_layers():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.cpu.mla_attention import CpuMLACoreAttention, cpu_mla_layer_spec

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8,
        qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        rope_type="rope", bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    try:
        build_module(spec, config=cfg, layer_number=1)
    except TypeError as e:
        assert "k_channels" in str(e), e
    else:
        raise AssertionError("upstream local spec built MLA: the CPU module may be unnecessary")
    swapped = cpu_mla_layer_spec(spec)
    assert spec.submodules.self_attention.submodules.core_attention is not CpuMLACoreAttention

    unfused = build_module(swapped, config=cfg, layer_number=1)
    fused = build_module(cpu_mla_layer_spec(spec, fuse_down_proj=True), config=cfg, layer_number=1)
    assert type(unfused.self_attention.core_attention) is CpuMLACoreAttention
    assert type(fused.self_attention).__name__ == "FusedMLASelfAttention"

    src = dict(unfused.named_parameters())
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if name.endswith("linear_qkv_down_proj.weight"):
                head = name[: -len("linear_qkv_down_proj.weight")]
                p.copy_(torch.cat([src[head + "linear_q_down_proj.weight"],
                                   src[head + "linear_kv_down_proj.weight"]]))
            else:
                p.copy_(src[name])
    x = torch.randn(5, 2, 32)
    outs = []
    for layer in (unfused, fused):
        inp = x.clone().requires_grad_(True)
        out, _ = layer(inp, attention_mask=None)
        out.square().sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(inp.grad).all()
        outs.append((out.detach(), inp.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-6)
