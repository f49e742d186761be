"""torchrun worker for test_vocab_parallel_logprobs.py: runs vocab_parallel_chunked_logprobs on this
rank's vocab shard for every case and saves inputs and results for the test to compare against the
single-rank op. Not a test module itself (no test_ prefix); launched with --out DIR."""

import argparse
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_rl.ops import vocab_parallel_chunked_logprobs


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    num_tokens: int
    hidden_size: int
    shard_sizes: tuple[int, ...]  # vocab rows per rank; the vocab size is their sum
    chunk_size: int
    dtype: str
    megatron_copy_region: bool  # hidden through Megatron's copy_to_tensor_model_parallel_region
    temperature: float = 1.0  # the sampling temperature the logits are divided by
    fp32_head: bool = True  # False: each shard's logits GEMM in the inputs' dtype (BF16)


CASES = (
    Case("fp32_even_chunk_not_dividing", 10, 8, (6, 6), 4, "float32", False),
    Case("fp32_uneven_shards", 9, 8, (7, 6), 3, "float32", False),
    Case("fp32_chunk_larger_than_tokens", 5, 6, (5, 5), 16, "float32", False),
    Case("fp32_single_token", 1, 6, (4, 5), 1, "float32", False),
    Case("bf16", 12, 16, (8, 8), 5, "bfloat16", False),
    Case("fp32_megatron_copy_region", 10, 8, (6, 6), 4, "float32", True),
    # At a sampling temperature T != 1 every shard divides its logits by T before the collectives.
    Case("fp32_temperature_0.7_uneven_shards", 9, 8, (7, 6), 4, "float32", False, 0.7),
    Case("bf16_temperature_1.3", 12, 16, (8, 8), 5, "bfloat16", False, 1.3),
    Case("fp32_temperature_0.7_megatron_copy_region", 10, 8, (6, 6), 3, "float32", True, 0.7),
    # model.fp32_lm_head=false: every shard's BF16 GEMM cast to FP32 before the collectives.
    Case("bf16_gemm_head_temperature_0.7_uneven_shards", 12, 16, (9, 7), 5, "bfloat16", False,
         0.7, fp32_head=False),
)


def make_inputs(case: Case) -> dict[str, torch.Tensor]:
    """The same full inputs on every rank (seeded)."""
    gen = torch.Generator().manual_seed(1234)
    vocab_size = sum(case.shard_sizes)
    dtype = getattr(torch, case.dtype)
    return {
        "hidden": torch.randn(case.num_tokens, case.hidden_size, generator=gen).to(dtype),
        "weight": torch.randn(vocab_size, case.hidden_size, generator=gen).to(dtype),
        "targets": torch.randint(0, vocab_size, (case.num_tokens,), generator=gen),
        "grad_out": torch.randn(case.num_tokens, generator=gen),
    }


def run_case(case: Case, rank: int, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    inputs = make_inputs(case)
    vocab_start_index = sum(case.shard_sizes[:rank])
    weight_shard = inputs["weight"][vocab_start_index : vocab_start_index + case.shard_sizes[rank]]
    weight_shard = weight_shard.clone().requires_grad_(True)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    op_input = hidden
    if case.megatron_copy_region:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        op_input = copy_to_tensor_model_parallel_region(hidden, group=group)
    logprobs, entropy = vocab_parallel_chunked_logprobs(
        op_input, weight_shard, inputs["targets"],
        vocab_start_index=vocab_start_index, group=group, chunk_size=case.chunk_size,
        temperature=case.temperature, fp32_head=case.fp32_head,
    )
    (logprobs * inputs["grad_out"]).sum().backward()
    return {
        **inputs,
        "logprobs": logprobs.detach(),
        "entropy": entropy,
        "grad_hidden": hidden.grad,
        "grad_weight_shard": weight_shard.grad,
        "vocab_start_index": torch.tensor(vocab_start_index),
    }


def bad_target_error(rank: int, group: dist.ProcessGroup) -> str:
    """A target id past the vocabulary must raise on every rank (no rank may hang)."""
    weight_shard = torch.randn(4, 8)
    try:
        vocab_parallel_chunked_logprobs(
            torch.randn(3, 8), weight_shard, torch.tensor([0, 8, 5]),
            vocab_start_index=4 * rank, group=group, chunk_size=2,
        )
    except ValueError as err:
        return str(err)
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out_dir = parser.parse_args().out
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world_size)))  # passed in explicitly, never a global
    results = {}
    for case in CASES:
        assert len(case.shard_sizes) == world_size, "launch with as many ranks as shards"
        results[case.name] = {"case": asdict(case), **run_case(case, rank, group)}
    results["bad_target_error"] = bad_target_error(rank, group)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
