"""FP8 checkpoints on SGLang 0.5.23's CPU engine without AMX (fix 13 of sglang_cpu.py).

SGLang serves an FP8 checkpoint on CPU only through AMX kernels: `Fp8LinearMethod` and
`Fp8MoEMethod` (sglang/srt/layers/quantization/fp8.py) assert AMX in
`process_weights_after_loading` (then repack the weights for `sgl_kernel`'s VNNI kernels) and
their `apply` calls `torch.ops.sgl_kernel.fp8_scaled_mm_cpu` / `fused_experts_cpu`, or else the
CUDA block-FP8 GEMM dispatch. This module keeps everything else of SGLang's FP8 path: its real
`Fp8Config`, both methods' `create_weights` (the fp8 `weight` / `w13_weight` / `w2_weight`
parameters with their float32 `weight_scale_inv` block scales, or `weight_scale` per-tensor
scales) and their weight loaders, so that a checkpoint or a weight update goes through SGLang's
own FP8 loading contract. It replaces only the two AMX steps, on CPU:

- `process_weights_after_loading` does nothing: the weights stay exactly where SGLang's loader
  put them, in the checkpoint's layout. That is what lets in-flight weight updates work: SGLang's
  update endpoints call `model.load_weights` into the same parameters and never run
  `process_weights_after_loading` again (model_runner_components/weight_updater.py), so any
  repacked or requantised copy made at start-up would go stale after the first update;
- `apply` dequantises the fp8 weight with its scales to the activation dtype on every call
  (SGLang's `fp8_utils.block_quant_dequant` for blocks; fp8 x the shard's per-tensor scale
  otherwise) and runs the ordinary matmul (`F.linear`) or the native CPU MoE path
  (`fused_moe_native.moe_forward_native`, with fixes 4 and 9 of sglang_cpu.py).

What it computes is weight-only FP8 (W8A16): the activations stay in bf16, where SGLang's GPU
kernels also quantise them per token group (`activation_scheme: dynamic`). A CPU run therefore
shows the weight-quantisation part of the FP8 mismatch and proves the format contract
(quantiser -> SGLang's FP8 loader -> generation), not the GPU kernels' numerics.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def patch_fp8_methods(module) -> None:
    """Patch sglang.srt.layers.quantization.fp8 (called when it is first imported, on CPU)."""
    linear, moe = module.Fp8LinearMethod, module.Fp8MoEMethod
    linear.process_weights_after_loading = _keep_loaded_weights
    linear.apply = _linear_apply
    moe.process_weights_after_loading = _keep_loaded_weights
    moe.apply = _moe_apply


def _keep_loaded_weights(self, layer: torch.nn.Module) -> None:
    if not self.quant_config.is_checkpoint_fp8_serialized:
        raise NotImplementedError(
            "SGLang's online FP8 quantisation (--quantization fp8 on a bf16 checkpoint) has no "
            "CPU path without AMX; serve an FP8 checkpoint (rollout.precision=fp8 writes one)")
    # Nothing to do: see the module docstring (the loader's layout is what `apply` reads).


def dequantize_weight(weight: torch.Tensor, layer: torch.nn.Module, scale_name: str,
                      block_size, dtype: torch.dtype, shard_rows=None) -> torch.Tensor:
    """The fp8 `weight` ([..., M, N]) of `layer` times its scales, in `dtype`. Block scales
    (`<scale_name>_scale_inv`, [..., ceil(M/b0), ceil(N/b1)]) through SGLang's own
    `block_quant_dequant`; per-tensor scales (`<scale_name>_scale`: one per fused shard, [...,
    shards] or [...]) repeated over each shard's rows (`shard_rows`: the rows of each shard)."""
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    if block_size is not None:
        scale = getattr(layer, scale_name + "_scale_inv")
        return block_quant_dequant(weight, scale, block_size, dtype)
    scale = getattr(layer, scale_name + "_scale").float()
    if scale.dim() < weight.dim() - 1:  # one scale for the whole [M, N]: [...] -> [..., 1]
        scale = scale.unsqueeze(-1)
    if scale.shape[-1] > 1:  # fused shards (q/k/v, gate/up) each with their own scale
        rows = torch.tensor(shard_rows, device=scale.device)
        scale = scale.repeat_interleave(rows, dim=-1)
    return (weight.float() * scale.unsqueeze(-1)).to(dtype)


def _linear_apply(self, layer: torch.nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
    if isinstance(x, tuple):  # only fused norm+quant kernels (GPU) hand over quantised input
        raise NotImplementedError("pre-quantised activations have no CPU FP8 path")
    weight = dequantize_weight(layer.weight, layer, "weight", self.weight_block_size, x.dtype,
                               shard_rows=getattr(layer, "logical_widths", None))
    return F.linear(x, weight, bias)


def _moe_apply(self, layer: torch.nn.Module, dispatch_output):
    from sglang.srt.layers.moe import fused_moe_native
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    x = dispatch_output.hidden_states
    block_size = self.quant_config.weight_block_size
    w13_rows = layer.w13_weight.shape[-2] // 2  # gate and up: one per-tensor scale each
    # The native path reads only these attributes of the layer (fused_moe_native.py).
    dequantised = types.SimpleNamespace(
        num_experts=layer.num_experts,
        w13_weight=dequantize_weight(layer.w13_weight, layer, "w13_weight", block_size, x.dtype,
                                     shard_rows=[w13_rows, w13_rows]),
        w2_weight=dequantize_weight(layer.w2_weight, layer, "w2_weight", block_size, x.dtype),
        w13_weight_bias=getattr(layer, "w13_weight_bias", None),
        w2_weight_bias=getattr(layer, "w2_weight_bias", None))
    output = fused_moe_native.moe_forward_native(
        dequantised, x, dispatch_output.topk_output, self.moe_runner_config)
    return StandardCombineInput(hidden_states=output)
