"""Qwen3-MoE sizes: the Hugging Face configs (the source of truth) and the Megatron
TransformerConfig derived from them.

Source of "30b_a3b": Qwen/Qwen3-30B-A3B config.json (hidden 2048, 48 layers, 32 heads / 4 KV heads,
head_dim 128, 128 experts, top-8 with normalised top-k probabilities, expert width 768, vocab
151936, rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960, untied embeddings),
cross-checked against transformers 5.19.0 `Qwen3MoeConfig` defaults (which match except
num_hidden_layers=24, max_position_embeddings=32768, norm_topk_prob=False) and against slime's
Megatron arguments for this model. `megatron_fields(hf)` is the HF -> TransformerConfig mapping.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig

from models.common import FamilyTransformerConfig, make_transformer_config

_HF_SIZES: dict[str, dict[str, Any]] = {
    "30b_a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu",
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        attention_bias=False, use_sliding_window=False, decoder_sparse_step=1,
        moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=True,
        mlp_only_layers=[], bos_token_id=151643, eos_token_id=151645, initializer_range=0.02,
    ),
    "tiny": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False, use_sliding_window=False, decoder_sparse_step=1,
        moe_intermediate_size=32, num_experts_per_tok=2, num_experts=4, norm_topk_prob=True,
        mlp_only_layers=[], bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.02,
    ),
}

SIZES = tuple(_HF_SIZES)


@dataclasses.dataclass
class Qwen3MoeTransformerConfig(FamilyTransformerConfig):
    """TransformerConfig of a Qwen3-MoE size (no fields beyond the family/size record)."""


def hf_text_config(size: str) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**_HF_SIZES[size])


def hf_config(size: str) -> dict[str, Any]:
    config = hf_text_config(size).to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    return config


def _moe_pattern(hf: Qwen3MoeConfig, num_layers: int) -> list[int]:
    # HF: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    return [int(i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0)
            for i in range(num_layers)]


def megatron_fields(hf: Qwen3MoeConfig) -> dict[str, Any]:
    if hf.use_sliding_window:
        raise NotImplementedError("Qwen3-MoE sliding-window attention is not mapped to Megatron")
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
        add_qkv_bias=hf.attention_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=hf.initializer_range,
        qk_layernorm=True,           # per-head RMSNorm with weights on q and k, before RoPE
        rotary_interleaved=False,    # HF rotate_half (first half / second half)
        num_moe_experts=hf.num_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_router_score_function="softmax",
        # Softmax over the top-k logits == full softmax renormalised over the top-k
        # (norm_topk_prob=True); without renormalisation the softmax must precede top-k.
        moe_router_pre_softmax=not hf.norm_topk_prob,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_layer_freq=_moe_pattern(hf, hf.num_hidden_layers),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
    )


def transformer_config(size: str, *, use_transformer_engine: bool = False,
                       **overrides: Any) -> Qwen3MoeTransformerConfig:
    hf = hf_text_config(size)
    architecture = megatron_fields(hf)
    architecture.update(model_family="qwen3_moe", model_size=size)
    if size != "tiny":
        architecture.update(bf16=True, params_dtype=torch.bfloat16)

    def derive(fields: dict[str, Any]) -> dict[str, Any]:
        if "moe_layer_freq" in overrides:
            return {}
        return {"moe_layer_freq": _moe_pattern(hf, fields["num_layers"])}

    return make_transformer_config(Qwen3MoeTransformerConfig, architecture, overrides,
                                   use_transformer_engine=use_transformer_engine, derive=derive)


def model_kwargs(size: str) -> dict[str, Any]:
    return model_kwargs_from_hf(hf_text_config(size))


def model_kwargs_from_hf(hf: Qwen3MoeConfig) -> dict[str, Any]:
    """GPTModel keyword arguments of an HF Qwen3-MoE config (any size, e.g. a converted one)."""
    return dict(
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(hf.rope_parameters["rope_theta"]),
        rotary_percent=1.0,
        share_embeddings_and_output_weights=hf.tie_word_embeddings,
    )
