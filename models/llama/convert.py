"""The dense Llama HF <-> Megatron weight mapping, and the Megatron model of an HF config.

HF layout (transformers 5.x `LlamaForCausalLM`): per layer `self_attn.{q,k,v,o}_proj`,
`input_layernorm`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`; `lm_head` unless tied.
Megatron (local spec, TP1/PP1 names): fused `linear_qkv` (per KV group: q heads, k, v),
`input_layernorm`, `pre_mlp_layernorm`, `mlp.linear_fc1` = [gate; up] and `mlp.linear_fc2`.
RoPE needs no permutation (both use rotate-half).
"""
from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

from models.convert_common import (WeightGroup, attention_groups, concatenated,
                                   decoder_weight_groups, no_ignored_prefixes, no_weight_prefix,
                                   plain_text_config, renamed, unchanged_config)

HF_ARCHITECTURES = ("LlamaForCausalLM",)


# A text-only checkpoint: config.json is the text config, weights carry no prefix.
hf_text_config_from_dict = plain_text_config(LlamaConfig)
hf_weight_prefix = no_weight_prefix
hf_ignored_prefixes = no_ignored_prefixes
text_only_hf_config = unchanged_config


def weight_groups(hf: LlamaConfig, *, prefix: str = "") -> list[WeightGroup]:
    """The mapping, in checkpoint order: embeddings, layers 0..L-1, final norm, head."""
    return decoder_weight_groups(hf, _layer_groups, prefix=prefix)


def _layer_groups(hf: LlamaConfig, layer: int, prefix: str) -> list[WeightGroup]:
    h, m = f"{prefix}model.layers.{layer}.", f"decoder.layers.{layer}."
    return attention_groups(hf, h, m) + [
        concatenated((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                     m + "mlp.linear_fc1.weight"),
        renamed(h + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight"),
    ]


def megatron_config(hf: LlamaConfig, **overrides: Any):
    """The LlamaTransformerConfig equivalent to `hf` (overrides: TransformerConfig fields)."""
    from models.common import make_transformer_config
    from models.llama.config import LlamaTransformerConfig, megatron_fields

    architecture = dict(megatron_fields(hf), model_family="llama")
    return make_transformer_config(LlamaTransformerConfig, architecture, overrides,
                                   use_transformer_engine=False)


def build_model(hf: LlamaConfig, config, *, pre_process: bool = True,
                post_process: bool = True):
    """The local-spec GPTModel of `config` (from `megatron_config(hf)`), with HF's RoPE."""
    from models.common import build_gpt_model
    from models.llama.config import model_kwargs_from_hf
    from models.llama.spec import layer_spec

    model_kwargs = model_kwargs_from_hf(hf)  # first: a RoPE Megatron cannot express is an error
    spec = layer_spec(config, use_transformer_engine=False)
    return build_gpt_model(config, spec, model_kwargs, pre_process=pre_process,
                           post_process=post_process, vp_stage=None)
