"""Tiny Hugging Face models for the SGLang / weight-sync tests, and the models-registry family
that builds the trainer's Megatron model from the same HF config.

- `save_tiny_llama(dir)` / `save_tiny_qwen3_moe(dir)`: random transformers models saved with
  save_pretrained (safetensors), plus a byte-level BPE tokenizer trained locally.
- `save_tiny_llama4(dir)`: the llama4 family's "tiny" text model in bf16, saved in the layout
  SGLang serves Llama-4 from (Llama4ForConditionalGeneration, text weights only).
- `family_for(dir)`: `models.model_family_for_hf_config` of the saved config.json (the "llama",
  "llama4" or "qwen3_moe" family bound to that config); RLTrainer accepts it as `family=`.
"""
from __future__ import annotations

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


def family_for(model_dir: str):
    """The registry family of a tiny model saved by this module, bound to its config.json (also
    a multimodal one: Llama4ForConditionalGeneration binds its text config)."""
    import json

    from models import model_family_for_hf_config

    return model_family_for_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
