"""Routed experts for the local (CPU) spec in two grouped GEMMs instead of a Python loop.

megatron-core 0.19.2 builds `SequentialMLP` for the local spec (`moe_grouped_gemm` needs
Transformer Engine's GroupedLinear; megatron's torch `grouped_mm` experts are inference-only):
per local expert a split, a Megatron ColumnParallelLinear, the GLU activation, a
RowParallelLinear (each linear a Python autograd function with its own region ops), and a
concatenation. On CPU at test sizes a step is per-op overhead, and that loop was the largest MoE
cost (docs/trainer_speed.md).

`GroupedSequentialMLP` IS a `SequentialMLP` - the same `local_experts.{i}.linear_fc1/linear_fc2`
parameters, shapes, sharded state dict and checkpoint layout, so conversion, weight sync and
checkpoints do not see a difference - whose forward stacks the experts' weights and runs
`torch._grouped_mm` over the tokens (already sorted by expert by the dispatcher), one GLU over all
of them, and a second `torch._grouped_mm`. Per expert that is the same arithmetic as
SequentialMLP's: the same matrix products of the same rows (torch's CPU grouped GEMM computes each
group as its own GEMM), the same element-wise activation and probability scaling. Gradients reach
each expert's weight through the stack, so Megatron DDP's per-parameter hooks see them as before.

The expert linears never communicate inside the experts module (with expert tensor or expert
parallelism Megatron marks them `explicit_expert_comm` and the dispatcher does the collectives;
with neither, their region ops are over a group of 1), so the grouped path is valid at any
layout. It is taken only where it is known to compute what SequentialMLP does: tensors on the CPU,
no FP8/FP4, no expert bias, the plain torch activation (no fused bias-activation, no TE
activation, no clamp), no delayed weight-gradient computation; otherwise the forward is
SequentialMLP's own. GPU runs use Transformer Engine's grouped experts and never build this class.
"""
from __future__ import annotations

import torch

from megatron.core.transformer.moe.experts import SequentialMLP


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP whose CPU forward is two grouped GEMMs (module docstring)."""

    def _grouped_path_supported(self, hidden_states: torch.Tensor) -> bool:
        config = self.config
        return (hidden_states.device.type == "cpu" and self.num_local_experts > 1
                and not (config.fp8 or config.fp4)
                and not config.add_bias_linear and not config.bias_activation_fusion
                and not config.use_te_activation_func
                and config.activation_func_clamp_value is None
                and not config.delay_wgrad_compute)

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        if not self._grouped_path_supported(permuted_local_hidden_states):
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs)
        hidden = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:
            # As SequentialMLP: scale the inputs (top-1 only). SequentialMLP then scales the GLU
            # output by ones, which changes no value; that multiplication is left out below.
            assert self.config.moe_router_topk == 1, \
                "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(hidden.dtype)
        # End offset of each expert's rows (the dispatcher sorted the tokens by local expert).
        offsets = torch.cumsum(torch.as_tensor(tokens_per_expert, device=hidden.device),
                               0).to(torch.int32)
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        # Each expert's Linear computes x @ W^T; the transposed views keep that operand layout.
        intermediate = torch._grouped_mm(hidden, fc1.transpose(1, 2), offs=offsets)
        if self.config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
            intermediate = self.config.activation_func(x_glu) * (
                x_linear + self.config.glu_linear_offset)
        else:
            intermediate = self.config.activation_func(intermediate)
        if not self.config.moe_apply_probs_on_input:  # MLP.forward's per-token scale
            intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)
        output = torch._grouped_mm(intermediate, fc2.transpose(1, 2), offs=offsets)
        return output, None

