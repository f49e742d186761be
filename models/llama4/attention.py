"""Llama-4 attention pieces that megatron-core 0.19.2 lacks, as ModuleSpec submodules.

Megatron already skips RoPE on NoPE layers (`no_rope_freq`) and has a weight-free `L2Norm` for q/k.
What it lacks, and this module adds without forking Megatron code:
- `Llama4SelfAttention`: SelfAttention whose q/k L2 norm exists on RoPE layers only (Llama-4
  applies it there; Megatron's `qk_l2_norm` would apply it on every layer).
- `Llama4CoreAttention`, wrapped around the backend's own core attention (`SDPACoreAttention` on
  the local spec, CPU; `TEDotProductAttention` on GPU):
  * RoPE layers: chunked local attention - a token attends causally within its
    `attention_chunk_size` chunk only. Implemented by folding the chunks into the batch dimension
    (sbhd) or splitting packed sequences at chunk boundaries (thd), so any backend's causal kernel
    computes it exactly and in O(seq * chunk).
  * NoPE layers: attention temperature tuning - the query at position p is multiplied by
    1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) (positions restart per packed sequence).
Behaviour is decided from the global 1-based layer number each module receives. Megatron's own
KV-cache inference is not supported on Llama-4 layers (it raises); generation runs in SGLang.

Context parallelism (CP > 1, right-padded sbhd rows in Megatron's load-balanced layout, see
models/sdpa_attention.py): temperature tuning scales each local query by its GLOBAL position, on
either backend. Chunked local attention works on the local spec only: SDPACoreAttention's
all-gather CP path masks keys outside the query's global chunk (exact, O(s^2), the CPU test path).
Transformer Engine's CP attention has no chunked-local mask and folding chunks into the batch
needs contiguous sequences, so Llama-4's RoPE (chunked) layers with TE and CP > 1 raise at
construction; packed (thd) sequences with CP raise too.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from megatron_rl.ops.context_parallel import load_balanced_positions
from models.sdpa_attention import SDPACoreAttention, context_parallel_group


class Llama4SelfAttention(SelfAttention):
    """SelfAttention with Llama-4's q/k L2 norm on RoPE layers only."""

    def __init__(self, config, submodules, layer_number: int, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if not config.is_rope_layer(layer_number):
            # L2Norm has no parameters, so dropping it changes no state dict.
            self.q_layernorm = None
            self.k_layernorm = None


def temperature_scales(positions: Tensor, *, floor_scale: int, attn_scale: float) -> Tensor:
    """Llama-4 NoPE-layer query scales (fp32) for 0-based token positions."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def packed_positions(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """0-based position of each token within its packed sequence, [num_tokens]."""
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], seqlens)
    return torch.arange(num_tokens, device=cu_seqlens.device) - starts[:num_tokens]


def split_cu_seqlens_into_chunks(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    """Cumulative lengths after cutting every packed sequence at multiples of `chunk_size`
    (counted from the sequence's own start): chunked causal attention over packed sequences is
    plain causal attention over these pieces."""
    boundaries = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        boundaries.extend(range(start, end, chunk_size))
    boundaries.append(int(cu_seqlens[-1]))
    return torch.tensor(boundaries, dtype=cu_seqlens.dtype, device=cu_seqlens.device)


def _chunk_mask(attention_mask: Tensor, seq_len: int, padded_len: int, chunk_size: int) -> Tensor:
    """[b, 1, s, s] bool mask (True = masked) -> the diagonal chunk blocks [n * b, 1, C, C]."""
    batch = attention_mask.shape[0]
    if padded_len != seq_len:
        # Padding rows/columns behave causally, so no padded query row is fully masked.
        full = torch.ones(padded_len, padded_len, dtype=torch.bool,
                          device=attention_mask.device).triu(1)
        full = full.expand(batch, 1, padded_len, padded_len).clone()
        full[:, :, :seq_len, :seq_len] = attention_mask
        attention_mask = full
    num_chunks = padded_len // chunk_size
    blocks = attention_mask.expand(batch, 1, padded_len, padded_len).reshape(
        batch, 1, num_chunks, chunk_size, num_chunks, chunk_size)
    blocks = torch.diagonal(blocks, dim1=2, dim2=4)  # [b, 1, C, C, n]
    return blocks.permute(4, 0, 1, 2, 3).reshape(num_chunks * batch, 1, chunk_size, chunk_size)


class Llama4CoreAttention(MegatronModule):
    """Chunked local attention (RoPE layers) and temperature tuning (NoPE layers) around a
    backend core attention `backend_attention` (built with the arguments Megatron gives a core
    attention, held as `self.backend`); see the module docstring. Composition rather than a
    subclass: without Transformer Engine, megatron's TEDotProductAttention is a stand-in object
    that cannot be subclassed, and the spec must still name it on CPU."""

    def __init__(self, config, layer_number: int, *args, backend_attention, **kwargs):
        super().__init__(config=config)
        self.backend = backend_attention(config, layer_number, *args, **kwargs)
        is_rope_layer = config.is_rope_layer(layer_number)
        self.llama4_chunk_size = config.attention_chunk_size if is_rope_layer else None
        self.llama4_temperature_tuning = config.attn_temperature_tuning and not is_rope_layer
        self.llama4_floor_scale = config.floor_scale
        self.llama4_attn_scale = config.attn_scale
        self.cp_group = None
        if config.context_parallel_size > 1:
            if self.llama4_chunk_size is not None and \
                    not isinstance(self.backend, SDPACoreAttention):
                raise NotImplementedError(
                    f"Llama-4 chunked local attention (RoPE layer {layer_number}) with "
                    f"context_parallel_size={config.context_parallel_size} is implemented on the "
                    "local spec's SDPACoreAttention only (the CPU all-gather path); Transformer "
                    "Engine's CP attention has no chunked-local mask. Use "
                    "context_parallel_size=1 for Llama-4 on GPU")
            self.cp_group = context_parallel_group(kwargs.get("pg_collection"))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None, **kwargs):
        is_thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if query.shape[0] != key.shape[0]:
            raise NotImplementedError(
                "Llama-4 layers do not support Megatron's KV-cache inference (query and key "
                "lengths differ); generate with SGLang")
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        if cp_size > 1 and packed_seq_params is not None:
            raise NotImplementedError("Llama-4 layers with context parallelism take right-padded "
                                      "sbhd rows, not packed sequences")
        if self.llama4_temperature_tuning:
            query = self._scale_query(query, packed_seq_params if is_thd else None)
        if cp_size > 1 and self.llama4_chunk_size is not None:
            # Local positions are two non-contiguous global pieces: mask chunks by global position.
            return self.backend(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                attention_bias=attention_bias,
                                attention_chunk_size=self.llama4_chunk_size, **kwargs)
        if self.llama4_chunk_size is None:
            return self.backend(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                attention_bias=attention_bias,
                                packed_seq_params=packed_seq_params, **kwargs)
        if is_thd:
            return self.backend(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                attention_bias=attention_bias,
                                packed_seq_params=self._chunked_packed_params(packed_seq_params),
                                **kwargs)
        return self._chunked_forward(query, key, value, attention_mask, attn_mask_type,
                                     attention_bias, packed_seq_params, **kwargs)

    def _scale_query(self, query: Tensor, packed_seq_params: PackedSeqParams | None) -> Tensor:
        num_tokens = query.shape[0]
        if packed_seq_params is None:  # sbhd: [s, b, np, hn]; under CP the global positions
            cp_size = self.cp_group.size() if self.cp_group is not None else 1
            rank = self.cp_group.rank() if cp_size > 1 else 0
            positions = load_balanced_positions(num_tokens * cp_size, rank, cp_size).to(
                query.device)
            shape = (num_tokens, 1, 1, 1)
        else:  # thd: [t, np, hn]
            positions = packed_positions(packed_seq_params.cu_seqlens_q, num_tokens)
            shape = (num_tokens, 1, 1)
        scales = temperature_scales(positions, floor_scale=self.llama4_floor_scale,
                                    attn_scale=self.llama4_attn_scale)
        # Multiply in fp32 and round once, as the reference does.
        return (query * scales.view(shape)).to(query.dtype)

    def _chunked_packed_params(self, params: PackedSeqParams) -> PackedSeqParams:
        if params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
            raise NotImplementedError("chunked attention over padded packed sequences "
                                      "(cu_seqlens_*_padded) is not implemented")
        if not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise NotImplementedError("chunked attention needs equal query and key packing")
        cu_seqlens = split_cu_seqlens_into_chunks(params.cu_seqlens_q, self.llama4_chunk_size)
        max_seqlen = min(self.llama4_chunk_size, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
        return dataclasses.replace(params, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                   max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)

    def _chunked_forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                         packed_seq_params, **kwargs):
        seq_len, batch = query.shape[:2]
        chunk = self.llama4_chunk_size
        if seq_len <= chunk:  # one chunk: plain causal attention
            return self.backend(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                attention_bias=attention_bias,
                                packed_seq_params=packed_seq_params, **kwargs)
        if attention_bias is not None:
            raise NotImplementedError("chunked attention with an attention bias is not implemented")
        num_chunks = -(-seq_len // chunk)
        padded_len = num_chunks * chunk

        def fold(x: Tensor) -> Tensor:
            # [s, b, h, d] -> [C, n * b, h, d]: chunk j of batch row i becomes batch row j * b + i.
            # Zero padding at the end only meets later (causally masked) or padded positions.
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 0, 0, padded_len - seq_len))
            x = x.view(num_chunks, chunk, *x.shape[1:]).transpose(0, 1)
            return x.reshape(chunk, num_chunks * batch, *x.shape[3:])

        mask = None
        if attention_mask is not None:
            mask = _chunk_mask(attention_mask, seq_len, padded_len, chunk)
        context = self.backend(fold(query), fold(key), fold(value), mask,
                               attn_mask_type=attn_mask_type, **kwargs)
        # [C, n * b, hp] -> [n * C, b, hp] -> [s, b, hp]
        context = context.view(chunk, num_chunks, batch, -1).transpose(0, 1)
        return context.reshape(padded_len, batch, -1)[:seq_len]


def llama4_core_attention(use_transformer_engine: bool) -> partial:
    """The core-attention builder for a SelfAttention spec: Llama4CoreAttention around
    SDPACoreAttention (the local spec's, CPU) or TEDotProductAttention (GPU)."""
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return partial(Llama4CoreAttention, backend_attention=TEDotProductAttention)
    return partial(Llama4CoreAttention, backend_attention=SDPACoreAttention)
