"""Policy losses (CISPO, DAPO/GRPO, GSPO) against hand-computed values and gradients
(SCALERL.md section 3)."""
import math

import pytest
import torch

from megatron_rl.algorithms import (
    AggregationDenominators,
    aggregate_loss,
    build_interrupted_completion,
    cispo_loss,
    clipped_surrogate_loss,
    compute_policy_loss,
    gspo_loss,
    token_weights,
)

pytestmark = pytest.mark.unit

F64 = torch.float64


def _t(values, dtype=F64, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def _close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype),
                               rtol=0, atol=tol)


# Four tokens: log-ratios 0, 0.5, -1.5, 0.1 -> rho = 1, e^0.5 = 1.6487, e^-1.5 = 0.2231, e^0.1.
LOGP = [-1.0, -0.5, -2.0, -0.1]
OLD_LOGP = [-1.0, -1.0, -0.5, -0.2]
ADV = [0.5, 2.0, -1.0, -0.5]
RHO = [1.0, math.exp(0.5), math.exp(-1.5), math.exp(0.1)]


def test_cispo_values_and_truncation():
    logp = _t(LOGP, grad=True)
    out = cispo_loss(logp, _t(OLD_LOGP), _t(ADV), eps_max=1.5)
    # weight = min(rho, 1.5) = [1, 1.5 (truncated), e^-1.5, e^0.1]; loss = -weight * A * logp.
    weight = [1.0, 1.5, RHO[2], RHO[3]]
    _close(out.token_loss, [-w * a * lp for w, a, lp in zip(weight, ADV, LOGP)])
    # i.e. [0.5, 1.5, -0.44626, -0.05526]
    _close(out.token_loss, [0.5, 1.5, -2 * math.exp(-1.5), -0.05 * math.exp(0.1)])
    _close(out.ratio, RHO)
    assert out.clipped.tolist() == [False, True, False, False]
    _close(out.abs_logp_diff, [0.0, 0.5, 1.5, 0.1])
    assert out.sequence_ratio is None


def test_cispo_gradient_only_through_logp():
    logp = _t(LOGP, grad=True)
    old_logp = _t(OLD_LOGP, grad=True)  # must stay out of the graph even if it requires grad
    advantages = _t(ADV, grad=True)
    for eps_max, weight in ((1.5, [1.0, 1.5, RHO[2], RHO[3]]), (5.0, RHO)):
        logp.grad = None
        out = cispo_loss(logp, old_logp, advantages, eps_max=eps_max)
        out.token_loss.sum().backward()
        # d loss_t / d logp_t = -sg(min(rho_t, eps_max)) * A_t; truncated token: -1.5 * 2 = -3.
        _close(logp.grad, [-w * a for w, a in zip(weight, ADV)])
        assert old_logp.grad is None and advantages.grad is None
    assert out.ratio.requires_grad is False and out.abs_logp_diff.requires_grad is False


def test_cispo_gradient_never_vanishes_where_surrogate_clips():
    # rho = e^1 > 1.28 with A > 0: DAPO cuts the gradient, CISPO keeps -min(rho, eps_max) * A.
    logp = _t([0.0], grad=True)
    cispo_loss(logp, _t([-1.0]), _t([1.0]), eps_max=5.0).token_loss.sum().backward()
    _close(logp.grad, [-math.e])
    logp.grad = None
    clipped_surrogate_loss(logp, _t([-1.0]), _t([1.0])).token_loss.sum().backward()
    _close(logp.grad, [0.0])


# (rho, A) cases for the clipped surrogate with eps_low 0.2, eps_high 0.28; old_logp = -1.
SURROGATE_CASES = [
    # rho,  A,   loss = -min(rho A, clip(rho) A),  d loss / d logp,  clipped
    (1.5, 1.0, -1.28, 0.0, True),     # above 1 + eps_high, A > 0: clipped, no gradient
    (1.5, -1.0, 1.5, 1.5, False),     # above, A < 0: min picks rho A, gradient -A rho
    (0.5, 1.0, -0.5, -0.5, False),    # below 1 - eps_low, A > 0: min picks rho A
    (0.5, -1.0, 0.8, 0.0, True),      # below, A < 0: clipped, no gradient
    (1.1, 2.0, -2.2, -2.2, False),    # inside the range
    (0.9, -2.0, 1.8, 1.8, False),
    (1.25, 1.0, -1.25, -1.25, False),  # inside DAPO's 1.28 but outside GRPO's 1.2
]


def _surrogate_inputs():
    rho = [case[0] for case in SURROGATE_CASES]
    logp = _t([math.log(r) - 1.0 for r in rho], grad=True)
    return logp, _t([-1.0] * len(rho)), _t([case[1] for case in SURROGATE_CASES])


def test_dapo_clip_on_both_sides():
    logp, old_logp, advantages = _surrogate_inputs()
    out = compute_policy_loss("dapo", logp, old_logp, advantages)  # default 0.2 / 0.28
    out.token_loss.sum().backward()
    _close(out.token_loss, [case[2] for case in SURROGATE_CASES])
    _close(logp.grad, [case[3] for case in SURROGATE_CASES])
    assert out.clipped.tolist() == [case[4] for case in SURROGATE_CASES]
    _close(out.ratio, [case[0] for case in SURROGATE_CASES])


def test_grpo_is_symmetric_clip():
    logp, old_logp, advantages = _surrogate_inputs()
    out = compute_policy_loss("grpo", logp, old_logp, advantages)  # default 0.2 / 0.2
    out.token_loss.sum().backward()
    # The upper clip moves to 1.2: case 0 (rho 1.5, A > 0) now gives -1.2 instead of -1.28, and
    # the last case (rho 1.25 > 1.2, A > 0) is clipped to -1.2 with gradient 0.
    expected_loss = [-1.2] + [case[2] for case in SURROGATE_CASES[1:-1]] + [-1.2]
    expected_grad = [case[3] for case in SURROGATE_CASES[:-1]] + [0.0]
    _close(out.token_loss, expected_loss)
    _close(logp.grad, expected_grad)
    assert out.clipped.tolist() == [case[4] for case in SURROGATE_CASES[:-1]] + [True]
    # Explicit eps override the per-kind default.
    explicit = compute_policy_loss("grpo", logp, old_logp, advantages, eps_low=0.2,
                                   eps_high=0.28)
    _close(explicit.token_loss, [case[2] for case in SURROGATE_CASES])


def _gspo_reference(logp, old_logp, advantages, segments, eps_low, eps_high):
    """Naive sequence-level GSPO: mean over completions of -min(s_i A_i, clip(s_i) A_i) with
    s_i = exp(mean over the completion's tokens of logp - old_logp), differentiable."""
    losses = []
    for tokens in segments:
        s = torch.exp((logp[tokens] - old_logp[tokens]).mean())
        a = advantages[tokens[0]]
        losses.append(-torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a))
    return torch.stack(losses).mean()


def test_gspo_sequence_ratio_and_gradient():
    # Completion 0: tokens 0, 1 (log-ratios 0.1, 0.3) and token 2 masked, whose behaviour log-prob
    # is NaN (an inserted phrase has none); completion 1: tokens 3, 4 (log-ratios -0.2, 0.0).
    old = [-1.0, -1.0, float("nan"), -0.5, -0.7]
    logp_values = [-0.9, -0.7, -3.0, -0.7, -0.7]
    sample_index = torch.tensor([0, 0, 0, 1, 1])
    loss_mask = torch.tensor([1, 1, 0, 1, 1])
    advantages = _t([1.0, 1.0, 1.0, -1.0, -1.0])
    s0, s1 = math.exp(0.2), math.exp(-0.1)  # 1.2214, 0.9048

    # eps 0.1: s0 > 1.1 with A > 0 is clipped; s1 >= 0.9 with A < 0 is not.
    logp = _t(logp_values, grad=True)
    out = gspo_loss(logp, _t(old), advantages, sample_index, loss_mask=loss_mask,
                    eps_low=0.1, eps_high=0.1)
    _close(out.sequence_ratio, [s0, s0, s0, s1, s1])
    _close(out.token_loss, [-1.1, -1.1, 0.0, s1, s1])
    assert out.clipped.tolist() == [True, True, False, False, False]
    _close(out.ratio, [math.exp(0.1), math.exp(0.3), 1.0, math.exp(-0.2), 1.0])
    _close(out.abs_logp_diff, [0.1, 0.3, 0.0, 0.2, 0.0])
    out.token_loss.sum().backward()
    # Per token: d/dlogp_t = -A s_i on unclipped tokens, 0 on clipped and masked ones.
    _close(logp.grad, [0.0, 0.0, 0.0, s1, s1])

    # Sample-averaged, the per-token form has exactly the sequence-level objective's gradient.
    for eps in (0.1, 0.5):
        logp = _t(logp_values, grad=True)
        out = compute_policy_loss("gspo", logp, _t(old), advantages, sample_index=sample_index,
                                  loss_mask=loss_mask, eps_low=eps, eps_high=eps)
        loss = aggregate_loss(out.token_loss, "sample", loss_mask, sample_index,
                              torch.tensor([0, 0, 0, 1, 1]))
        loss.backward()
        ref_logp = _t(logp_values, grad=True)
        ref = _gspo_reference(ref_logp, _t(old), advantages, [[0, 1], [3, 4]], eps, eps)
        ref.backward()
        _close(loss, ref.item())
        _close(logp.grad, ref_logp.grad.tolist())


def test_gspo_sequence_ratio_of_a_completion_split_over_context_parallel_ranks():
    """Issue 29.5: one completion of 4 tokens, log-ratios 0, 0.5, 0.5, 0. CP 1: s = e^0.25 =
    1.284. CP 2 (load-balanced: rank 0 holds positions 0 and 3, rank 1 positions 1 and 2): each
    rank's own mean gives 1.0 and e^0.5 = 1.649; the partial sums added over the ranks give every
    token CP 1's ratio, loss and gradient back."""
    from megatron_rl.algorithms.losses import gspo_log_ratio_sums
    from megatron_rl.ops.context_parallel import load_balanced_positions

    old = _t([-1.0, -1.5, -1.5, -1.0])
    logp_values = [-1.0, -1.0, -1.0, -1.0]
    advantages = _t([1.0] * 4)
    sample_index = torch.zeros(4, dtype=torch.long)
    logp = _t(logp_values, grad=True)
    whole = gspo_loss(logp, old, advantages, sample_index, eps_low=0.5, eps_high=0.5)
    whole.token_loss.sum().backward()
    _close(whole.sequence_ratio, [math.exp(0.25)] * 4)  # 1.284

    slices = [load_balanced_positions(4, rank, 2) for rank in range(2)]
    assert [s.tolist() for s in slices] == [[0, 3], [1, 2]]
    own = [gspo_loss(_t(logp_values)[k], old[k], advantages[k], sample_index[k],
                     eps_low=0.5, eps_high=0.5).sequence_ratio for k in slices]
    _close(own[0], [1.0, 1.0])
    _close(own[1], [math.exp(0.5)] * 2)  # 1.649

    sums = sum(gspo_log_ratio_sums(_t(logp_values)[k], old[k], sample_index[k], 1)
               for k in slices)
    _close(sums, [1.0])  # 0 + 0.5 + 0.5 + 0
    for k in slices:
        piece = _t(logp_values)[k].requires_grad_()
        out = compute_policy_loss("gspo", piece, old[k], advantages[k],
                                  sample_index=sample_index[k], eps_low=0.5, eps_high=0.5,
                                  sequence_log_ratio=(sums / 4)[sample_index[k]])
        out.token_loss.sum().backward()
        _close(out.sequence_ratio, whole.sequence_ratio[k].tolist())
        _close(out.token_loss, whole.token_loss[k].tolist())
        _close(piece.grad, logp.grad[k].tolist())


def test_gspo_log_ratio_sums_masks_and_checks_its_ids():
    from megatron_rl.algorithms.losses import gspo_log_ratio_sums

    # Completion 2: log-ratios 0.1 and (masked, no behaviour log-prob) NaN; completion 0: -0.2,
    # and a ratio beyond e^20 clamped as in the loss; completion 1 has no token here.
    logp, old = _t([-0.9, -3.0, -0.7, -1.0]), _t([-1.0, float("nan"), -0.5, -30.0])
    index, mask = torch.tensor([2, 2, 0, 0]), torch.tensor([1, 0, 1, 1])
    _close(gspo_log_ratio_sums(logp, old, index, 3, loss_mask=mask), [-0.2 + 20.0, 0.0, 0.1])
    with pytest.raises(ValueError, match=r"outside \[0, num_samples=2\)"):
        gspo_log_ratio_sums(logp, old, index, 2, loss_mask=mask)
    with pytest.raises(ValueError, match="sequence_log_ratio is GSPO's"):
        compute_policy_loss("cispo", logp, old, _t([1.0] * 4), sequence_log_ratio=logp)
    with pytest.raises(ValueError, match=r"sequence_log_ratio has shape \(2,\)"):
        gspo_loss(logp, old, _t([1.0] * 4), index, loss_mask=mask,
                  sequence_log_ratio=_t([0.0, 0.0]))


def test_gspo_default_clip_range_is_tiny():
    # s = e^0.001 = 1.0010005 is beyond GSPO's default 1 + 4e-4, so a positive advantage clips.
    sample_index = torch.tensor([0, 0])
    out = compute_policy_loss("gspo", _t([-1.0, -1.0]), _t([-1.001, -1.001]), _t([1.0, 1.0]),
                              sample_index=sample_index)
    _close(out.token_loss, [-(1 + 4e-4), -(1 + 4e-4)])
    assert out.clipped.all()


def test_interruption_tokens_are_excluded_from_the_loss():
    token_ids, loss_mask = build_interrupted_completion([11, 12], [90, 91, 92], [13])
    num_tokens = len(token_ids)
    logp = _t([-0.5] * num_tokens, grad=True)
    # The generator recorded no log-prob for the inserted phrase: NaN must not leak anywhere.
    old_logp = _t([-0.6, -0.6, float("nan"), float("nan"), float("nan"), -0.6])
    mask = torch.tensor(loss_mask)
    for kind in ("cispo", "dapo", "gspo"):
        logp.grad = None
        out = compute_policy_loss(kind, logp, old_logp, _t([1.0] * num_tokens),
                                  sample_index=torch.zeros(num_tokens, dtype=torch.long),
                                  loss_mask=mask, eps_low=0.2, eps_high=0.28)
        loss = aggregate_loss(out.token_loss, "token", mask, None, None)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert logp.grad[2:5].tolist() == [0.0, 0.0, 0.0], kind
        assert (logp.grad[[0, 1, 5]] != 0).all(), kind
        assert out.token_loss[2:5].tolist() == [0.0, 0.0, 0.0]


def test_low_precision_inputs_compute_in_fp32():
    logp = torch.tensor([-1.0, -0.5], dtype=torch.bfloat16, requires_grad=True)
    out = cispo_loss(logp, torch.tensor([-1.0, -1.0], dtype=torch.bfloat16),
                     torch.tensor([1.0, -1.0], dtype=torch.bfloat16))
    assert out.token_loss.dtype == torch.float32
    out.token_loss.sum().backward()
    assert logp.grad.dtype == torch.bfloat16


def test_extreme_log_ratio_gives_finite_gradients():
    logp = _t([0.0, 0.0], dtype=torch.float32, grad=True)
    old_logp = _t([-200.0, -200.0], dtype=torch.float32)
    for kind in ("cispo", "dapo"):
        logp.grad = None
        out = compute_policy_loss(kind, logp, old_logp, _t([1.0, -1.0], dtype=torch.float32))
        out.token_loss.sum().backward()
        assert torch.isfinite(out.token_loss).all() and torch.isfinite(logp.grad).all()


def test_loss_input_errors():
    logp, old_logp, advantages = _t(LOGP), _t(OLD_LOGP), _t(ADV)
    with pytest.raises(ValueError, match=r"'ppo'.*\('cispo', 'dapo', 'grpo', 'gspo'\)"):
        compute_policy_loss("ppo", logp, old_logp, advantages)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="eps_max must be a finite number > 0"):
            compute_policy_loss("cispo", logp, old_logp, advantages, eps_max=bad)
    with pytest.raises(ValueError, match=r"old_logp has shape \(3,\) but logp has shape \(4,\)"):
        cispo_loss(logp, old_logp[:3], advantages)
    with pytest.raises(ValueError, match=r"advantages must be a 1-D per-token tensor"):
        cispo_loss(logp, old_logp, advantages.reshape(2, 2))
    with pytest.raises(ValueError, match=r"loss_mask has shape \(3,\)"):
        cispo_loss(logp, old_logp, advantages, loss_mask=torch.ones(3))
    with pytest.raises(ValueError, match="needs sample_index"):
        compute_policy_loss("gspo", logp, old_logp, advantages)
    with pytest.raises(ValueError, match=r"sample_index has shape \(2,\)"):
        gspo_loss(logp, old_logp, advantages, torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        gspo_loss(logp, old_logp, advantages, torch.zeros(4))
    with pytest.raises(ValueError, match=r"eps_low must be in \[0, 1\)"):
        compute_policy_loss("dapo", logp, old_logp, advantages, eps_low=1.0)
    with pytest.raises(ValueError, match="eps_high must be a finite number >= 0"):
        compute_policy_loss("dapo", logp, old_logp, advantages, eps_high=-0.1)
    with pytest.raises(TypeError, match="logp must be floating point"):
        cispo_loss(torch.zeros(4, dtype=torch.long), old_logp, advantages)


@pytest.mark.parametrize("kind", ["cispo", "dapo", "gspo"])
def test_loss_on_data_parallel_shards_matches_single_rank(kind):
    # 2 prompts x 2 completions of lengths 3, 1, 2, 4; shards hold whole completions (packed
    # micro-batches on two DP ranks), denominators are global.
    gen = torch.Generator().manual_seed(0)
    lengths, prompt_of_sample = [3, 1, 2, 4], [0, 0, 1, 1]
    sample_index = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    prompt_index = torch.tensor(prompt_of_sample)[sample_index]
    num_tokens = sum(lengths)
    logp_values = -torch.rand(num_tokens, generator=gen, dtype=F64)
    old_logp = logp_values + 0.3 * torch.randn(num_tokens, generator=gen, dtype=F64)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=F64)[sample_index]
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[5] = False
    den = AggregationDenominators.from_global_batch(
        [mask[sample_index == i] for i in range(4)], prompt_of_sample)

    def shard_loss(logp, ids):
        out = compute_policy_loss(kind, logp[ids], old_logp[ids], advantages[ids],
                                  sample_index=sample_index[ids], loss_mask=mask[ids],
                                  eps_low=0.2, eps_high=0.28)
        weights = token_weights("prompt", mask[ids], sample_index[ids], prompt_index[ids], den,
                                dtype=F64)
        return (out.token_loss * weights).sum()

    whole_logp = logp_values.clone().requires_grad_(True)
    whole = shard_loss(whole_logp, torch.arange(num_tokens))
    whole.backward()
    shard_logp = logp_values.clone().requires_grad_(True)
    rank_tokens = [torch.tensor([4, 5, 0, 1, 2]), torch.tensor([3]), torch.arange(6, 10)]
    sharded = sum(shard_loss(shard_logp, ids) for ids in rank_tokens)
    sharded.backward()
    assert sharded.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(shard_logp.grad, whole_logp.grad, rtol=0, atol=1e-15)
    assert whole_logp.grad.abs().sum() > 0
