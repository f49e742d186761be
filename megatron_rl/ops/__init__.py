"""Numerical kernels of the trainer's loss path written in plain torch: today the FP32 LM head that
turns final hidden states into per-token log-probabilities and entropies, chunked over tokens and
optionally sharded over the vocabulary (see logprobs.py)."""

from megatron_rl.ops.logprobs import chunked_logprobs, vocab_parallel_chunked_logprobs

__all__ = ["chunked_logprobs", "vocab_parallel_chunked_logprobs"]
