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
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        rope_type="rope",
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
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
                p.copy_(
                    torch.cat(
                        [
                            src[head + "linear_q_down_proj.weight"],
                            src[head + "linear_kv_down_proj.weight"],
                        ]
                    )
                )
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


def gpt_builder_mla_mtp(rank, world):
    from megatron.cpu import runtime, specs

    runtime.activate()
    try:
        _gpt_builder_mla_mtp()
    finally:
        specs.reset()
        runtime.deactivate()


def _mla_gpt_config(fused: bool):
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.training.models.gpt import GPTModelConfig

    cfg = MLATransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        rope_type="rope",
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        transformer_impl="local",
        mtp_num_layers=1,
        mla_down_proj_fusion=fused,
    )
    return GPTModelConfig(
        transformer=cfg, vocab_size=64, seq_length=16, position_embedding_type="rope"
    )


def _gpt_builder_mla_mtp():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.multi_latent_attention import (
        FusedMLASelfAttention,
        MLASelfAttention,
    )
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron.cpu import specs
    from megatron.cpu.mla_attention import CpuMLACoreAttention

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    pg = ProcessGroupCollection.use_mpu_process_groups()

    # upstream's builder alone cannot build MLA from the local spec (guard)
    try:
        GPTModelBuilder(_mla_gpt_config(True)).build_model(pg)
    except TypeError as e:
        assert "k_channels" in str(e), e
    else:
        raise AssertionError(
            "upstream built MLA from the local spec: adapt_model_config may be unnecessary"
        )

    for fused, cls in ((True, FusedMLASelfAttention), (False, MLASelfAttention)):
        model_cfg = _mla_gpt_config(fused)
        specs.adapt_model_config(model_cfg)
        specs.adapt_model_config(model_cfg)  # idempotent
        model = GPTModelBuilder(model_cfg).build_model(pg)
        attns = [layer.self_attention for layer in model.decoder.layers]
        attns.append(model.mtp.layers[0].mtp_model_layer.self_attention)
        for attn in attns:
            assert type(attn) is cls, type(attn)
            assert type(attn.core_attention) is CpuMLACoreAttention
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        for head in ("decoder.layers.0", "decoder.layers.1", "mtp.layers.0.mtp_model_layer"):
            if fused:
                assert shapes[f"{head}.self_attention.linear_qkv_down_proj.weight"] == (28, 32)
                assert f"{head}.self_attention.linear_q_down_proj.weight" not in shapes
            else:
                assert shapes[f"{head}.self_attention.linear_q_down_proj.weight"] == (16, 32)
                assert shapes[f"{head}.self_attention.linear_kv_down_proj.weight"] == (12, 32)
            assert shapes[f"{head}.input_layernorm.weight"] == (32,)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        position_ids = torch.arange(16).expand(2, 16)
        loss = model(tokens, position_ids, None, labels=tokens.roll(-1, 1))
        assert loss.shape == (2, 16) and torch.isfinite(loss).all()
        loss.sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
