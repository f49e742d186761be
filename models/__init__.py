"""Model families for megatron_rl: one folder per family, registered by name.

`get_model_family("llama4")` returns a `ModelFamily` whose methods give the Megatron
TransformerConfig of a size, the layer spec (local on CPU, Transformer Engine on GPU), the GPTModel
keyword arguments, a built GPTModel and the Hugging Face config of that size. Families live in
models/llama4/ and models/qwen3_moe/; the registry is models/registry.py.
"""
from models.registry import (
    ModelFamily,
    get_model_family,
    list_model_families,
    model_family_for_hf_architecture,
)

__all__ = [
    "ModelFamily",
    "get_model_family",
    "list_model_families",
    "model_family_for_hf_architecture",
]
