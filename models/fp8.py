"""FP8 recipes as megatron-core TransformerConfig fields: the one table the model families
(models/common.py) and the RL trainer (megatron_rl/trainer/model.py) build their configs from.
Plain data, no megatron import: the trainer reads it before megatron is set up.
"""
from __future__ import annotations

from typing import Any

FP8_FORMATS = ("e4m3", "hybrid")
# Recipe name -> TransformerConfig fields besides `fp8` (megatron-core 0.19.2: `fp8_recipe` in
# {"tensorwise", "delayed", "mxfp8", "blockwise", "custom"}). "current" is Transformer Engine's
# name for Megatron's per-tensor current scaling ("tensorwise"). Delayed scaling scales each
# tensor by the max amax of its last 1024 steps, NVIDIA's recipe (Megatron's default history of 1
# scales by the last step's amax alone: one outlier-free step and the next overflows). MXFP8
# (Blackwell) and blockwise scaling use e4m3 everywhere: their block scales cover the gradients.
FP8_RECIPES: dict[str, dict[str, Any]] = {
    "delayed": {"fp8_recipe": "delayed", "fp8_amax_history_len": 1024,
                "fp8_amax_compute_algo": "max"},
    "current": {"fp8_recipe": "tensorwise"},
    "tensorwise": {"fp8_recipe": "tensorwise"},
    "mxfp8": {"fp8": "e4m3", "fp8_recipe": "mxfp8"},
    "blockwise": {"fp8": "e4m3", "fp8_recipe": "blockwise"},
}


def fp8_fields(recipe: str | None, fp8_format: str = "hybrid") -> dict[str, Any]:
    """TransformerConfig fields of an FP8 recipe (None: no FP8, an empty dict). `fp8_format`
    ("hybrid": e4m3 forward, e5m2 gradients; or "e4m3") applies to the per-tensor recipes."""
    if recipe is None:
        return {}
    if recipe not in FP8_RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {tuple(FP8_RECIPES)} "
                         "or None")
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8 format {fp8_format!r} is not supported; choose one of "
                         f"{FP8_FORMATS}")
    return {"fp8": fp8_format, **FP8_RECIPES[recipe]}
