"""Tiny Hugging Face models for the SGLang / weight-sync tests, and "model families" that build the
trainer's Megatron model from the same HF config.

- `save_tiny_llama(dir)` / `save_tiny_qwen3_moe(dir)`: random transformers models saved with
  save_pretrained (safetensors), plus a byte-level BPE tokenizer trained locally.
- `save_tiny_llama4(dir)`: the llama4 family's "tiny" text model in bf16, saved in the layout
  SGLang serves Llama-4 from (Llama4ForConditionalGeneration, text weights only).
- `HFConfigFamily(converter, hf_config)`: the models-registry interface (`transformer_config`,
  `build_model`) over a converter module (`megatron_config`, `build_model`, `weight_groups`);
  RLTrainer accepts it as `family=`.
- `llama_converter`: a Llama-3-style (dense, GQA, SwiGLU, RoPE rotate-half) HF <-> Megatron mapping
  built from models/convert_common.py's pieces; the models registry has no dense Llama family, so
  it lives here for the tests.
"""
from __future__ import annotations

import types
from pathlib import Path

import torch

VOCAB_SIZE = 320


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def _common(**fields) -> dict:
    # initializer_range 0.1 (not 0.02): peaked next-token distributions, so greedy decoding has
    # no near-ties that float noise could flip.
    return dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                initializer_range=0.1, rms_norm_eps=1e-6, **fields)


def save_tiny_llama(directory: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**_common(intermediate_size=128)))
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory


def save_tiny_qwen3_moe(directory: Path, seed: int = 0) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**_common(
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.0)))
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory


def save_tiny_llama4(directory: Path, seed: int = 0) -> Path:
    """The llama4 family's "tiny" size (4 layers: 3 RoPE layers with q/k L2 norm, llama3 RoPE
    scaling and 8-token chunked attention, 1 NoPE layer with temperature tuning; every layer MoE
    with 4 top-1 sigmoid-routed experts and a shared expert), random, bf16, saved as SGLang serves
    Llama-4: a Llama4ForConditionalGeneration config.json (this text config + transformers'
    default vision config) and only the text weights, under "language_model.".

    SGLang's Llama4ForConditionalGeneration loader is the one that un-fuses the experts
    (`feed_forward.experts.gate_up_proj`) and permutes q/k rows for its rotate-half RoPE; its
    text-only Llama4ForCausalLM falls back to the Llama loader, which skips the expert tensors
    ("Parameter ... not found in params_dict") and leaves q/k unpermuted. With a single
    safetensors file (no index listing vision weights) SGLang builds no vision tower. No
    tokenizer: the server runs with --skip-tokenizer-init.
    """
    import json

    from safetensors.torch import save_file
    from transformers import Llama4Config, Llama4ForCausalLM

    from models import get_model_family

    family = get_model_family("llama4")
    # initializer_range 0.1 (the size's 0.02 gives near-uniform next-token distributions): peaked
    # distributions, so that greedy decoding has no near-ties that bf16 noise could flip.
    text = family.converter().hf_text_config_from_dict(
        {**family.hf_config("tiny"), "initializer_range": 0.1})
    torch.manual_seed(seed)
    model = Llama4ForCausalLM(text).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    config = Llama4Config(text_config=text.to_dict()).to_dict()
    config.update(architectures=["Llama4ForConditionalGeneration"], torch_dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_file({f"language_model.{name}": tensor.contiguous()
               for name, tensor in model.state_dict().items()},
              str(directory / "model.safetensors"))
    return directory


class HFConfigFamily:
    """The models-registry interface over a converter module and one HF config."""

    def __init__(self, converter, hf_config):
        self.converter = converter
        self.hf_config = hf_config

    def transformer_config(self, size, *, use_transformer_engine=False, **overrides):
        del size, use_transformer_engine
        return self.converter.megatron_config(self.hf_config, **overrides)

    def build_model(self, config, *, pre_process, post_process, use_transformer_engine=False,
                    vp_stage=None):
        return self.converter.build_model(self.hf_config, config, pre_process=pre_process,
                                          post_process=post_process)

    def weight_groups(self):
        return self.converter.weight_groups(self.hf_config)


def _llama_weight_groups(hf, *, prefix: str = ""):
    from models.convert_common import (attention_groups, concatenated, decoder_weight_groups,
                                       renamed)

    def layer_groups(hf, layer: int, prefix: str):
        h, m = f"{prefix}model.layers.{layer}.", f"decoder.layers.{layer}."
        return attention_groups(hf, h, m) + [
            concatenated((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                         m + "mlp.linear_fc1.weight"),
            renamed(h + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight"),
        ]

    return decoder_weight_groups(hf, layer_groups, prefix=prefix)


def _llama_megatron_config(hf, **overrides):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads, kv_channels=hf.head_dim,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, init_method_std=hf.initializer_range,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        use_cpu_initialization=True)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _llama_build_model(hf, config, *, pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=hf.vocab_size,
                    max_sequence_length=hf.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, position_embedding_type="rope",
                    rotary_base=int(hf.rope_parameters["rope_theta"]),
                    share_embeddings_and_output_weights=hf.tie_word_embeddings)


llama_converter = types.SimpleNamespace(weight_groups=_llama_weight_groups,
                                        megatron_config=_llama_megatron_config,
                                        build_model=_llama_build_model)


def family_for(model_dir: str) -> HFConfigFamily:
    """The family of a tiny model saved by this module (by its config.json architecture)."""
    import json

    from transformers import AutoConfig

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config["architectures"] == ["LlamaForCausalLM"]:
        return HFConfigFamily(llama_converter, AutoConfig.from_pretrained(model_dir))
    from models import model_family_for_hf_architecture

    converter = model_family_for_hf_architecture(config["architectures"][0]).converter()
    # The text config, also inside a multimodal config.json (Llama4ForConditionalGeneration).
    return HFConfigFamily(converter, converter.hf_text_config_from_dict(config))
