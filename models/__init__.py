"""Model families for megatron_rl: one folder per family, registered by name.

`get_model_family("llama4")` returns a `ModelFamily` whose methods give the Megatron
TransformerConfig of a size, the layer spec (local on CPU, Transformer Engine on GPU), the GPTModel
keyword arguments, a built GPTModel and the Hugging Face config of that size;
`model_family_for_hf_config(config_json)` binds a family to a checkpoint's own config (any size)
with the same trainer-facing calls. Families live in
models/llama/ (dense Llama-3), models/llama4/ and models/qwen3_moe/; the registry is
models/registry.py.
"""
from models.registry import (
    HFConfigFamily,
    ModelFamily,
    get_model_family,
    list_model_families,
    model_family_for_hf_architecture,
    model_family_for_hf_config,
)

__all__ = [
    "HFConfigFamily",
    "ModelFamily",
    "get_model_family",
    "list_model_families",
    "model_family_for_hf_architecture",
    "model_family_for_hf_config",
]
