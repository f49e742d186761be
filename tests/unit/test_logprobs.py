"""Chunked FP32 log-probs / entropy (megatron_rl.ops) against a hand-computed example and against
the naive reference: full FP32 logits, log_softmax, gather, with autograd for the gradients.

Tolerances: FP32 inputs 1e-5 (abs and rel; only the summation order differs). BF16 inputs: values
are still FP32 and agree to 1e-5; gradients are FP32 internally and rounded once to BF16, so they
agree to one BF16 rounding (rel 2**-7) of the naive gradient, which is rounded the same way.
At a sampling temperature T != 1 the reference is independent of the op's own arithmetic:
log_softmax(logits / T) in float64 with autograd, to the same FP32 tolerance.
With fp32_head=False (the ablation of the FP32 head) the reference is the BF16 GEMM cast to FP32,
(hidden_bf16 @ weight_bf16^T).float(), then the same float64 log_softmax with autograd: values
to the FP32 tolerance, gradients (rounded to BF16 by autograd of the cast) to one BF16 rounding.
"""

import math

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.ops import chunked_logprobs, vocab_parallel_chunked_logprobs

pytestmark = pytest.mark.unit

FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_GRAD_TOL = dict(atol=1e-6, rtol=2**-7)


def naive_logprobs(hidden, weight, targets):
    """The reference: the whole [tokens, vocab] FP32 logits at once."""
    log_probs = torch.log_softmax(hidden.float() @ weight.float().t(), dim=-1)  # [T, V]
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return log_probs.gather(1, targets.unsqueeze(-1)).squeeze(-1), entropy.detach()


def make_inputs(num_tokens, hidden_size, vocab_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
    weight = torch.randn(vocab_size, hidden_size, generator=gen).to(dtype)
    targets = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    grad_out = torch.randn(num_tokens, generator=gen)  # a non-uniform upstream gradient
    return hidden, weight, targets, grad_out


def values_and_grads(fn, hidden, weight, targets, grad_out, **kwargs):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    logprobs, entropy = fn(hidden, weight, targets, **kwargs)
    (logprobs * grad_out).sum().backward()
    return logprobs.detach(), entropy, hidden.grad, weight.grad


def test_hand_computed_example():
    # logits = [ln 2, 0, 0] -> softmax [1/2, 1/4, 1/4].
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
    hidden = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    logprobs, entropy = chunked_logprobs(hidden, weight, torch.tensor([0]), chunk_size=1)
    logprobs.sum().backward()
    assert_close(logprobs, torch.tensor([math.log(0.5)]))
    assert_close(entropy, torch.tensor([1.5 * math.log(2.0)]))  # -(1/2 ln 1/2 + 2 * 1/4 ln 1/4)
    # d logp / d logits = onehot - softmax = [1/2, -1/4, -1/4]
    assert_close(hidden.grad, torch.tensor([[0.5, -0.25]]))
    ln2 = math.log(2.0)
    expected_grad_weight = torch.tensor([[0.5 * ln2, 0.0], [-0.25 * ln2, 0.0], [-0.25 * ln2, 0.0]])
    assert_close(weight.grad, expected_grad_weight)


def float64_tempered_logprobs(hidden, weight, targets, *, temperature):
    """The reference at a sampling temperature: whole float64 logits / T, log_softmax, gather."""
    log_probs = torch.log_softmax((hidden.double() @ weight.double().t()) / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return log_probs.gather(1, targets.unsqueeze(-1)).squeeze(-1), entropy.detach()


def test_hand_computed_example_at_temperature_2():
    # logits [2 ln 2, 0, 0] / 2 = [ln 2, 0, 0] -> softmax [1/2, 1/4, 1/4], as in the T = 1 example.
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
    hidden = torch.tensor([[2.0 * math.log(2.0), 0.0]], requires_grad=True)
    logprobs, entropy = chunked_logprobs(
        hidden, weight, torch.tensor([0]), chunk_size=1, temperature=2.0
    )
    logprobs.sum().backward()
    assert_close(logprobs, torch.tensor([math.log(0.5)]))
    assert_close(entropy, torch.tensor([1.5 * math.log(2.0)]))  # of the tempered distribution
    # d logp / d logits = (onehot - softmax) / T = [1/4, -1/8, -1/8]
    assert_close(hidden.grad, torch.tensor([[0.25, -0.125]]))
    ln2 = math.log(2.0)
    expected_grad_weight = torch.tensor([[0.5 * ln2, 0.0], [-0.25 * ln2, 0.0], [-0.25 * ln2, 0.0]])
    assert_close(weight.grad, expected_grad_weight)


@pytest.mark.parametrize("chunk_size", [1, 5, 64])  # one row; 5 + 5 + 3 rows; one chunk
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_matches_float64_reference(temperature, chunk_size):
    """Log-probs, entropy and both gradients are those of softmax(logits / T): the distribution
    SGLang samples from and records log-probs of."""
    inputs = make_inputs(num_tokens=13, hidden_size=8, vocab_size=37, dtype=torch.float32, seed=11)
    got = values_and_grads(chunked_logprobs, *inputs, chunk_size=chunk_size,
                           temperature=temperature)
    ref = values_and_grads(float64_tempered_logprobs, *(t.double() if t.is_floating_point() else t
                                                        for t in inputs), temperature=temperature)
    names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    for name, value, expected in zip(names, got, ref):
        assert value.dtype == torch.float32, name
        assert_close(value.double(), expected, **FP32_TOL, msg=lambda m, name=name: f"{name}: {m}")
    # Not the T = 1 values: the temperature is applied, not ignored.
    untempered = values_and_grads(chunked_logprobs, *inputs, chunk_size=chunk_size)
    assert (got[0] - untempered[0]).abs().max() > 1e-2


def test_temperature_bf16_and_still_chunked():
    """BF16 inputs at T != 1 (values FP32, gradients rounded once to BF16), and the scaling adds
    no [tokens, vocab] tensor."""
    inputs = make_inputs(num_tokens=16, hidden_size=24, vocab_size=37, dtype=torch.bfloat16)
    got = values_and_grads(chunked_logprobs, *inputs, chunk_size=7, temperature=0.7)
    ref = values_and_grads(float64_tempered_logprobs, *inputs, temperature=0.7)
    assert_close(got[0].double(), ref[0].double(), **FP32_TOL)
    assert_close(got[1].double(), ref[1].double(), **FP32_TOL)
    assert_close(got[2], ref[2], **BF16_GRAD_TOL)
    assert_close(got[3], ref[3], **BF16_GRAD_TOL)
    num_tokens, hidden_size, vocab_size, chunk_size = 64, 4, 50, 8
    with _LargestOutput() as mode:
        values_and_grads(chunked_logprobs, *make_inputs(num_tokens, hidden_size, vocab_size,
                                                        torch.float32),
                         chunk_size=chunk_size, temperature=0.7)
    assert mode.max_numel == max(chunk_size * vocab_size, vocab_size * hidden_size)


def bf16_gemm_logprobs(hidden, weight, targets, *, temperature=1.0):
    """The fp32_head=False reference: the whole logits GEMM in the inputs' dtype, cast to FP32,
    then log_softmax(logits / T) in float64; autograd rounds the logit gradient to that dtype."""
    logits = (hidden @ weight.t()).float()  # [T, V]
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return log_probs.gather(1, targets.unsqueeze(-1)).squeeze(-1), entropy.detach()


@pytest.mark.parametrize("chunk_size", [1, 5, 64])  # one row; 5 + 5 + 5 + 1 rows; one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_gemm_head_matches_its_reference_and_not_the_fp32_head(temperature, chunk_size):
    """fp32_head=False (model.fp32_lm_head=false): log-probs, entropy and both gradients are those
    of the BF16 logits GEMM cast to FP32; the FP32 head (the default) is the FP32 reference's."""
    inputs = make_inputs(num_tokens=16, hidden_size=24, vocab_size=37, dtype=torch.bfloat16,
                         seed=5)
    got = values_and_grads(chunked_logprobs, *inputs, chunk_size=chunk_size,
                           temperature=temperature, fp32_head=False)
    ref = values_and_grads(bf16_gemm_logprobs, *inputs, temperature=temperature)
    names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    for name, value, expected, tol in zip(names, got, ref, (FP32_TOL, FP32_TOL,
                                                            BF16_GRAD_TOL, BF16_GRAD_TOL)):
        assert value.dtype == (torch.float32 if name in names[:2] else torch.bfloat16), name
        assert_close(value.double(), expected.double(), **tol,
                     msg=lambda m, name=name: f"{name}: {m}")
    fp32_head = values_and_grads(chunked_logprobs, *inputs, chunk_size=chunk_size,
                                 temperature=temperature)
    fp32_ref = values_and_grads(float64_tempered_logprobs, *inputs, temperature=temperature)
    assert_close(fp32_head[0].double(), fp32_ref[0].double(), **FP32_TOL)
    assert_close(fp32_head[1].double(), fp32_ref[1].double(), **FP32_TOL)
    # The BF16 rounding of logits of order 10 (2**-9 relative) shows in every output.
    for name, bf16_value, fp32_value in zip(names, got, fp32_head):
        assert (bf16_value.double() - fp32_value.double()).abs().max() > 1e-3, name
    assert (got[0].double() - fp32_ref[0].double()).abs().max() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_gemm_head_is_the_fp32_head_at_fp32_inputs(temperature):
    inputs = make_inputs(num_tokens=13, hidden_size=8, vocab_size=37, dtype=torch.float32, seed=2)
    bf16_gemm = values_and_grads(chunked_logprobs, *inputs, chunk_size=5,
                                 temperature=temperature, fp32_head=False)
    fp32_head = values_and_grads(chunked_logprobs, *inputs, chunk_size=5,
                                 temperature=temperature, fp32_head=True)
    for value, expected in zip(bf16_gemm, fp32_head):
        assert torch.equal(value, expected)


def test_bf16_gemm_head_is_still_chunked():
    num_tokens, hidden_size, vocab_size, chunk_size = 64, 4, 50, 8
    inputs = make_inputs(num_tokens, hidden_size, vocab_size, torch.bfloat16)
    with _LargestOutput() as mode:
        values_and_grads(chunked_logprobs, *inputs, chunk_size=chunk_size, fp32_head=False)
    assert mode.max_numel == max(chunk_size * vocab_size, vocab_size * hidden_size)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 16, 64])  # divides 16 or not; larger than T
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_naive(dtype, chunk_size):
    inputs = make_inputs(num_tokens=16, hidden_size=24, vocab_size=37, dtype=dtype)
    logprobs, entropy, grad_hidden, grad_weight = values_and_grads(
        chunked_logprobs, *inputs, chunk_size=chunk_size
    )
    ref_logprobs, ref_entropy, ref_grad_hidden, ref_grad_weight = values_and_grads(
        naive_logprobs, *inputs
    )
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert grad_hidden.dtype == grad_weight.dtype == dtype
    assert_close(logprobs, ref_logprobs, **FP32_TOL)
    assert_close(entropy, ref_entropy, **FP32_TOL)
    grad_tol = FP32_TOL if dtype == torch.float32 else BF16_GRAD_TOL
    assert_close(grad_hidden, ref_grad_hidden, **grad_tol)
    assert_close(grad_weight, ref_grad_weight, **grad_tol)


@pytest.mark.parametrize("num_row_blocks", [1, 2, 100])  # whole chunk; 3 + 2 rows; 1 row per block
def test_exp_row_blocks_match_naive(monkeypatch, num_row_blocks):
    monkeypatch.setattr("megatron_rl.ops.logprobs._NUM_ROW_BLOCKS", num_row_blocks)
    inputs = make_inputs(num_tokens=13, hidden_size=8, vocab_size=37, dtype=torch.float32, seed=7)
    got = values_and_grads(chunked_logprobs, *inputs, chunk_size=5)
    ref = values_and_grads(naive_logprobs, *inputs)
    for value, expected in zip(got, ref):
        assert_close(value, expected, **FP32_TOL)


@pytest.mark.parametrize("chunk_size", [1, 1024])
def test_single_token(chunk_size):
    inputs = make_inputs(num_tokens=1, hidden_size=8, vocab_size=11, dtype=torch.float32, seed=3)
    got = values_and_grads(chunked_logprobs, *inputs, chunk_size=chunk_size)
    ref = values_and_grads(naive_logprobs, *inputs)
    names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    for name, value, expected in zip(names, got, ref):
        assert_close(value, expected, **FP32_TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_no_tokens():
    hidden, weight, targets, _ = make_inputs(0, 8, 11, torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    logprobs, entropy = chunked_logprobs(hidden, weight, targets)
    assert logprobs.shape == entropy.shape == (0,)
    logprobs.sum().backward()
    assert hidden.grad.shape == (0, 8)
    assert_close(weight.grad, torch.zeros(11, 8), atol=0.0, rtol=0.0)


def test_large_logits_are_stable():
    # Logits of order 1e3: exp() would overflow without the max shift.
    hidden, weight, targets, grad_out = make_inputs(12, 16, 29, torch.float32, seed=5)
    hidden = hidden * 200.0
    got = values_and_grads(chunked_logprobs, hidden, weight, targets, grad_out, chunk_size=5)
    ref = values_and_grads(naive_logprobs, hidden, weight, targets, grad_out)
    assert all(torch.isfinite(t).all() for t in got)
    assert_close(got[0], ref[0], atol=1e-3, rtol=1e-5)  # logits ~1e3: FP32 ulp ~1e-4
    assert_close(got[1], ref[1], atol=1e-4, rtol=1e-4)
    assert_close(got[2], ref[2], atol=1e-3, rtol=1e-4)
    assert_close(got[3], ref[3], atol=1e-3, rtol=1e-4)


def test_large_vocab_accuracy_against_float64():
    # Sums over a 100k vocabulary are where FP32 accumulation order shows: a BLAS dot product for
    # sum_v e_v z_v was off by 1.5e-4 here; torch's sum gives 6e-7 (the naive FP32 path 1e-5).
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 16, generator=gen)
    weight = torch.randn(100_000, 16, generator=gen) * 0.5
    targets = torch.randint(0, 100_000, (8,), generator=gen)
    logprobs, entropy = chunked_logprobs(hidden, weight, targets, chunk_size=8)
    log_probs64 = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
    assert_close(logprobs.double(), log_probs64.gather(1, targets[:, None])[:, 0], atol=5e-6, rtol=0)
    assert_close(entropy.double(), -(log_probs64.exp() * log_probs64).sum(-1), atol=5e-6, rtol=0)


def test_entropy_is_a_detached_metric_and_optional():
    hidden, weight, targets, _ = make_inputs(9, 8, 13, torch.float32)
    hidden.requires_grad_(True)
    logprobs, entropy = chunked_logprobs(hidden, weight, targets, chunk_size=4)
    assert logprobs.requires_grad and not entropy.requires_grad
    logprobs_only, no_entropy = chunked_logprobs(
        hidden, weight, targets, chunk_size=4, compute_entropy=False
    )
    assert no_entropy is None
    assert_close(logprobs_only, logprobs, atol=0.0, rtol=0.0)


def test_second_backward_through_the_graph_raises_rather_than_returning_wrong_grads():
    # The backward reuses the forward's last-chunk buffer as scratch, so it can run once.
    hidden, weight, targets, _ = make_inputs(10, 8, 13, torch.float32)
    hidden.requires_grad_(True)
    logprobs, _ = chunked_logprobs(hidden, weight, targets, chunk_size=3)
    logprobs.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logprobs.sum().backward()


def test_no_grad_forward_matches_naive():
    inputs = make_inputs(10, 8, 13, torch.float32)
    with torch.no_grad():
        logprobs, entropy = chunked_logprobs(*inputs[:3], chunk_size=4)
    ref_logprobs, ref_entropy = naive_logprobs(*inputs[:3])
    assert_close(logprobs, ref_logprobs, **FP32_TOL)
    assert_close(entropy, ref_entropy, **FP32_TOL)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, targets, grad_out = make_inputs(10, 8, 13, torch.float32)
    hidden.requires_grad_(True)
    logprobs, _ = chunked_logprobs(hidden, weight, targets, chunk_size=3)
    (logprobs * grad_out).sum().backward()
    ref = values_and_grads(naive_logprobs, hidden.detach(), weight, targets, grad_out)
    assert weight.grad is None
    assert_close(hidden.grad, ref[2], **FP32_TOL)


def test_single_shard_with_group_none_equals_chunked():
    inputs = make_inputs(11, 8, 13, torch.float32)
    got = values_and_grads(
        vocab_parallel_chunked_logprobs, *inputs, vocab_start_index=0, group=None, chunk_size=4
    )
    ref = values_and_grads(chunked_logprobs, *inputs, chunk_size=4)
    for value, expected in zip(got, ref):
        assert_close(value, expected, atol=0.0, rtol=0.0)


class _LargestOutput(TorchDispatchMode):
    """Records the largest number of elements any aten op returns."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.max_numel = max(self.max_numel, tensor.numel())
        return out


def test_never_materialises_tokens_by_vocab():
    num_tokens, hidden_size, vocab_size, chunk_size = 64, 4, 50, 8
    inputs = make_inputs(num_tokens, hidden_size, vocab_size, torch.float32)
    with _LargestOutput() as chunked_mode:
        values_and_grads(chunked_logprobs, *inputs, chunk_size=chunk_size)
    with _LargestOutput() as naive_mode:
        values_and_grads(naive_logprobs, *inputs)
    assert naive_mode.max_numel == num_tokens * vocab_size  # the probe sees the full logits
    # Largest tensors of the chunked op: one chunk of logits, or the [vocab, hidden] weight grad.
    assert chunked_mode.max_numel == max(chunk_size * vocab_size, vocab_size * hidden_size)


@pytest.mark.parametrize(
    "hidden_shape, weight_shape, targets, kwargs, error, match",
    [
        ((2, 3, 4), (5, 4), [0, 1], {}, ValueError, "flatten batch"),
        ((2, 4), (5, 3), [0, 1], {}, ValueError, "hidden size mismatch"),
        ((2, 4), (5, 4), [0, 1, 2], {}, ValueError, "targets must be"),
        ((2, 4), (5, 4), [0.0, 1.0], {}, TypeError, "integer token ids"),
        ((2, 4), (5, 4), [0, 1], {"chunk_size": 0}, ValueError, "chunk_size"),
        ((2, 4), (5, 4), [0, 5], {}, ValueError, r"target id 5 \(token 1\) is owned by 0"),
        ((2, 4), (5, 4), [-1, 0], {}, ValueError, r"target id -1 \(token 0\)"),
        ((2, 4), (5, 4), [0, 1], {"temperature": 0.0}, ValueError, "temperature must be"),
        ((2, 4), (5, 4), [0, 1], {"temperature": -0.7}, ValueError, "temperature must be"),
        ((2, 4), (5, 4), [0, 1], {"temperature": math.inf}, ValueError, "temperature must be"),
    ],
)
def test_bad_input_raises_a_clear_error(hidden_shape, weight_shape, targets, kwargs, error, match):
    with pytest.raises(error, match=match):
        chunked_logprobs(
            torch.randn(hidden_shape), torch.randn(weight_shape), torch.tensor(targets), **kwargs
        )
