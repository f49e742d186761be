"""Model-family registry, config factories, parameter counts, FP8 fields and spec selection.

References: published model sizes (Meta: Llama-3.1-8B 8.03B, Scout 109B total / 17B active, Maverick
400B / 17B; Qwen: Qwen3-30B-A3B 30.5B / 3.3B), transformers' own models instantiated on the meta
device (exact parameter counts without memory) and RoPE frequencies, megatron-core 0.19.2's
TransformerConfig field types, and Megatron models actually built at tiny size. Nothing here starts
a process group except the tiny-model count check.
"""
import dataclasses
import typing

import pytest
import torch

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def models_pkg():
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    import models

    return models


def test_registry_names_and_unknown_name_error(models_pkg):
    assert models_pkg.list_model_families() == ("llama", "llama4", "qwen3_moe")
    llama4 = models_pkg.get_model_family("llama4")
    assert llama4.sizes == ("tiny", "tiny_maverick", "scout", "maverick", "demo")
    assert llama4.hf_architectures == ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
    assert models_pkg.get_model_family("qwen3_moe").hf_architectures == ("Qwen3MoeForCausalLM",)
    llama = models_pkg.get_model_family("llama")
    assert (llama.sizes, llama.hf_architectures) == (("tiny", "tiny_long", "llama3_8b"),
                                                    ("LlamaForCausalLM",))
    with pytest.raises(ValueError, match="supported families: llama, llama4, qwen3_moe"):
        models_pkg.get_model_family("llama-4-scout")
    with pytest.raises(ValueError, match=r"no size 'huge'.*\('tiny', 'tiny_maverick'"):
        llama4.transformer_config("huge")
    with pytest.raises(ValueError, match=r"no size '8b'.*\('tiny', 'tiny_long', 'llama3_8b'\)"):
        llama.transformer_config("8b")
    assert models_pkg.model_family_for_hf_architecture("Qwen3MoeForCausalLM").name == "qwen3_moe"
    assert models_pkg.model_family_for_hf_architecture("LlamaForCausalLM").name == "llama"


def test_unknown_override_is_a_clear_error(models_pkg):
    family = models_pkg.get_model_family("llama4")
    with pytest.raises(TypeError, match=r"unknown TransformerConfig override\(s\) \['tensor_parallel'\]"):
        family.transformer_config("tiny", tensor_parallel=2)
    with pytest.raises(ValueError, match="fp8 needs Transformer Engine"):
        family.transformer_config("tiny", fp8="hybrid")


def test_overrides_apply_and_layer_patterns_follow_num_layers(models_pkg):
    family = models_pkg.get_model_family("llama4")
    config = family.transformer_config(
        "maverick", num_layers=8, tensor_model_parallel_size=2, expert_model_parallel_size=4,
        sequence_parallel=True, pipeline_model_parallel_size=2)
    assert (config.tensor_model_parallel_size, config.expert_model_parallel_size,
            config.pipeline_model_parallel_size, config.sequence_parallel) == (2, 4, 2, True)
    # HF rules: NoPE at (i + 1) % 4 == 0; Maverick MoE at i = 1, 3, 5, ...
    assert config.no_rope_freq == [0, 0, 0, 1, 0, 0, 0, 1]
    assert config.moe_layer_freq == [0, 1, 0, 1, 0, 1, 0, 1]
    assert config.params_dtype == torch.bfloat16 and config.bf16


def test_llama4_scout_config_facts(models_pkg):
    family = models_pkg.get_model_family("llama4")
    c = family.transformer_config("scout")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups,
            c.kv_channels) == (48, 5120, 40, 8, 128)
    assert (c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size, c.ffn_hidden_size) == (
        8192, 8192, 16384)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_router_score_function) == (16, 1, "sigmoid")
    assert c.moe_apply_probs_on_input and c.moe_router_pre_softmax and not c.add_bias_linear
    assert c.moe_layer_freq == [1] * 48
    assert c.no_rope_freq == [0, 0, 0, 1] * 12
    assert c.qk_l2_norm and c.rotary_interleaved and c.normalization == "RMSNorm"
    assert (c.attention_chunk_size, c.attn_temperature_tuning, c.floor_scale, c.attn_scale) == (
        8192, True, 8192, 0.1)
    assert c.layernorm_epsilon == 1e-5
    maverick = family.transformer_config("maverick")
    assert maverick.num_moe_experts == 128 and not maverick.qk_l2_norm
    kwargs = family.model_kwargs("scout")
    assert kwargs == dict(vocab_size=202048, max_sequence_length=10485760,
                          position_embedding_type="rope", rotary_base=500000, rotary_percent=1.0,
                          rope_scaling=False, share_embeddings_and_output_weights=False)
    hf = family.hf_config("scout")
    assert hf["architectures"] == ["Llama4ForCausalLM"]
    assert (hf["rope_parameters"]["rope_type"], hf["rope_parameters"]["factor"]) == ("llama3", 16.0)
    assert (hf["interleave_moe_layer_step"], family.hf_config("maverick")["interleave_moe_layer_step"]
            ) == (1, 2)


def test_qwen3_30b_a3b_config_facts(models_pkg):
    family = models_pkg.get_model_family("qwen3_moe")
    c = family.transformer_config("30b_a3b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels,
            c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (
        48, 2048, 32, 4, 128, 128, 8, 768)
    assert c.qk_layernorm and not c.rotary_interleaved and c.moe_router_score_function == "softmax"
    assert not c.moe_router_pre_softmax  # norm_topk_prob=True: softmax over the top-k logits
    assert family.model_kwargs("30b_a3b")["vocab_size"] == 151936


def test_llama3_8b_config_facts(models_pkg):
    family = models_pkg.get_model_family("llama")
    c = family.transformer_config("llama3_8b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels,
            c.ffn_hidden_size) == (32, 4096, 32, 8, 128, 14336)
    assert c.gated_linear_unit and not c.add_bias_linear and not c.add_qkv_bias
    assert not c.rotary_interleaved and not c.qk_layernorm and c.num_moe_experts is None
    assert c.normalization == "RMSNorm" and c.layernorm_epsilon == 1e-5
    assert c.params_dtype == torch.bfloat16 and c.bf16
    assert (c.model_family, c.model_size) == ("llama", "llama3_8b")
    assert family.model_kwargs("llama3_8b") == dict(
        vocab_size=128256, max_sequence_length=131072, share_embeddings_and_output_weights=False,
        position_embedding_type="rope", rotary_base=500000, rotary_percent=1.0, rope_scaling=True,
        rope_scaling_factor=8.0)
    hf = family.hf_config("llama3_8b")
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert hf["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
    tiny = family.transformer_config("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_query_groups) == (4, 64, 2)
    assert tiny.params_dtype == torch.float32 and not tiny.bf16


@pytest.mark.parametrize("size", ["tiny", "llama3_8b"])
def test_llama_rope_frequencies_equal_transformers(models_pkg, size):
    # Megatron's own llama3 scaling (GPTModel rope_scaling) gives transformers' frequencies exactly.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    family = models_pkg.get_model_family("llama")
    hf = family._impl().hf_text_config(size)
    kwargs = family.model_kwargs(size)
    rope = RotaryEmbedding(kv_channels=hf.head_dim, rotary_percent=kwargs["rotary_percent"],
                           rotary_base=kwargs["rotary_base"], rope_scaling=kwargs["rope_scaling"],
                           rope_scaling_factor=kwargs["rope_scaling_factor"],
                           use_cpu_initialization=True)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    assert attention_factor == 1.0 and torch.equal(rope.inv_freq, expected)
    unscaled = 1.0 / 500000.0 ** (torch.arange(0, hf.head_dim, 2).float() / hf.head_dim)
    # Not vacuous at either size: some frequencies kept, some smoothed, some divided by 8.
    ratio = unscaled / expected
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


def test_llama_rope_configs_megatron_cannot_reproduce_are_errors(models_pkg):
    from models.llama.config import rope_kwargs
    from transformers import LlamaConfig

    family = models_pkg.get_model_family("llama")
    converter = family.converter()
    base = family.hf_config("tiny")
    llama3 = base["rope_parameters"]
    # A Llama-3.1 config.json in the older layout (rope_theta + rope_scaling) maps the same way.
    legacy = {k: v for k, v in base.items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling={k: v for k, v in llama3.items()
                                                     if k != "rope_theta"})
    assert rope_kwargs(converter.hf_text_config_from_dict(legacy)) == rope_kwargs(
        converter.hf_text_config_from_dict(base))
    assert rope_kwargs(LlamaConfig(rope_theta=10000.0))["rope_scaling"] is False
    unsupported = [
        ({**llama3, "high_freq_factor": 1.0}, "fixes"),
        ({**llama3, "original_max_position_embeddings": 4096}, "fixes"),
        ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, "RoPE type 'linear'"),
        ({"rope_type": "default", "rope_theta": 10000.5}, "not an integer"),
    ]
    for rope, message in unsupported:
        hf = converter.hf_text_config_from_dict({**base, "rope_parameters": rope})
        with pytest.raises(NotImplementedError, match=message):
            rope_kwargs(hf)
        with pytest.raises(NotImplementedError, match=message):  # no model can be built from it
            converter.build_model(hf, converter.megatron_config(hf))
    with pytest.raises(NotImplementedError, match="mlp_bias"):
        converter.megatron_config(converter.hf_text_config_from_dict({**base, "mlp_bias": True}))


def test_family_bound_to_an_hf_config(models_pkg):
    # A checkpoint's own config (not a registered size): what RLTrainer and WeightSync get.
    from transformers import LlamaConfig

    config = dict(models_pkg.get_model_family("llama").hf_config("tiny"), hidden_size=128,
                  num_hidden_layers=3, vocab_size=300)
    bound = models_pkg.model_family_for_hf_config(config)
    assert bound.family.name == "llama" and isinstance(bound.hf_config, LlamaConfig)
    c = bound.transformer_config("ignored", num_layers=2)
    assert (c.hidden_size, c.num_layers, c.model_family) == (128, 2, "llama")
    assert len(bound.weight_groups()) == 1 + 3 * 6 + 2  # embeddings, 6 per layer, norm, head
    with pytest.raises(NotImplementedError, match="local"):
        bound.transformer_config("ignored", use_transformer_engine=True)
    with pytest.raises(ValueError, match="no model family converts HF architecture"):
        models_pkg.model_family_for_hf_config({**config, "architectures": ["GPT2LMHeadModel"]})


# (family, size, published total, published active), in billions.
PUBLISHED = [("llama", "llama3_8b", 8.03, 8.03), ("llama4", "scout", 109.0, 17.0),
             ("llama4", "maverick", 400.0, 17.0), ("qwen3_moe", "30b_a3b", 30.5, 3.3)]


@pytest.mark.parametrize("family_name,size,total_b,active_b", PUBLISHED)
def test_parameter_counts_match_published_sizes(models_pkg, family_name, size, total_b, active_b):
    from models.common import count_parameters

    family = models_pkg.get_model_family(family_name)
    kwargs = family.model_kwargs(size)
    total, active = count_parameters(
        family.transformer_config(size), vocab_size=kwargs["vocab_size"],
        tie_embeddings=kwargs["share_embeddings_and_output_weights"])
    # Scout's 109B includes its vision encoder; the text model alone is 107.8B (1.1% below).
    assert abs(total / 1e9 - total_b) / total_b < 0.02, total
    assert abs(active / 1e9 - active_b) / active_b < 0.02, active


@pytest.mark.parametrize("family_name,size", [("llama", "llama3_8b"), ("llama4", "scout"),
                                              ("llama4", "maverick"), ("qwen3_moe", "30b_a3b")])
def test_parameter_formula_equals_transformers_model_on_meta_device(models_pkg, family_name, size):
    import transformers
    from models.common import count_parameters

    family = models_pkg.get_model_family(family_name)
    impl = family._impl()
    hf_cls = getattr(transformers, family.hf_architectures[0])  # the CausalLM class
    with torch.device("meta"):
        hf_model = hf_cls(impl.hf_text_config(size))
    hf_total = sum(p.numel() for p in hf_model.parameters())
    total, _ = count_parameters(family.transformer_config(size), vocab_size=impl.hf_text_config(
        size).vocab_size, tie_embeddings=False)
    assert total == hf_total


def test_fp8_recipes_map_to_megatron_fields(models_pkg, monkeypatch):
    from megatron.core.transformer import transformer_config as tc
    from models.common import fp8_config_fields

    field_types = {f.name: f.type for f in dataclasses.fields(tc.TransformerConfig)}
    hints = typing.get_type_hints(tc.TransformerConfig)
    assert fp8_config_fields(None) == {}
    assert fp8_config_fields("delayed")["fp8"] == "hybrid"
    assert fp8_config_fields("delayed")["fp8_recipe"] == "delayed"
    assert (fp8_config_fields("current")["fp8"], fp8_config_fields("current")["fp8_recipe"]) == (
        "hybrid", "tensorwise")
    for recipe in ("delayed", "current", "mxfp8", "blockwise"):
        for name, value in fp8_config_fields(recipe).items():
            assert name in field_types, name
            allowed = typing.get_args(typing.get_args(hints[name])[0]) if name in (
                "fp8", "fp8_recipe") else None
            if allowed:
                assert value in allowed, (name, value, allowed)
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        fp8_config_fields("e4m3")
    # TransformerConfig refuses MoE + FP8 unless TE >= 1.7 is installed; TE cannot be installed on
    # CPU, so let its version query report a TE-bearing machine and check everything else.
    monkeypatch.setattr(tc, "is_te_min_version", lambda *args, **kwargs: True)
    family = models_pkg.get_model_family("llama4")
    config = family.transformer_config("scout", use_transformer_engine=True,
                                       **fp8_config_fields("current"))
    assert (config.fp8, config.fp8_recipe, config.moe_grouped_gemm) == ("hybrid", "tensorwise", True)


def test_transformer_engine_spec_names_te_modules(models_pkg):
    """The GPU spec, checked on CPU without instantiating it. Without TE installed, megatron
    defines its TE classes over a stand-in, so each is compared by identity to megatron's own
    megatron.core.extensions.transformer_engine attribute."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions.transformer_engine_spec_provider import _TENormWithResidual
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.torch_norm import L2Norm
    from models.llama4.attention import Llama4CoreAttention, Llama4SelfAttention

    family = models_pkg.get_model_family("llama4")
    for use_te in (True, False):
        config = family.transformer_config("tiny_maverick", use_transformer_engine=use_te,
                                           qk_l2_norm=True)
        block = family.layer_spec(config, use_transformer_engine=use_te, pp_rank=0)
        dense, moe = block.submodules.layer_specs[:2]
        attention = dense.submodules.self_attention
        assert attention.module is Llama4SelfAttention
        core = attention.submodules.core_attention
        assert core.func is Llama4CoreAttention
        assert attention.submodules.q_layernorm is L2Norm
        assert moe.submodules.mlp.func is MoELayer
        if use_te:
            assert block.submodules.layer_norm is te_ext.TENorm
            assert core.keywords["backend_attention"] is te_ext.TEDotProductAttention
            assert attention.submodules.linear_qkv is te_ext.TELayerNormColumnParallelLinear
            assert attention.submodules.linear_proj is te_ext.TERowParallelLinear
            assert dense.submodules.input_layernorm is IdentityOp  # fused into linear_qkv
            assert dense.submodules.mlp.keywords["submodules"].linear_fc1 is \
                te_ext.TELayerNormColumnParallelLinear
            assert moe.submodules.pre_mlp_layernorm is _TENormWithResidual
            shared = moe.submodules.mlp.keywords["submodules"].shared_experts
            assert shared.keywords["submodules"].linear_fc1 is te_ext.TEColumnParallelLinear
            assert config.moe_grouped_gemm  # TE's grouped-GEMM experts where TE is installed
        else:
            assert core.keywords["backend_attention"].__name__ == "SDPACoreAttention"
            assert attention.submodules.linear_qkv is ColumnParallelLinear
            assert attention.submodules.linear_proj is RowParallelLinear
            assert dense.submodules.input_layernorm is LNImpl
            assert block.submodules.layer_norm is LNImpl
            assert not config.moe_grouped_gemm
    llama = models_pkg.get_model_family("llama")
    block = llama.layer_spec(llama.transformer_config("tiny", use_transformer_engine=True),
                             use_transformer_engine=True, pp_rank=0)
    dense = block.submodules.layer_specs[0].submodules
    assert dense.self_attention.submodules.core_attention is te_ext.TEDotProductAttention
    assert dense.self_attention.submodules.linear_qkv is te_ext.TELayerNormColumnParallelLinear
    assert dense.self_attention.submodules.q_layernorm is IdentityOp  # no q/k norm in Llama-3
    assert dense.mlp.keywords["submodules"].linear_fc1 is te_ext.TELayerNormColumnParallelLinear
    qwen = models_pkg.get_model_family("qwen3_moe")
    block = qwen.layer_spec(qwen.transformer_config("tiny", use_transformer_engine=True),
                            use_transformer_engine=True, pp_rank=0)
    attention = block.submodules.layer_specs[0].submodules.self_attention.submodules
    assert attention.core_attention is te_ext.TEDotProductAttention
    assert attention.q_layernorm is te_ext.TENorm


def test_pipeline_stage_gets_its_slice_of_layers(models_pkg):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    family = models_pkg.get_model_family("llama4")
    config = family.transformer_config("tiny_maverick", pipeline_model_parallel_size=2)
    assert config.pipeline_dtype == torch.float32
    for rank in (0, 1):
        block = family.layer_spec(config, use_transformer_engine=False, pp_rank=rank)
        mlps = [spec.submodules.mlp.func for spec in block.submodules.layer_specs]
        # Global layers 2r, 2r + 1: dense then MoE (Maverick's interleave).
        assert [getattr(f, "__name__", None) for f in mlps] == ["as_mlp_submodule", "MoELayer"]
        assert mlps[1] is MoELayer


def test_llama4_attention_helpers_against_hand_values():
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    from models.llama4.attention import (
        packed_positions,
        split_cu_seqlens_into_chunks,
        temperature_scales,
    )

    cu = torch.tensor([0, 5, 7, 20])
    assert split_cu_seqlens_into_chunks(cu, 4).tolist() == [0, 4, 5, 7, 11, 15, 19, 20]
    assert packed_positions(cu, 20).tolist() == [0, 1, 2, 3, 4, 0, 1] + list(range(13))
    # 1 + 0.1 * log(1 + floor((p + 1) / 4)): p = 0..2 -> 1; p = 3 -> 1 + 0.1 log 2; p = 7 -> log 3
    scales = temperature_scales(torch.tensor([0, 2, 3, 7]), floor_scale=4, attn_scale=0.1)
    expected = torch.tensor([1.0, 1.0, 1.0 + 0.1 * 0.6931471805599453,
                             1.0 + 0.1 * 1.0986122886681098])
    assert torch.allclose(scales, expected, atol=1e-7)
