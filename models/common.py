"""What every model family shares: the TransformerConfig base class, override checking, the
CPU/GPU fusion switches, FP8 recipe names, and the parameter-count formula.

Family packages (models/llama4, models/qwen3_moe) describe their architecture as a dict of
TransformerConfig fields and call `make_transformer_config` here, which applies the caller's
overrides (rejecting names that are not TransformerConfig fields), turns the CUDA-only fusions off
for the local (CPU) spec and on for Transformer Engine, and records the family and size on the
config so that `build_model(config)` knows which vocabulary and position embedding to use.
Imports megatron.core: import it only after `megatron_rl.platform.activate_cpu_compat()`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclasses.dataclass
class FamilyTransformerConfig(TransformerConfig):
    """A TransformerConfig that remembers which registered family and size produced it."""

    model_family: str = ""
    model_size: str = ""


# Megatron fusions that need CUDA kernels (apex / jit-fused CUDA paths). Off for the local spec so
# the CPU path is plain torch; on for Transformer Engine runs, where they are the tuned defaults.
_CUDA_FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion")

FP8Recipe = Literal["delayed", "current", "mxfp8", "blockwise"]

def fp8_config_fields(recipe: FP8Recipe | None) -> dict[str, Any]:
    """TransformerConfig fields for an FP8 recipe name (None -> no FP8, an empty dict): those of
    models/fp8.py's FP8_RECIPES, the one table the RL trainer builds its config from too
    ("hybrid": e5m2 gradients, for delayed and per-tensor current scaling)."""
    from models.fp8 import fp8_fields

    return fp8_fields(recipe)


def check_overrides(config_cls: type, overrides: dict[str, Any]) -> None:
    names = {field.name for field in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(
            f"unknown TransformerConfig override(s) {unknown}: overrides must be field names of "
            f"{config_cls.__name__} (megatron.core TransformerConfig), e.g. "
            "tensor_model_parallel_size, expert_model_parallel_size, sequence_parallel, bf16")


def make_transformer_config(config_cls: type, architecture: dict[str, Any],
                            overrides: dict[str, Any], *, use_transformer_engine: bool,
                            derive: Any = None) -> TransformerConfig:
    """Build `config_cls(**architecture, **switches, **overrides)`.

    `derive(fields) -> dict`, if given, recomputes per-layer fields (layer patterns that depend on
    num_layers) from the merged fields before the config is constructed.
    """
    check_overrides(config_cls, overrides)
    if overrides.get("fp8") and not use_transformer_engine:
        raise ValueError("fp8 needs Transformer Engine: pass use_transformer_engine=True (GPU only)")
    fields = dict(architecture)
    fields.update({name: use_transformer_engine for name in _CUDA_FUSIONS})
    # Grouped GEMM for experts exists as TE GroupedLinear; the local spec uses SequentialMLP.
    fields["moe_grouped_gemm"] = use_transformer_engine
    fields.update(overrides)
    if (not use_transformer_engine and "moe_token_dispatcher_type" not in overrides
            and fields.get("moe_token_dispatcher_type") == "alltoall"
            and _experts_on_one_rank(fields) and not fields.get("variable_seq_lengths")):
        # With neither tensor nor expert parallelism no token leaves the rank, and megatron's
        # allgather dispatcher then only permutes and unpermutes (the same permute/unpermute
        # as alltoall's, so bit-identical results), where alltoall also sorts chunks by local
        # expert both ways and goes through identity all-to-all autograd functions
        # (docs/trainer_speed.md, third pass). Layouts with TP or EP keep the family's
        # alltoall dispatcher, and so do variable sequence lengths (pipeline parallelism:
        # megatron's allgather dispatcher refuses them); Transformer Engine runs are unchanged.
        fields["moe_token_dispatcher_type"] = "allgather"
    if fields.get("pipeline_model_parallel_size", 1) > 1:
        # Megatron requires the dtype of tensors sent between stages; it is the parameter dtype.
        fields.setdefault("pipeline_dtype", fields.get("params_dtype", torch.float32))
    if derive is not None:
        fields.update(derive(fields))
    return config_cls(**fields)


def _experts_on_one_rank(fields: dict[str, Any]) -> bool:
    tp = fields.get("tensor_model_parallel_size", 1)
    expert_tp = fields.get("expert_tensor_parallel_size") or tp
    return tp == 1 and expert_tp == 1 and fields.get("expert_model_parallel_size", 1) == 1


def count_parameters(config: TransformerConfig, *, vocab_size: int,
                     tie_embeddings: bool) -> tuple[int, int]:
    """(total, active-per-token) parameter counts of a GPT-style MoE decoder, by formula.

    Counts what the Megatron model holds: embeddings and output head, per layer the attention
    (fused QKV, output projection, q/k norm weights when `qk_layernorm`), two RMSNorm weights, and
    either a dense SwiGLU MLP or the router, routed experts and shared expert. "Active" counts the
    `moe_router_topk` routed experts a token uses; embeddings count once each (input row + head).
    """
    hidden = config.hidden_size
    head_dim = config.kv_channels
    attention = hidden * head_dim * (config.num_attention_heads + 2 * config.num_query_groups)
    attention += config.num_attention_heads * head_dim * hidden
    if config.qk_layernorm:
        attention += 2 * head_dim
    norms = 2 * hidden
    glu = 3 if config.gated_linear_unit else 2
    dense_mlp = glu * hidden * config.ffn_hidden_size
    moe_pattern = _moe_layer_pattern(config)
    num_moe_layers = sum(moe_pattern)
    num_dense_layers = config.num_layers - num_moe_layers
    expert = glu * hidden * (config.moe_ffn_hidden_size or config.ffn_hidden_size)
    shared = glu * hidden * (config.moe_shared_expert_intermediate_size or 0)
    router = hidden * (config.num_moe_experts or 0)
    num_experts = config.num_moe_experts or 0
    embeddings = vocab_size * hidden * (1 if tie_embeddings else 2) + hidden  # + final norm
    common = config.num_layers * (attention + norms) + num_dense_layers * dense_mlp + embeddings
    total = common + num_moe_layers * (router + shared + num_experts * expert)
    active = common + num_moe_layers * (router + shared + config.moe_router_topk * expert)
    return total, active


def _moe_layer_pattern(config: TransformerConfig) -> list[int]:
    if not config.num_moe_experts:
        return [0] * config.num_layers
    if isinstance(config.moe_layer_freq, int):
        return [int(i % config.moe_layer_freq == 0) for i in range(config.num_layers)]
    return list(config.moe_layer_freq)


def decoder_block_spec(config: TransformerConfig, *, use_transformer_engine: bool,
                       self_attention_cls: type, core_attention: Any, qk_norm: str | None,
                       vp_stage: int | None = None, pp_rank: int | None = None):
    """ModuleSpec(TransformerBlock) holding this pipeline stage's layer specs.

    Mirrors megatron's get_gpt_decoder_block_spec (dense/MoE pattern from `moe_layer_freq`,
    stage slicing by layer offset or `pipeline_model_parallel_layout`) but takes the attention
    classes from the family, and builds the TE variant from megatron's TESpecProvider directly,
    which (unlike gpt_layer_specs) stays importable without Transformer Engine so the GPU spec
    can be checked on CPU. `qk_norm`: None, "l2" (weight-free L2Norm) or "rms" (RMSNorm weights).
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_mlp_module_spec_for_backend
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType, LayerType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import L2Norm
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
        get_transformer_layer_offset,
    )

    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    norm = backend.layer_norm(rms_norm=True)
    residual_norm = backend.layer_norm(rms_norm=True, has_residual=True)
    head_norm = {None: IdentityOp, "l2": L2Norm, "rms": norm}[qk_norm]
    fused_norm = backend.fuse_layernorm_and_linear()  # TE: input norm inside linear_qkv / fc1
    self_attention = ModuleSpec(
        module=self_attention_cls,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=(backend.column_parallel_layer_norm_linear() if fused_norm
                        else backend.column_parallel_linear()),
            core_attention=core_attention,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=head_norm,
            k_layernorm=head_norm,
        ),
    )

    def layer(is_moe: bool) -> ModuleSpec:
        mlp = get_mlp_module_spec_for_backend(
            backend=backend, num_experts=config.num_moe_experts if is_moe else None,
            moe_grouped_gemm=config.moe_grouped_gemm)
        if is_moe and config.num_moe_experts and not use_transformer_engine:
            mlp = _with_grouped_local_experts(mlp)
        # Local norms are separate modules; these names map them onto the fused TE layout so
        # local and TE checkpoints interchange (an MoE layer keeps its own pre-MLP norm in TE).
        keys_map = {} if fused_norm else {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
        if not fused_norm and not is_moe:
            keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if fused_norm else residual_norm,
            self_attention=self_attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=residual_norm if (is_moe or not fused_norm) else IdentityOp,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ))

    moe_spec, dense_spec = layer(True), layer(False)
    layer_specs = [moe_spec if is_moe else dense_spec for is_moe in _moe_layer_pattern(config)]
    if config.pipeline_model_parallel_layout is not None:
        layer_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = [layer_specs[i] for i in layer_ids]
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = layer_specs[offset:offset + num_layers]
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=local_specs, layer_norm=norm if use_transformer_engine else LNImpl))


def _with_grouped_local_experts(moe_layer_builder):
    """The local spec's MoELayer builder with `GroupedSequentialMLP` (models/grouped_experts.py:
    the same parameters as megatron's SequentialMLP, two grouped GEMMs instead of a loop over the
    experts on CPU) in place of SequentialMLP."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from models.grouped_experts import GroupedSequentialMLP

    submodules = moe_layer_builder.keywords["submodules"]
    experts = submodules.experts
    if not (isinstance(experts, functools.partial) and experts.func is SequentialMLP):
        raise TypeError(f"expected megatron's local SequentialMLP experts builder, got {experts!r} "
                        "(megatron-core's local MoE spec changed; update models/common.py)")
    grouped = functools.partial(GroupedSequentialMLP, *experts.args, **experts.keywords)
    return functools.partial(moe_layer_builder.func, *moe_layer_builder.args,
                             **{**moe_layer_builder.keywords,
                                "submodules": dataclasses.replace(submodules, experts=grouped)})


def standard_decoder_spec(config: TransformerConfig, *, use_transformer_engine: bool,
                          qk_norm: str | None, vp_stage: int | None = None,
                          pp_rank: int | None = None):
    """`decoder_block_spec` with megatron-core's own SelfAttention and Transformer Engine's
    dot-product attention (SDPACoreAttention on the local spec, the CPU trainer's): the spec of
    families without custom attention."""
    from megatron.core.transformer.attention import SelfAttention

    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        core_attention = TEDotProductAttention
    else:
        from models.sdpa_attention import SDPACoreAttention

        core_attention = SDPACoreAttention
    return decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, self_attention_cls=SelfAttention,
        core_attention=core_attention, qk_norm=qk_norm, vp_stage=vp_stage, pp_rank=pp_rank)


def build_gpt_model(config: TransformerConfig, spec, model_kwargs: dict[str, Any], *,
                    pre_process: bool, post_process: bool, vp_stage: int | None):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre_process,
                    post_process=post_process, vp_stage=vp_stage, **model_kwargs)
