"""The dense Llama decoder spec and model build: megatron-core's own modules (standard
SelfAttention without q/k norms, SwiGLU MLP), local on CPU and Transformer Engine on GPU."""
from __future__ import annotations

from models.common import build_gpt_model, standard_decoder_spec
from models.llama.config import LlamaTransformerConfig, model_kwargs


def layer_spec(config: LlamaTransformerConfig, *, use_transformer_engine: bool,
               vp_stage: int | None = None, pp_rank: int | None = None):
    return standard_decoder_spec(config, use_transformer_engine=use_transformer_engine,
                                 qk_norm=None, vp_stage=vp_stage, pp_rank=pp_rank)


def build_model(config: LlamaTransformerConfig, *, pre_process: bool, post_process: bool,
                use_transformer_engine: bool = False, vp_stage: int | None = None):
    spec = layer_spec(config, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage)
    return build_gpt_model(config, spec, model_kwargs(config.model_size),
                           pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
