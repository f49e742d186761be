"""The dense Llama decoder spec and model build: megatron-core's own modules (standard
SelfAttention without q/k norms, SwiGLU MLP), local on CPU and Transformer Engine on GPU."""
from __future__ import annotations

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention

from models.common import build_gpt_model, decoder_block_spec
from models.llama.config import LlamaTransformerConfig, model_kwargs


def layer_spec(config: LlamaTransformerConfig, *, use_transformer_engine: bool,
               vp_stage: int | None = None, pp_rank: int | None = None):
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        core_attention = TEDotProductAttention
    else:
        core_attention = DotProductAttention
    return decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, self_attention_cls=SelfAttention,
        core_attention=core_attention, qk_norm=None, vp_stage=vp_stage, pp_rank=pp_rank)


def build_model(config: LlamaTransformerConfig, *, pre_process: bool, post_process: bool,
                use_transformer_engine: bool = False, vp_stage: int | None = None):
    spec = layer_spec(config, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage)
    return build_gpt_model(config, spec, model_kwargs(config.model_size),
                           pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
