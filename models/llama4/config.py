"""Llama-4 sizes: the Hugging Face text configs (the source of truth) and the Megatron
TransformerConfig derived from them.

Each size is a set of `transformers.Llama4TextConfig` arguments. Sources of the real sizes:
meta-llama/Llama-4-Scout-17B-16E(-Instruct) and meta-llama/Llama-4-Maverick-17B-128E(-Instruct)
config.json `text_config` (as reproduced verbatim in public test fixtures, e.g. TensorRT-LLM's
Maverick fixture and vLLM/tpu-inference's Scout attention config), cross-checked against
transformers 5.19.0 `Llama4TextConfig` defaults, which equal Scout's text config except where noted
below. `megatron_fields(hf)` maps an HF text config to TransformerConfig fields; the same mapping
is what a converter must assume. The tiny sizes keep every Llama-4 mechanism but at test scale:
4 layers (3 RoPE/chunked + 1 NoPE/global), chunk 8 and floor_scale 4 so chunking and temperature
tuning act on 16-32-token sequences. The "demo" size (`make demo`'s base model) keeps them at a
size that learns short arithmetic on a CPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Llama4TextConfig

from models.common import FamilyTransformerConfig, make_transformer_config

_COMMON_REAL = dict(
    # Llama4TextConfig defaults (transformers 5.19.0) that Scout's and Maverick's config.json repeat.
    vocab_size=202048,
    hidden_size=5120,
    intermediate_size=8192,        # routed expert and shared expert width
    intermediate_size_mlp=16384,   # dense-layer MLP width (Maverick's dense layers)
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    num_experts_per_tok=1,
    no_rope_layer_interval=4,      # every 4th layer is NoPE + global attention
    attention_chunk_size=8192,
    attn_temperature_tuning=True,  # Scout's config.json stores 4: convert.as_released_fields
    floor_scale=8192,
    attn_scale=0.1,
    attention_bias=False,
    tie_word_embeddings=False,
    bos_token_id=200000,           # config.json values (the HF class default is 1 / 2)
    eos_token_id=[200001, 200007, 200008],
    pad_token_id=200018,
    initializer_range=0.02,
)

_HF_SIZES: dict[str, dict[str, Any]] = {
    "scout": dict(
        _COMMON_REAL,
        num_local_experts=16,
        interleave_moe_layer_step=1,   # every layer is MoE
        use_qk_norm=True,
        max_position_embeddings=10485760,
        # Scout's llama3 RoPE scaling; low == high frequency factor (no smoothed band), which
        # megatron-core's built-in rope_scaling (fixed high_freq_factor=4) cannot express.
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192},
    ),
    "maverick": dict(
        _COMMON_REAL,
        num_local_experts=128,
        interleave_moe_layer_step=2,   # layers 1, 3, 5, ... are MoE; the others dense
        use_qk_norm=False,             # Maverick's config.json: "use_qk_norm": false
        max_position_embeddings=1048576,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "tiny": dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_act="silu", rms_norm_eps=1e-5, num_experts_per_tok=1, num_local_experts=4,
        interleave_moe_layer_step=1, use_qk_norm=True, no_rope_layer_interval=4,
        attention_chunk_size=8, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1,
        attention_bias=False, tie_word_embeddings=False, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.02,
        # Scout-style llama3 scaling at test scale: frequencies with wavelength > 16 are scaled.
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 16},
    ),
}
# Maverick's mechanisms at test scale: dense/MoE interleave, no q/k norm, plain RoPE.
_HF_SIZES["tiny_maverick"] = dict(
    _HF_SIZES["tiny"], interleave_moe_layer_step=2, use_qk_norm=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# The demo's base model (tools/make_demo_base.py): Scout's mechanisms (3 chunked-attention RoPE
# layers with q/k L2 norm and llama3 RoPE, then a temperature-tuned global NoPE layer; top-1
# sigmoid MoE with a shared expert on every layer) at a size a 2-core CPU fine-tunes on short
# arithmetic in under two minutes (1.2 M parameters). A prompt plus worked solution is ~37 tokens
# and fits one 48-token chunk; longer completions (forced interruptions, rambling) cross into the
# second chunk, where only the NoPE layer reads what came before. With 32-token chunks the answer
# itself landed past the boundary and the warm-up model often failed to copy its own worked result
# into it (held-out pass rate 0.24 at T = 1 against 0.52 with 48; the answer then no longer
# follows from the reasoning, which RL credits wrongly). Every 4th layer is NoPE as in Scout; SGLang 0.5.23 hard-codes that pattern
# (models/llama4.py: use_rope = (layer_id + 1) % 4 != 0), so no other interval can be served.
_HF_SIZES["demo"] = dict(
    _HF_SIZES["tiny"], hidden_size=128, intermediate_size=128, intermediate_size_mlp=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
    attention_chunk_size=48, floor_scale=32, max_position_embeddings=512,
    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                     "original_max_position_embeddings": 32})

SIZES = tuple(_HF_SIZES)


@dataclasses.dataclass
class Llama4TransformerConfig(FamilyTransformerConfig):
    """TransformerConfig plus the Llama-4 attention fields megatron-core 0.19.2 lacks.

    RoPE layers (no_rope_freq[i] == 0) use chunked local attention over `attention_chunk_size`
    tokens (None = global); NoPE layers use global attention and, when `attn_temperature_tuning`,
    scale the query at position p by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)).
    `qk_l2_norm` applies on RoPE layers only, as in Llama-4.
    """

    attention_chunk_size: int | None = None
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_chunk_size is not None and self.attention_chunk_size <= 0:
            raise ValueError(f"attention_chunk_size must be positive or None, "
                             f"got {self.attention_chunk_size}")
        if self.floor_scale <= 0:
            raise ValueError(f"floor_scale must be positive, got {self.floor_scale}")

    def is_rope_layer(self, layer_number: int) -> bool:
        """Whether the 1-based global `layer_number` applies RoPE (else NoPE + global)."""
        return not (self.no_rope_freq and self.no_rope_freq[layer_number - 1])


def hf_text_config(size: str) -> Llama4TextConfig:
    return Llama4TextConfig(**_HF_SIZES[size])


def hf_config(size: str) -> dict[str, Any]:
    """config.json content of a text-only Llama4ForCausalLM of `size`."""
    config = hf_text_config(size).to_dict()
    config["architectures"] = ["Llama4ForCausalLM"]
    return config


def _no_rope_pattern(num_layers: int, interval: int) -> list[int]:
    # Megatron's no_rope_freq: 1 = skip RoPE. HF: no_rope_layers[i] = int((i + 1) % interval != 0).
    return [int((i + 1) % interval == 0) for i in range(num_layers)]


def _moe_pattern(num_layers: int, step: int) -> list[int]:
    # HF: moe_layers = range(step - 1, num_layers, step).
    return [int(i % step == step - 1) for i in range(num_layers)]


def megatron_fields(hf: Llama4TextConfig) -> dict[str, Any]:
    """TransformerConfig fields equivalent to an HF Llama-4 text config."""
    num_layers = hf.num_hidden_layers
    return dict(
        num_layers=num_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size_mlp,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=hf.attention_bias,  # False; a shared expert also requires it
        add_qkv_bias=hf.attention_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=hf.initializer_range,
        # HF rotates adjacent (even, odd) pairs (complex multiplication): Megatron's interleaved RoPE.
        rotary_interleaved=True,
        no_rope_freq=[1 - use_rope for use_rope in hf.no_rope_layers],
        qk_l2_norm=hf.use_qk_norm,
        attention_chunk_size=hf.attention_chunk_size,
        attn_temperature_tuning=bool(hf.attn_temperature_tuning),
        floor_scale=hf.floor_scale,
        attn_scale=hf.attn_scale,
        # MoE: top-1 sigmoid router (sigmoid is monotone, so top-k on logits == top-k on scores),
        # score multiplied into the expert input, one always-on shared expert of the same width.
        num_moe_experts=hf.num_local_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_router_score_function="sigmoid",
        # No effect with sigmoid; set so that a switch to softmax stays valid for top-1 routing.
        moe_router_pre_softmax=True,
        moe_apply_probs_on_input=True,
        moe_ffn_hidden_size=hf.intermediate_size,
        moe_shared_expert_intermediate_size=hf.intermediate_size,
        moe_layer_freq=[int(i in hf.moe_layers) for i in range(num_layers)],
        # RL fine-tuning keeps the pretrained routing: no auxiliary load-balancing loss by default.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
    )


def transformer_config(size: str, *, use_transformer_engine: bool = False,
                       **overrides: Any) -> Llama4TransformerConfig:
    hf = hf_text_config(size)
    architecture = megatron_fields(hf)
    architecture.update(model_family="llama4", model_size=size)
    if size in ("scout", "maverick"):
        architecture.update(bf16=True, params_dtype=torch.bfloat16)

    def derive(fields: dict[str, Any]) -> dict[str, Any]:
        # A num_layers override (smaller pipelines, tests) keeps the HF layer patterns.
        derived = {}
        if "no_rope_freq" not in overrides:
            derived["no_rope_freq"] = _no_rope_pattern(fields["num_layers"],
                                                       hf.no_rope_layer_interval)
        if "moe_layer_freq" not in overrides:
            derived["moe_layer_freq"] = _moe_pattern(fields["num_layers"],
                                                     hf.interleave_moe_layer_step)
        return derived

    return make_transformer_config(Llama4TransformerConfig, architecture, overrides,
                                   use_transformer_engine=use_transformer_engine, derive=derive)


def model_kwargs(size: str) -> dict[str, Any]:
    return model_kwargs_from_hf(hf_text_config(size))


def model_kwargs_from_hf(hf: Llama4TextConfig) -> dict[str, Any]:
    """GPTModel keyword arguments of an HF Llama-4 text config (any size, e.g. a converted one)."""
    return dict(
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(hf.rope_parameters["rope_theta"]),
        rotary_percent=1.0,
        # llama3 scaling is installed by build_model from transformers' own formula (see there).
        rope_scaling=False,
        share_embeddings_and_output_weights=hf.tie_word_embeddings,
    )


def rope_inv_freq(size: str) -> torch.Tensor | None:
    """HF's RoPE inverse frequencies [head_dim / 2] when `size` scales RoPE, else None."""
    return rope_inv_freq_from_hf(hf_text_config(size))


def rope_inv_freq_from_hf(hf: Llama4TextConfig) -> torch.Tensor | None:
    """HF's RoPE inverse frequencies [head_dim / 2] when `hf` scales RoPE, else None."""
    rope_type = hf.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    if attention_factor != 1.0:
        raise NotImplementedError(f"RoPE type {rope_type!r} with attention factor "
                                  f"{attention_factor} has no Megatron equivalent here")
    return inv_freq
