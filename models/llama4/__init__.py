"""Llama-4 (Scout 17B x 16E, Maverick 17B x 128E, tiny test sizes, the demo's base size) for
Megatron: config factory (config.py), Llama-4 attention submodules (attention.py), layer spec and
model build (spec.py); the HF <-> Megatron mapping and SGLang's checkpoint layout (convert.py).
"""
from models.llama4.config import (
    SIZES,
    Llama4TransformerConfig,
    hf_config,
    hf_text_config,
    megatron_fields,
    model_kwargs,
    rope_inv_freq,
    transformer_config,
)
from models.llama4.spec import build_model, layer_spec

__all__ = [
    "SIZES",
    "Llama4TransformerConfig",
    "build_model",
    "hf_config",
    "hf_text_config",
    "layer_spec",
    "megatron_fields",
    "model_kwargs",
    "rope_inv_freq",
    "transformer_config",
]
