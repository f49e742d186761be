"""Core attention through torch's `scaled_dot_product_attention`, for the local (non-Transformer
Engine) spec, which is the CPU trainer's.

megatron-core 0.19.2's local `DotProductAttention` computes attention as separate ops (a baddbmm
into a preallocated buffer, a masked softmax module, dropout, a bmm, each with its own autograd
node and views), and its causal mask is materialised per call. On CPU, where the trainer's step is
per-op overhead at test sizes, that is the largest single cost of a step (docs/trainer_speed.md).
Torch's fused SDPA kernel for CPU computes the same thing in one op each way.

Same interface and semantics as `DotProductAttention` where the families use it: [sq, b, np, hn]
queries, [sk, b, ng, hn] keys and values (grouped-query attention), a causal mask when the
attention mask is None and the mask type is causal, a boolean mask (True = masked) otherwise, the
softmax scale 1/sqrt(hn) unless given (query-key layer scaling cancels out, as in Megatron),
attention dropout, [sq, b, np * hn] out. What `DotProductAttention` supports and this does not
(sliding windows, off-by-one or learnable softmax) raises at construction. GPU runs use
`TEDotProductAttention` and never build this class.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """`DotProductAttention`'s job in one `torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention (the local spec's core attention) does "
                                      "not do context parallelism; it needs Transformer Engine")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            raise NotImplementedError("SDPACoreAttention: sliding-window attention is not "
                                      "implemented on the local spec")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"SDPACoreAttention: softmax_type {config.softmax_type!r} "
                                      "is not implemented on the local spec (only 'vanilla')")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_groups = divide(config.num_query_groups, tp_size)
        # Megatron divides the scale by the layer number under query-key layer scaling and
        # multiplies the scores back in its softmax: the product is this.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None \
            else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: packed (thd) sequences need "
                                      "Transformer Engine's attention")
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: an attention bias is not implemented")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is not None:
            # Megatron's mask is True where masked; SDPA's boolean mask is True where attended.
            mask, causal = ~attention_mask, False
        else:
            mask, causal = None, mask_type == AttnMaskType.causal
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale,
            enable_gqa=self.num_heads != self.num_groups)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
