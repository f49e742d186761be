"""The Llama-4 decoder spec and model build: megatron-core modules plus the Llama-4 attention
pieces of attention.py, local modules on CPU and Transformer Engine modules on GPU.

Every layer gets the same spec classes; RoPE-vs-NoPE behaviour (q/k L2 norm, chunked attention,
temperature tuning) is decided inside them from the layer number, and dense-vs-MoE from
`moe_layer_freq`, so the spec only depends on the config and the pipeline stage.
"""
from __future__ import annotations

from models.common import build_gpt_model, decoder_block_spec
from models.llama4.attention import Llama4SelfAttention, llama4_core_attention
from models.llama4.config import Llama4TransformerConfig, model_kwargs, rope_inv_freq


def layer_spec(config: Llama4TransformerConfig, *, use_transformer_engine: bool,
               vp_stage: int | None = None, pp_rank: int | None = None):
    if not isinstance(config, Llama4TransformerConfig):
        raise TypeError("layer_spec needs the Llama4TransformerConfig made by "
                        f"transformer_config(...), got {type(config).__name__}")
    core_attention = llama4_core_attention(use_transformer_engine)
    return decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine,
        self_attention_cls=Llama4SelfAttention, core_attention=core_attention,
        qk_norm="l2" if config.qk_l2_norm else None, vp_stage=vp_stage, pp_rank=pp_rank)


def build_model(config: Llama4TransformerConfig, *, pre_process: bool, post_process: bool,
                use_transformer_engine: bool = False, vp_stage: int | None = None):
    """GPTModel for `config`; installs HF's llama3-scaled RoPE frequencies where the size has them
    (megatron's own rope_scaling hard-codes high_freq_factor=4; Scout uses 1)."""
    spec = layer_spec(config, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage)
    model = build_gpt_model(config, spec, model_kwargs(config.model_size),
                            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    inv_freq = rope_inv_freq(config.model_size)
    if inv_freq is not None:
        rotary = model.rotary_pos_emb
        rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
        rotary.forward.cache_clear()  # RotaryEmbedding.forward is lru-cached on the instance
    return model
