"""Vocab-parallel chunked log-probs over 2 gloo ranks equal the single-rank op (and the naive full
-logits reference): values on every rank, the hidden gradient summed over ranks (or all-reduced by
Megatron's copy_to_tensor_model_parallel_region), and each rank's weight-shard gradient equal to
its slice of the single-rank weight gradient; also at sampling temperatures T != 1 (logits / T,
against the single-rank op and the naive reference at the same T), and with fp32_head=False (the
BF16 logits GEMM cast to FP32; the naive reference computes its logits the same way). One torchrun
launch runs every case (_vocab_parallel_worker.py); this module compares what the ranks saved.

Tolerances: FP32 1e-5 (abs and rel; only reduction order differs). BF16: values are FP32 (1e-5);
each rank rounds its partial hidden gradient to BF16 before the sum, so the summed gradient agrees
to a few BF16 roundings of the partials' size (abs 2**-6 x max |grad|, rel 2**-6).
"""

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from megatron_rl.ops import chunked_logprobs

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 240
WORKER = Path(__file__).with_name("_vocab_parallel_worker.py")
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory, torchrun) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("vocab_parallel")
    torchrun(WORKER, ["--out", str(out_dir)], num_ranks=WORLD_SIZE, timeout_s=LAUNCH_TIMEOUT_S)
    return [
        torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)
    ]


def naive_values(hidden, weight, targets, temperature, fp32_head):
    if fp32_head:
        logits = hidden.float() @ weight.float().t()  # [tokens, vocab]
    else:
        logits = (hidden @ weight.t()).float()  # the GEMM in the inputs' dtype
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return log_probs.gather(1, targets.unsqueeze(-1)).squeeze(-1), entropy


def single_rank(result):
    hidden = result["hidden"].clone().requires_grad_(True)
    weight = result["weight"].clone().requires_grad_(True)
    logprobs, entropy = chunked_logprobs(
        hidden, weight, result["targets"], chunk_size=result["case"]["chunk_size"],
        temperature=result["case"]["temperature"], fp32_head=result["case"]["fp32_head"],
    )
    (logprobs * result["grad_out"]).sum().backward()
    return logprobs.detach(), entropy, hidden.grad, weight.grad


CASE_NAMES = [
    "fp32_even_chunk_not_dividing",
    "fp32_uneven_shards",
    "fp32_chunk_larger_than_tokens",
    "fp32_single_token",
    "bf16",
    "fp32_megatron_copy_region",
    "fp32_temperature_0.7_uneven_shards",
    "bf16_temperature_1.3",
    "fp32_temperature_0.7_megatron_copy_region",
    "bf16_gemm_head_temperature_0.7_uneven_shards",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_matches_single_rank(rank_results, name):
    per_rank = [results[name] for results in rank_results]
    ref_logprobs, ref_entropy, ref_grad_hidden, ref_grad_weight = single_rank(per_rank[0])
    naive_logprobs, naive_entropy = naive_values(
        per_rank[0]["hidden"], per_rank[0]["weight"], per_rank[0]["targets"],
        per_rank[0]["case"]["temperature"], per_rank[0]["case"]["fp32_head"],
    )
    assert_close(ref_logprobs, naive_logprobs, **FP32_TOL)
    assert_close(ref_entropy, naive_entropy, **FP32_TOL)
    if not per_rank[0]["case"]["fp32_head"]:  # the BF16 GEMM's rounding shows: not the FP32 head
        fp32_logprobs, _ = naive_values(
            per_rank[0]["hidden"], per_rank[0]["weight"], per_rank[0]["targets"],
            per_rank[0]["case"]["temperature"], True,
        )
        assert (ref_logprobs - fp32_logprobs).abs().max() > 1e-3
    for rank, result in enumerate(per_rank):
        def on_rank(message, rank=rank):
            return f"rank {rank}: {message}"

        assert_close(result["logprobs"], ref_logprobs, **FP32_TOL, msg=on_rank)
        assert_close(result["entropy"], ref_entropy, **FP32_TOL, msg=on_rank)

    is_bf16 = per_rank[0]["case"]["dtype"] == "bfloat16"
    grad_tol = FP32_TOL
    if is_bf16:
        grad_tol = dict(atol=2**-6 * ref_grad_hidden.float().abs().max().item(), rtol=2**-6)

    if per_rank[0]["case"]["megatron_copy_region"]:
        # Megatron's convention: the copy region's backward all-reduces; each rank has the sum.
        for result in per_rank:
            assert_close(result["grad_hidden"], ref_grad_hidden, **grad_tol)
    else:
        # Each rank returns only its shard's contribution; they sum to the single-rank gradient.
        for result in per_rank:
            assert not torch.allclose(result["grad_hidden"].float(), ref_grad_hidden.float())
        summed = sum(result["grad_hidden"].float() for result in per_rank)
        assert_close(summed, ref_grad_hidden.float(), **grad_tol)

    for result in per_rank:
        start = int(result["vocab_start_index"])
        shard = result["grad_weight_shard"]
        assert shard.dtype == ref_grad_weight.dtype
        weight_tol = FP32_TOL if not is_bf16 else dict(atol=1e-6, rtol=2**-7)
        assert_close(shard, ref_grad_weight[start : start + shard.shape[0]], **weight_tol)


def test_every_case_checked(rank_results):
    assert sorted(k for k in rank_results[0] if k != "bad_target_error") == sorted(CASE_NAMES)


def test_target_outside_vocab_raises_on_every_rank(rank_results):
    for results in rank_results:
        assert "target id 8 (token 1) is owned by 0 vocab shards" in results["bad_target_error"]
