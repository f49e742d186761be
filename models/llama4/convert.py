"""The Llama-4 text model's HF <-> Megatron weight mapping, and the Megatron model of an HF config.

HF layout (transformers 5.x `Llama4ForCausalLM`; `Llama4ForConditionalGeneration` stores the same
text weights under "language_model.", its vision tower is not converted): per layer
`self_attn.{q,k,v,o}_proj`, `input_layernorm`, `post_attention_layernorm`, and a feed-forward that
is either dense (`feed_forward.{gate,up,down}_proj`) or MoE: `feed_forward.router.weight` [E, H],
fused experts `feed_forward.experts.gate_up_proj` [E, H, 2I] (x @ W layout, gate columns first)
and `feed_forward.experts.down_proj` [E, I, H], and the always-on
`feed_forward.shared_expert.{gate,up,down}_proj`. Megatron (local spec, TP1/EP1/PP1 names): fused
`linear_qkv` (per KV group: q heads, k, v), `input_layernorm`, `pre_mlp_layernorm`, per-expert
nn.Linear-layout `mlp.experts.local_experts.{e}.linear_fc{1,2}`, `mlp.shared_experts`, and
`mlp.linear_fc{1,2}` on dense layers. q/k L2 norms have no weights; RoPE needs no permutation
(Megatron's interleaved RoPE is HF's complex-pair rotation). `write_sglang_layout` re-saves a
text-only export in the multimodal layout SGLang 0.5.23 needs to serve Llama-4.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Llama4TextConfig

from models.convert_common import (WeightGroup, attention_groups, concatenated,
                                   decoder_weight_groups, renamed)

HF_ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
_MULTIMODAL = "Llama4ForConditionalGeneration"


def hf_text_config_from_dict(config: dict[str, Any]) -> Llama4TextConfig:
    """The text config inside a config.json of either Llama-4 architecture."""
    if _MULTIMODAL in config.get("architectures", ()):
        text = dict(config.get("text_config") or {})
        if not text:
            raise ValueError(f"{_MULTIMODAL} config.json has no text_config")
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return Llama4TextConfig(**as_released_fields(text))
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return Llama4TextConfig(**as_released_fields(fields))


def as_released_fields(text_config: dict[str, Any]) -> dict[str, Any]:
    """A text config's fields with the released checkpoints' spellings read as they are meant.

    The one such field: meta-llama's Scout config.json stores `attn_temperature_tuning` as the
    integer 4, where the field is a flag (transformers' and SGLang's Llama-4 attention only test
    it for truth) and transformers 5.x's strict config refuses an int. An int is read as
    bool(value): 4 -> True, 0 -> False. Any other type is left for the config class to refuse.
    """
    fields = dict(text_config)
    flag = fields.get("attn_temperature_tuning")
    if isinstance(flag, int) and not isinstance(flag, bool):
        fields["attn_temperature_tuning"] = bool(flag)
    return fields


def hf_weight_prefix(config: dict[str, Any]) -> str:
    """Prefix of the text weights' names on disk."""
    return "language_model." if _MULTIMODAL in config.get("architectures", ()) else ""


def hf_ignored_prefixes(config: dict[str, Any]) -> tuple[str, ...]:
    """On-disk weights that are not part of the text model (skipped, reported)."""
    if _MULTIMODAL in config.get("architectures", ()):
        return ("vision_model.", "multi_modal_projector.")
    return ()


def text_only_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json of the Llama4ForCausalLM that Megatron -> HF writes for `config`."""
    if _MULTIMODAL not in config.get("architectures", ()):
        return as_released_fields(config)  # loadable by transformers' strict config
    text = hf_text_config_from_dict(config).to_dict()
    text["architectures"] = ["Llama4ForCausalLM"]
    return text


def write_sglang_layout(text_checkpoint: str | os.PathLike, output_dir: str | os.PathLike,
                        *, dtype: torch.dtype | None = None) -> Path:
    """Re-save a text-only Llama4ForCausalLM folder (what Megatron -> HF writes) in the layout
    SGLang serves Llama-4 from, and return `output_dir`.

    SGLang 0.5.23 loads a Llama4ForCausalLM with its Llama loader, which skips the fused expert
    tensors ("Parameter ... not found in params_dict") and leaves q/k unpermuted; its
    Llama4ForConditionalGeneration loader un-fuses the experts and permutes q/k for its
    rotate-half RoPE. So: a Llama4ForConditionalGeneration config.json (this text config plus
    transformers' default vision config) and the same tensors under "language_model." in one
    safetensors file, without vision weights (with no index listing any, SGLang builds no vision
    tower); the other files (tokenizer) are copied. `dtype` None keeps the stored dtypes. Every
    tensor is held in memory at once: meant for small models (the demo's base model). The HF ->
    Megatron converter reads this layout as well (`hf_weight_prefix`).
    """
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import Llama4Config

    source, output = Path(text_checkpoint), Path(output_dir)
    config = json.loads((source / "config.json").read_text())
    if config.get("architectures") != ["Llama4ForCausalLM"]:
        raise ValueError(f"{source}/config.json describes {config.get('architectures')}, not a "
                         "text-only Llama4ForCausalLM (Megatron -> HF writes one)")
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                tensors[f"language_model.{name}"] = tensor if dtype is None else tensor.to(dtype)
    if not tensors:
        raise ValueError(f"{source} has no *.safetensors weights")
    output.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, output / path.name)
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    stored = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    text = hf_text_config_from_dict(config).to_dict()
    served = Llama4Config(text_config=text).to_dict()
    served.update(architectures=[_MULTIMODAL], torch_dtype=stored)
    (output / "config.json").write_text(json.dumps(served, indent=2, sort_keys=True) + "\n")
    return output


def weight_groups(hf: Llama4TextConfig, *, prefix: str = "") -> list[WeightGroup]:
    """The mapping, in checkpoint order: embeddings, layers 0..L-1, final norm, head."""
    return decoder_weight_groups(hf, _layer_groups, prefix=prefix)


def _layer_groups(hf: Llama4TextConfig, layer: int, prefix: str) -> list[WeightGroup]:
    h, m = f"{prefix}model.layers.{layer}.", f"decoder.layers.{layer}."
    groups = attention_groups(hf, h, m)
    ff = h + "feed_forward."
    if layer not in hf.moe_layers:
        return groups + [
            concatenated((ff + "gate_proj.weight", ff + "up_proj.weight"),
                         m + "mlp.linear_fc1.weight"),
            renamed(ff + "down_proj.weight", m + "mlp.linear_fc2.weight"),
        ]
    groups.append(renamed(ff + "router.weight", m + "mlp.router.weight"))
    experts = m + "mlp.experts.local_experts.{}.linear_fc{}.weight"
    groups.append(_fused_experts(ff + "experts.gate_up_proj", experts, 1, hf.num_local_experts))
    groups.append(_fused_experts(ff + "experts.down_proj", experts, 2, hf.num_local_experts))
    shared = ff + "shared_expert."
    return groups + [
        concatenated((shared + "gate_proj.weight", shared + "up_proj.weight"),
                     m + "mlp.shared_experts.linear_fc1.weight"),
        renamed(shared + "down_proj.weight", m + "mlp.shared_experts.linear_fc2.weight"),
    ]


def _fused_experts(hf_name: str, megatron_pattern: str, fc: int, num_experts: int) -> WeightGroup:
    # HF [E, in, out] (x @ W) <-> per expert nn.Linear [out, in]: a transpose of each slice.
    # gate_up's out dim is [gate; up], the same order as Megatron's GLU linear_fc1 rows.
    names = tuple(megatron_pattern.format(e, fc) for e in range(num_experts))

    def to_megatron(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fused = hf[hf_name]
        if fused.shape[0] != num_experts:
            raise ValueError(f"{hf_name} has {fused.shape[0]} experts, the config says "
                             f"{num_experts}")
        return {name: fused[e].t() for e, name in enumerate(names)}

    def to_hf(mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {hf_name: torch.stack([mg[name].t() for name in names])}

    return WeightGroup(hf_names=(hf_name,), megatron_names=names, to_megatron=to_megatron,
                       to_hf=to_hf)


def megatron_config(hf: Llama4TextConfig, **overrides: Any):
    """The Llama4TransformerConfig equivalent to `hf` (overrides: TransformerConfig fields)."""
    from models.common import make_transformer_config
    from models.llama4.config import Llama4TransformerConfig, megatron_fields

    architecture = dict(megatron_fields(hf), model_family="llama4")
    return make_transformer_config(Llama4TransformerConfig, architecture, overrides,
                                   use_transformer_engine=False)


def build_model(hf: Llama4TextConfig, config, *, pre_process: bool = True,
                post_process: bool = True):
    """The local-spec GPTModel of `config` (from `megatron_config(hf)`), with HF's RoPE."""
    from models.common import build_gpt_model
    from models.llama4.config import model_kwargs_from_hf, rope_inv_freq_from_hf
    from models.llama4.spec import layer_spec

    spec = layer_spec(config, use_transformer_engine=False)
    model = build_gpt_model(config, spec, model_kwargs_from_hf(hf), pre_process=pre_process,
                            post_process=post_process, vp_stage=None)
    inv_freq = rope_inv_freq_from_hf(hf)
    if inv_freq is not None:
        rotary = model.rotary_pos_emb
        rotary.inv_freq = inv_freq.to(device=rotary.inv_freq.device)
        rotary.forward.cache_clear()
    return model
