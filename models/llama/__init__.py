"""Dense Llama-3 (Llama-3.1-8B, tiny test size) for Megatron: config factory (config.py), layer
spec and model build (spec.py), HF <-> Megatron mapping (convert.py)."""
from models.llama.config import (
    SIZES,
    LlamaTransformerConfig,
    hf_config,
    hf_text_config,
    megatron_fields,
    model_kwargs,
    rope_kwargs,
    transformer_config,
)
from models.llama.spec import build_model, layer_spec

__all__ = [
    "SIZES",
    "LlamaTransformerConfig",
    "build_model",
    "hf_config",
    "hf_text_config",
    "layer_spec",
    "megatron_fields",
    "model_kwargs",
    "rope_kwargs",
    "transformer_config",
]
