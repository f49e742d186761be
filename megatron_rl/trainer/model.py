"""Building the trainer's model: a registered model family at a parallel layout, wrapped for
mixed precision and Megatron DDP, configured for the RL loss.

`precision_overrides(...)` is the one place that turns the run's precision choice (fp32 / bf16,
optional Transformer Engine FP8: delayed, current-scaling or MXFP8 recipe, whose TransformerConfig
fields `fp8_fields` names) into TransformerConfig fields and the layer-spec choice (TE on GPU,
local on CPU); it is pure, so the selection is unit-tested without a GPU. `build_model(...)` asks
the family for its TransformerConfig with the layout and trainer overrides, builds this pipeline
stage's GPTModel, and wraps it. Loss scaling:
`calculate_per_token_loss=True` makes Megatron neither divide the loss by the number of
micro-batches nor average gradients over data-parallel ranks, and `_finalize_grads_unscaled`
drops its final 1/num_tokens scaling: our loss already carries the global aggregation
denominators, so gradients are plain sums over micro-batches and ranks (see step.py).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from megatron_rl.platform import activate_cpu_compat, has_transformer_engine
from megatron_rl.trainer.parallel import ParallelGroups, ParallelLayout
from models.fp8 import FP8_FORMATS, FP8_RECIPES, fp8_fields  # noqa: F401 (re-exported)

PRECISIONS = ("fp32", "bf16")
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionChoice:
    use_transformer_engine: bool
    overrides: dict[str, Any]  # TransformerConfig fields


def precision_overrides(precision: str = "fp32", *, fp8_recipe: str | None = None,
                        fp8_format: str = "hybrid", use_transformer_engine: bool | None = None,
                        transformer_engine_available: bool | None = None) -> PrecisionChoice:
    """TransformerConfig fields and layer-spec backend for a precision choice.

    `fp8_recipe` None = no FP8; else a key of FP8_RECIPES ("delayed", "current": per-tensor
    current scaling, Megatron's "tensorwise", "mxfp8"). FP8 needs Transformer Engine (GPU); asking
    for it without TE is an error, never a silent fallback. `use_transformer_engine` None = use TE
    whenever it is available.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; choose one of {PRECISIONS}")
    available = (has_transformer_engine() if transformer_engine_available is None
                 else transformer_engine_available)
    if use_transformer_engine and not available:
        raise RuntimeError(
            "use_transformer_engine=True but Transformer Engine is not usable here (it needs a "
            "CUDA GPU and the NGC image); set model.use_transformer_engine=false on CPU")
    te = available if use_transformer_engine is None else use_transformer_engine
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    overrides: dict[str, Any] = {"bf16": precision == "bf16", "params_dtype": dtype,
                                 "pipeline_dtype": dtype}
    if fp8_recipe is not None:
        fields = fp8_fields(fp8_recipe, fp8_format)
        if not te:
            raise RuntimeError(
                f"FP8 ({fp8_recipe} scaling) needs Transformer Engine on a CUDA GPU, and this "
                "machine has none (CPU-only torch or TE not importable); set model.fp8=null to "
                "train in fp32/bf16 here")
        if precision != "bf16":
            raise ValueError("FP8 runs on top of bf16 parameters; set precision='bf16' "
                             "(model.params_dtype=bfloat16)")
        overrides.update(fields)
    return PrecisionChoice(use_transformer_engine=te, overrides=overrides)


def rl_overrides(layout: ParallelLayout) -> dict[str, Any]:
    """TransformerConfig fields the RL trainer needs whatever the family says."""
    return {
        **layout.megatron_overrides(),
        # The log-probs must match the generator's: no dropout in the policy.
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # Loss already normalised by global denominators: no per-micro-batch / per-DP averaging.
        "calculate_per_token_loss": True,
        # Micro-batches have different padded shapes; pipeline stages exchange shapes first.
        "variable_seq_lengths": layout.pipeline_model_parallel_size > 1,
    }


# Transformer Engine's CP communication schemes (TransformerConfig.cp_comm_type) and the one the
# local spec's SDPACoreAttention implements (models/sdpa_attention.py).
TE_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
LOCAL_CP_COMM_TYPES = ("all_gather",)


def check_context_parallel(layout: ParallelLayout, *, use_transformer_engine: bool,
                           cp_comm_type: str | list[str] | None = None,
                           environ: dict[str, str] | None = None) -> None:
    """What context parallelism (CP > 1) needs of the attention backend, checked before building.

    Every CP rank holds a load-balanced slice of each sequence (trainer/batch.py pads to a
    multiple of 2 * CP, times TP under sequence parallelism, so the lengths always divide).
    - Transformer Engine (GPU): its CP attention, with `cp_comm_type` one of TE_CP_COMM_TYPES
      (None: p2p); TE's CP needs the flash or fused attention backend, so both disabled through
      NVTE_FLASH_ATTN=0 and NVTE_FUSED_ATTN=0 (its unfused backend has no CP) is an error here
      rather than an assertion deep inside TE.
    - Local spec (CPU, or use_transformer_engine=False): SDPACoreAttention's exact all-gather
      path (full keys per rank: a test path, no memory saving), cp_comm_type None / all_gather.
      Families whose local spec uses megatron-core's DotProductAttention refuse CP themselves.
    """
    if layout.context_parallel_size == 1:
        return
    comm_types = cp_comm_type if isinstance(cp_comm_type, list) else [cp_comm_type]
    allowed = TE_CP_COMM_TYPES if use_transformer_engine else LOCAL_CP_COMM_TYPES
    bad = sorted({c for c in comm_types if c is not None and c not in allowed})
    if bad:
        where = "Transformer Engine's CP attention" if use_transformer_engine else \
            "the local spec's all-gather CP attention (SDPACoreAttention)"
        raise ValueError(f"cp_comm_type {bad} is not supported by {where}; choose from "
                         f"{allowed} or leave it unset")
    environ = os.environ if environ is None else environ
    if use_transformer_engine and environ.get("NVTE_FLASH_ATTN") == "0" and \
            environ.get("NVTE_FUSED_ATTN") == "0":
        raise ValueError(
            f"parallelism.context_parallel_size={layout.context_parallel_size} needs Transformer "
            "Engine's flash or fused attention (its unfused backend has no context "
            "parallelism), but NVTE_FLASH_ATTN=0 and NVTE_FUSED_ATTN=0; unset one of them")


def recompute_overrides(granularity: str) -> dict[str, Any]:
    """TransformerConfig fields for train.recompute_granularity (none / selective / full)."""
    if granularity == "none":
        return {}
    if granularity == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1}


def cpu_overrides() -> dict[str, Any]:
    """TransformerConfig fields for a CPU-only machine. Megatron initialises TP-split weights on
    the device under per-rank CUDA RNG streams; without CUDA those streams do not exist and every
    TP rank drew the same shard (q_proj's halves equal, lm_head's vocabulary halves equal).
    Initialising on the CPU builds each full weight from one RNG and splits it, so a TP2 model
    starts from exactly the TP1 model's weights."""
    import torch

    return {} if torch.cuda.is_available() else {"use_cpu_initialization": True}


def build_model(family, size: str, layout: ParallelLayout, groups: ParallelGroups, *,
                precision: PrecisionChoice, use_distributed_optimizer: bool = True,
                config_overrides: dict[str, Any] | None = None):
    """This rank's model chunk wrapped in Megatron DDP, and its TransformerConfig.

    `family` is a models registry entry (`models.get_model_family(name)`) or any object with the
    same `transformer_config` / `build_model` methods.
    """
    activate_cpu_compat()
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    overrides = {**precision.overrides, **rl_overrides(layout), **cpu_overrides(),
                 **(config_overrides or {})}
    check_context_parallel(layout, use_transformer_engine=precision.use_transformer_engine,
                           cp_comm_type=overrides.get("cp_comm_type"))
    if overrides.get("recompute_granularity") and not torch.cuda.is_available():
        raise ValueError(
            f"train.recompute_granularity={overrides['recompute_granularity']!r} needs a CUDA "
            "GPU (Megatron's recompute saves and restores CUDA RNG states); set "
            "train.recompute_granularity=none on CPU")
    config = family.transformer_config(
        size, use_transformer_engine=precision.use_transformer_engine, **overrides)
    if getattr(config, "use_mup", False):
        raise ValueError("MuP logit scaling is not supported by the RL loss head; disable use_mup")
    model = family.build_model(
        config, pre_process=groups.is_pipeline_first_stage,
        post_process=groups.is_pipeline_last_stage,
        use_transformer_engine=precision.use_transformer_engine)
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if config.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer, check_for_nan_in_grad=False)
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = _finalize_grads_unscaled
    config.no_sync_func = model.no_sync
    return model, config


def _finalize_grads_unscaled(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """Megatron's finalize_model_grads (DP/EP reduction, SP norm and tied-embedding all-reduce)
    without its 1/num_tokens scaling: our per-token weights already divide by global counts."""
    from megatron.core.distributed import finalize_model_grads

    del num_tokens
    finalize_model_grads(model, None, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)


def unwrap(model) -> torch.nn.Module:
    """The GPTModel inside the DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
