"""The Qwen3-MoE HF <-> Megatron weight mapping, and the Megatron model of an HF config.

HF layout on disk (what transformers 5.x `save_pretrained` writes; it fuses experts only in
memory): per layer `self_attn.{q,k,v,o}_proj`, per-head RMSNorm weights `self_attn.{q,k}_norm`,
`input_layernorm`, `post_attention_layernorm`, and either a dense `mlp.{gate,up,down}_proj`
(layers in `mlp_only_layers` or off the `decoder_sparse_step` grid) or the router `mlp.gate` [E, H]
with per-expert `mlp.experts.{e}.{gate,up,down}_proj` (nn.Linear layout). No shared expert.
Megatron (local spec, TP1/EP1/PP1 names): fused `linear_qkv`, `q_layernorm` / `k_layernorm`,
`mlp.router`, `mlp.experts.local_experts.{e}.linear_fc1` = [gate; up] and `linear_fc2`.
RoPE needs no permutation (both use rotate-half).
"""
from __future__ import annotations

from typing import Any

from transformers import Qwen3MoeConfig

from models.convert_common import (WeightGroup, attention_groups, concatenated,
                                   decoder_weight_groups, no_ignored_prefixes, no_weight_prefix,
                                   plain_text_config, renamed, unchanged_config)

HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


# A text-only checkpoint: config.json is the text config, weights carry no prefix.
hf_text_config_from_dict = plain_text_config(Qwen3MoeConfig)
hf_weight_prefix = no_weight_prefix
hf_ignored_prefixes = no_ignored_prefixes
text_only_hf_config = unchanged_config


def is_moe_layer(hf: Qwen3MoeConfig, layer: int) -> bool:
    # transformers' Qwen3MoeDecoderLayer rule.
    return (layer not in hf.mlp_only_layers and hf.num_experts > 0
            and (layer + 1) % hf.decoder_sparse_step == 0)


def weight_groups(hf: Qwen3MoeConfig, *, prefix: str = "") -> list[WeightGroup]:
    """The mapping, in checkpoint order: embeddings, layers 0..L-1, final norm, head."""
    return decoder_weight_groups(hf, _layer_groups, prefix=prefix)


def _layer_groups(hf: Qwen3MoeConfig, layer: int, prefix: str) -> list[WeightGroup]:
    h, m = f"{prefix}model.layers.{layer}.", f"decoder.layers.{layer}."
    groups = attention_groups(hf, h, m, qk_norm=True)
    if not is_moe_layer(hf, layer):
        return groups + [
            concatenated((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                         m + "mlp.linear_fc1.weight"),
            renamed(h + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight"),
        ]
    groups.append(renamed(h + "mlp.gate.weight", m + "mlp.router.weight"))
    for e in range(hf.num_experts):
        expert, local = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
        groups += [
            concatenated((expert + "gate_proj.weight", expert + "up_proj.weight"),
                         local + "linear_fc1.weight"),
            renamed(expert + "down_proj.weight", local + "linear_fc2.weight"),
        ]
    return groups


def megatron_config(hf: Qwen3MoeConfig, **overrides: Any):
    """The Qwen3MoeTransformerConfig equivalent to `hf` (overrides: TransformerConfig fields)."""
    from models.common import make_transformer_config
    from models.qwen3_moe.config import Qwen3MoeTransformerConfig, megatron_fields

    architecture = dict(megatron_fields(hf), model_family="qwen3_moe")
    return make_transformer_config(Qwen3MoeTransformerConfig, architecture, overrides,
                                   use_transformer_engine=False)


def build_model(hf: Qwen3MoeConfig, config, *, pre_process: bool = True,
                post_process: bool = True):
    """The local-spec GPTModel of `config` (from `megatron_config(hf)`)."""
    from models.common import build_gpt_model
    from models.qwen3_moe.config import model_kwargs_from_hf
    from models.qwen3_moe.spec import layer_spec

    spec = layer_spec(config, use_transformer_engine=False)
    return build_gpt_model(config, spec, model_kwargs_from_hf(hf), pre_process=pre_process,
                           post_process=post_process, vp_stage=None)
