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

Context parallelism (CP > 1), a CPU test path. Each CP rank holds the load-balanced slice of every
sequence that megatron-core's RoPE (`get_pos_emb_on_this_cp_rank`) and Transformer Engine's CP
attention assume: the padded sequence is cut into 2 * cp chunks and rank r keeps chunks r and
2cp-1-r (megatron_rl/ops/context_parallel.py `load_balanced_positions`, which also splits the
micro-batches so).
Here the keys and values are all-gathered over the CP group (megatron-core's differentiable
all-gather, whose backward reduce-scatters - sums - their gradients back to the owning ranks) and
the local queries attend all keys under a causal mask built from GLOBAL positions. That is exact
(the same attention as CP 1, so gradients sum to CP 1's) but holds the full [s] keys and an
[s/cp, s] mask per rank: it exists so CP is wired through and tested on CPU with gloo, not for
long-context memory savings. On GPU, TEDotProductAttention does CP itself (ring/p2p by default,
`TransformerConfig.cp_comm_type`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megatron_rl.ops.context_parallel import load_balanced_positions


def context_parallel_causal_mask(local_len: int, cp_rank: int, cp_size: int, *,
                                 chunk_size: int | None = None) -> Tensor:
    """[local_len, local_len * cp_size] bool, True = masked (Megatron's convention): CP rank
    `cp_rank`'s local queries against the all-gathered keys (rank-major order, each rank's slice
    in its load-balanced order), causal in GLOBAL positions; with `chunk_size` (Llama-4's chunked
    local attention) also masked outside the query's chunk of global positions."""
    seq_len = local_len * cp_size
    query_pos = load_balanced_positions(seq_len, cp_rank, cp_size)[:, None]
    key_pos = torch.cat([load_balanced_positions(seq_len, rank, cp_size)
                         for rank in range(cp_size)])[None, :]
    masked = key_pos > query_pos
    if chunk_size is not None:
        masked |= (key_pos // chunk_size) != (query_pos // chunk_size)
    return masked


def context_parallel_group(pg_collection: ProcessGroupCollection | None):
    """The CP group a core attention works with: its pg_collection's, else parallel_state's."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return group


class SDPACoreAttention(MegatronModule):
    """`DotProductAttention`'s job in one `torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None):
        super().__init__(config=config)
        if config.context_parallel_size > 1 and cp_comm_type not in (None, "all_gather"):
            raise NotImplementedError(
                f"SDPACoreAttention: context parallelism implements cp_comm_type 'all_gather' "
                f"only (got {cp_comm_type!r}); leave TransformerConfig.cp_comm_type unset on the "
                "local spec, or use Transformer Engine's attention for p2p / a2a")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            raise NotImplementedError("SDPACoreAttention: sliding-window attention is not "
                                      "implemented on the local spec")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"SDPACoreAttention: softmax_type {config.softmax_type!r} "
                                      "is not implemented on the local spec (only 'vanilla')")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"] if config.context_parallel_size > 1 else ["tp"])
        tp_size = pg_collection.tp.size()
        self.cp_group = context_parallel_group(pg_collection) \
            if config.context_parallel_size > 1 else None
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
                packed_seq_params=None, *, attention_chunk_size: int | None = None) -> Tensor:
        """`attention_chunk_size` (context parallelism only; Llama-4's chunked local attention):
        a query also attends only keys in its own chunk of that many GLOBAL positions."""
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: packed (thd) sequences need "
                                      "Transformer Engine's attention")
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: an attention bias is not implemented")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        if cp_size > 1:
            if attention_mask is not None or mask_type != AttnMaskType.causal:
                raise NotImplementedError(
                    "SDPACoreAttention with context parallelism implements the causal mask only "
                    f"(got mask type {mask_type.name}, an explicit mask: "
                    f"{attention_mask is not None})")
            # The full sequence's keys and values, rank 0's slice first; backward reduce-scatters.
            key, value = (gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=self.cp_group) for x in (key, value))
            attention_mask = context_parallel_causal_mask(
                query.shape[0], self.cp_group.rank(), cp_size,
                chunk_size=attention_chunk_size).to(query.device)
        elif attention_chunk_size is not None:
            raise ValueError("SDPACoreAttention: attention_chunk_size is for the context-parallel "
                             "path; without CP, fold the chunks into the batch (models/llama4)")
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
