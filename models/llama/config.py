"""Dense Llama-3 sizes: the Hugging Face configs (the source of truth) and the Megatron
TransformerConfig derived from them.

Source of "llama3_8b": meta-llama/Llama-3.1-8B config.json (hidden 4096, 32 layers, 32 heads / 8 KV
heads, head_dim 128, SwiGLU width 14336, vocab 128256, rms_norm_eps 1e-5, untied embeddings,
max_position_embeddings 131072, rope_theta 500000 with llama3 scaling: factor 8, low_freq_factor 1,
high_freq_factor 4, original_max_position_embeddings 8192), cross-checked against transformers
5.19.0 `LlamaConfig` and Meta's published 8.03B parameters. "tiny" keeps every Llama-3 mechanism
(GQA, SwiGLU, the same llama3 RoPE scaling; with head_dim 16 and theta 500000 its frequencies fall
in all three bands: kept, smoothed, divided by the factor) at test scale.

RoPE: megatron-core's RotaryEmbedding implements llama3 scaling with a configurable factor but
fixed low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192 (every
Llama-3.1 / 3.2 / 3.3 checkpoint's values). `rope_kwargs(hf)` maps those; any other RoPE type or
llama3 parameters raise NotImplementedError rather than build a model that silently differs.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from models.common import FamilyTransformerConfig, make_transformer_config

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

_HF_SIZES: dict[str, dict[str, Any]] = {
    "llama3_8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(_LLAMA3_ROPE), attention_bias=False, mlp_bias=False,
        bos_token_id=128000, eos_token_id=128001, initializer_range=0.02,
    ),
    "tiny": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        # > original_max_position_embeddings 8192, as transformers expects of llama3 scaling.
        max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(_LLAMA3_ROPE), attention_bias=False, mlp_bias=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.02,
    ),
    # The long-generation e2e's model (tests/e2e/test_long_generation.py): one layer and one KV
    # head, because SGLang's CPU decode gathers every layer's cached keys and values of the
    # whole context at every step (at 16k tokens that, not the model, is the step's cost), and
    # a 32k context for 16k-token completions.
    "tiny_long": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(_LLAMA3_ROPE), attention_bias=False, mlp_bias=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.02,
    ),
}

SIZES = tuple(_HF_SIZES)

# The llama3 scaling parameters megatron-core's RotaryEmbedding._apply_scaling hard-codes.
_MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}


@dataclasses.dataclass
class LlamaTransformerConfig(FamilyTransformerConfig):
    """TransformerConfig of a dense Llama size (no fields beyond the family/size record)."""


def hf_text_config(size: str) -> LlamaConfig:
    return LlamaConfig(**_HF_SIZES[size])


def hf_config(size: str) -> dict[str, Any]:
    config = hf_text_config(size).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    return config


def megatron_fields(hf: LlamaConfig) -> dict[str, Any]:
    """TransformerConfig fields equivalent to an HF Llama config."""
    if hf.attention_bias or hf.mlp_bias:
        raise NotImplementedError(
            f"Llama with attention_bias={hf.attention_bias} / mlp_bias={hf.mlp_bias} is not "
            "mapped to Megatron (Llama-3 checkpoints have no biases)")
    if hf.hidden_act != "silu":
        raise NotImplementedError(f"Llama hidden_act {hf.hidden_act!r}: only 'silu' (SwiGLU) "
                                  "is mapped to Megatron")
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_dropout=hf.attention_dropout,
        hidden_dropout=0.0,
        init_method_std=hf.initializer_range,
        rotary_interleaved=False,    # HF rotate_half (first half / second half)
    )


def transformer_config(size: str, *, use_transformer_engine: bool = False,
                       **overrides: Any) -> LlamaTransformerConfig:
    architecture = megatron_fields(hf_text_config(size))
    architecture.update(model_family="llama", model_size=size)
    if size != "tiny":
        architecture.update(bf16=True, params_dtype=torch.bfloat16)
    return make_transformer_config(LlamaTransformerConfig, architecture, overrides,
                                   use_transformer_engine=use_transformer_engine)


def rope_kwargs(hf: LlamaConfig) -> dict[str, Any]:
    """GPTModel RoPE arguments reproducing transformers' RoPE of `hf` exactly, or
    NotImplementedError naming what megatron-core cannot express."""
    rope = dict(hf.rope_parameters)
    theta = rope["rope_theta"]
    if float(theta) != int(theta):
        raise NotImplementedError(f"rope_theta {theta} is not an integer: megatron-core's "
                                  "rotary_base is an int")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError(
            f"partial_rotary_factor {rope['partial_rotary_factor']}: Llama rotates whole heads")
    kwargs = dict(position_embedding_type="rope", rotary_base=int(theta), rotary_percent=1.0)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return dict(kwargs, rope_scaling=False)
    if rope_type == "llama3":
        fixed = {name: rope[name] for name in _MEGATRON_LLAMA3_FIXED}
        if fixed != _MEGATRON_LLAMA3_FIXED:
            raise NotImplementedError(
                f"llama3 RoPE scaling with {fixed}: megatron-core's RotaryEmbedding fixes "
                f"{_MEGATRON_LLAMA3_FIXED} (only the factor is configurable)")
        return dict(kwargs, rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    raise NotImplementedError(f"RoPE type {rope_type!r} is not mapped to Megatron for Llama; "
                              "supported: 'default' and 'llama3'")


def model_kwargs(size: str) -> dict[str, Any]:
    return model_kwargs_from_hf(hf_text_config(size))


def model_kwargs_from_hf(hf: LlamaConfig) -> dict[str, Any]:
    """GPTModel keyword arguments of an HF Llama config (any size, e.g. a converted one)."""
    return dict(
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        share_embeddings_and_output_weights=hf.tie_word_embeddings,
        **rope_kwargs(hf),
    )
