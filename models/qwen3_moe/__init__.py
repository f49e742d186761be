"""Qwen3-MoE (Qwen3-30B-A3B, tiny test size) for Megatron: config factory (config.py), layer spec
and model build (spec.py)."""
from models.qwen3_moe.config import (
    SIZES,
    Qwen3MoeTransformerConfig,
    hf_config,
    hf_text_config,
    megatron_fields,
    model_kwargs,
    transformer_config,
)
from models.qwen3_moe.spec import build_model, layer_spec

__all__ = [
    "SIZES",
    "Qwen3MoeTransformerConfig",
    "build_model",
    "hf_config",
    "hf_text_config",
    "layer_spec",
    "megatron_fields",
    "model_kwargs",
    "transformer_config",
]
