"""Loss aggregation (sample / prompt / token average) with global denominators: hand values on an
uneven batch, and exactness when the tokens are sharded arbitrarily (data-parallel ranks,
micro-batches) and the shard losses are summed (SCALERL.md section 3)."""
import random

import pytest
import torch

from megatron_rl.algorithms import AggregationDenominators, aggregate_loss, token_weights

pytestmark = pytest.mark.unit

# Uneven batch: prompt 0 has completions 0 (2 tokens) and 1 (1 token); prompt 1 has completions 2
# (3 tokens + 1 masked token whose loss is garbage) and 3 (1 token).
TOKEN_LOSS = [1.0, 3.0, 5.0, 2.0, 4.0, 6.0, 100.0, 8.0]
LOSS_MASK = [1, 1, 1, 1, 1, 1, 0, 1]
SAMPLE_INDEX = [0, 0, 1, 2, 2, 2, 2, 3]
PROMPT_INDEX = [0, 0, 0, 1, 1, 1, 1, 1]
EXPECTED = {
    "token": (1 + 3 + 5 + 2 + 4 + 6 + 8) / 7,  # 29/7
    "sample": ((1 + 3) / 2 + 5 / 1 + (2 + 4 + 6) / 3 + 8 / 1) / 4,  # (2 + 5 + 4 + 8) / 4 = 4.75
    "prompt": ((1 + 3 + 5) / 3 + (2 + 4 + 6 + 8) / 4) / 2,  # (3 + 5) / 2 = 4
}


def _batch():
    return (torch.tensor(TOKEN_LOSS, dtype=torch.float64), torch.tensor(LOSS_MASK),
            torch.tensor(SAMPLE_INDEX), torch.tensor(PROMPT_INDEX))


def _global_denominators():
    masks = [torch.tensor([1, 1]), torch.tensor([1]), torch.tensor([1, 1, 1, 0]),
             torch.tensor([1])]
    return AggregationDenominators.from_global_batch(masks, prompt_of_sample=[0, 0, 1, 1])


def test_denominators_from_global_batch():
    den = _global_denominators()
    assert (den.num_prompts, den.num_samples, den.num_tokens) == (2, 4, 7)
    assert den.sample_num_tokens.tolist() == [2, 1, 3, 1]
    assert den.prompt_num_tokens.tolist() == [3, 4]
    _, mask, sample_index, prompt_index = _batch()
    from_tokens = AggregationDenominators.from_tokens(mask, sample_index, prompt_index)
    assert from_tokens.sample_num_tokens.tolist() == [2, 1, 3, 1]
    assert from_tokens.prompt_num_tokens.tolist() == [3, 4]
    assert (from_tokens.num_prompts, from_tokens.num_samples, from_tokens.num_tokens) == (2, 4, 7)


@pytest.mark.parametrize("mode", ["token", "sample", "prompt"])
def test_modes_match_hand_values(mode):
    token_loss, mask, sample_index, prompt_index = _batch()
    loss = aggregate_loss(token_loss, mode, mask, sample_index, prompt_index)
    assert loss.item() == pytest.approx(EXPECTED[mode], rel=1e-14)
    weights = token_weights(mode, mask, sample_index, prompt_index, _global_denominators(),
                            dtype=torch.float64)
    assert weights[6].item() == 0.0  # masked token
    assert (weights * torch.where(mask.bool(), token_loss, 0.0)).sum().item() == \
        pytest.approx(EXPECTED[mode], rel=1e-14)


def test_hand_weights():
    _, mask, sample_index, prompt_index = _batch()
    den = _global_denominators()
    weights = {mode: token_weights(mode, mask, sample_index, prompt_index, den,
                                   dtype=torch.float64).tolist()
               for mode in ("token", "sample", "prompt")}
    assert weights["token"] == pytest.approx([1 / 7] * 6 + [0.0, 1 / 7])
    assert weights["sample"] == pytest.approx(
        [1 / 8, 1 / 8, 1 / 4, 1 / 12, 1 / 12, 1 / 12, 0.0, 1 / 4])
    assert weights["prompt"] == pytest.approx([1 / 6] * 3 + [1 / 8] * 3 + [0.0, 1 / 8])


def _naive_aggregate(mode, completions, prompt_of_sample):
    """Reference from nested lists: completions[i] = list of (loss, mask) pairs."""
    kept = [[loss for loss, m in tokens if m] for tokens in completions]
    if mode == "token":
        flat = [loss for tokens in kept for loss in tokens]
        return sum(flat) / len(flat)
    if mode == "sample":
        means = [sum(tokens) / len(tokens) for tokens in kept if tokens]
        return sum(means) / len(means)
    per_prompt = {}
    for tokens, prompt in zip(kept, prompt_of_sample):
        per_prompt.setdefault(prompt, []).extend(tokens)
    means = [sum(t) / len(t) for t in per_prompt.values() if t]
    return sum(means) / len(means)


def _random_batch(rng):
    num_prompts, group_size = 3, 3
    completions, prompt_of_sample = [], []
    for prompt in range(num_prompts):
        for _ in range(group_size):
            length = rng.randint(0, 6)  # 0: an empty completion, excluded from the means
            completions.append([(rng.uniform(-2, 2), int(rng.random() < 0.8))
                                for _ in range(length)])
            prompt_of_sample.append(prompt)
    completions[0] = [(1.0, 1)]  # at least one loss token
    return completions, prompt_of_sample


def _shard_sum(mode, pieces, den):
    """Each piece is one shard's tokens (a DP rank's micro-batch); returns the summed loss."""
    total = 0.0
    for loss, mask, sample_index, prompt_index in pieces:
        weights = token_weights(mode, mask, sample_index, prompt_index, den, dtype=loss.dtype)
        total = total + (loss * weights).sum()
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sharded_sum_equals_whole_batch_loss_and_gradient(seed):
    rng = random.Random(seed)
    completions, prompt_of_sample = _random_batch(rng)
    den = AggregationDenominators.from_global_batch(
        [torch.tensor([m for _, m in tokens], dtype=torch.long) for tokens in completions],
        prompt_of_sample)
    flat = [(loss, m, i, prompt_of_sample[i])
            for i, tokens in enumerate(completions) for loss, m in tokens]
    num_tokens = len(flat)

    for mode in ("token", "sample", "prompt"):
        expected = _naive_aggregate(mode, completions, prompt_of_sample)
        whole_loss = torch.tensor([t[0] for t in flat], dtype=torch.float64, requires_grad=True)
        columns = [torch.tensor([t[k] for t in flat]) for k in (1, 2, 3)]
        whole = aggregate_loss(whole_loss, mode, *columns, den)
        whole.backward()
        assert whole.item() == pytest.approx(expected, rel=1e-12)

        # Shuffle tokens (completions end up split across shards) and cut at random points.
        order = list(range(num_tokens))
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, num_tokens), k=min(3, num_tokens - 1)))
        shard_loss = torch.tensor([t[0] for t in flat], dtype=torch.float64, requires_grad=True)
        pieces = []
        for start, stop in zip([0, *cuts], [*cuts, num_tokens]):
            ids = torch.tensor(order[start:stop])
            pieces.append((shard_loss[ids], *(column[ids] for column in columns)))
        sharded = _shard_sum(mode, pieces, den)
        sharded.backward()
        assert sharded.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
        # Each token's gradient is its weight, identical whichever shard it lands in.
        assert torch.equal(shard_loss.grad, whole_loss.grad)


def test_shards_with_local_denominators_would_be_wrong():
    # The reason for global denominators: averaging each shard and then the shards differs.
    token_loss, mask, sample_index, prompt_index = _batch()
    halves = [slice(0, 3), slice(3, 8)]
    local = sum(aggregate_loss(token_loss[h], "token", mask[h], sample_index[h],
                               prompt_index[h]) for h in halves) / 2
    assert local.item() == pytest.approx((9 / 3 + 20 / 4) / 2)
    assert local.item() != pytest.approx(EXPECTED["token"])


def test_empty_completion_is_left_out_of_the_means():
    den = AggregationDenominators.from_global_batch(
        [torch.tensor([1, 1]), torch.tensor([0, 0]), torch.tensor([], dtype=torch.long)],
        prompt_of_sample=[0, 0, 1])
    assert (den.num_prompts, den.num_samples, den.num_tokens) == (1, 1, 2)
    weights = token_weights("sample", torch.tensor([1, 1, 0, 0]), torch.tensor([0, 0, 1, 1]),
                            None, den)
    assert weights.tolist() == [0.5, 0.5, 0.0, 0.0]


def test_padding_may_carry_negative_ids():
    loss = torch.tensor([2.0, 4.0, 0.0])
    mask = torch.tensor([1, 1, 0])
    sample_index = torch.tensor([0, 0, -1])
    assert aggregate_loss(loss, "sample", mask, sample_index, torch.tensor([0, 0, -1])) == 3.0


def test_aggregation_input_errors():
    token_loss, mask, sample_index, prompt_index = _batch()
    den = _global_denominators()
    with pytest.raises(ValueError, match=r"'seq'.*\('sample', 'prompt', 'token'\)"):
        token_weights("seq", mask, sample_index, prompt_index, den)
    with pytest.raises(ValueError, match="needs sample_index"):
        token_weights("sample", mask, None, prompt_index, den)
    with pytest.raises(ValueError, match="holds id 9 but the denominators cover only 4 ids"):
        token_weights("sample", mask, sample_index + 6, prompt_index, den)
    with pytest.raises(ValueError, match=r"prompt_index has shape \(7,\) but loss_mask has "
                                         r"shape \(8,\)"):
        token_weights("prompt", mask, sample_index, prompt_index[:7], den)
    bad = AggregationDenominators(num_prompts=2, num_samples=4, num_tokens=6,
                                  sample_num_tokens=torch.tensor([2, 0, 2, 2]),
                                  prompt_num_tokens=torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="0 loss tokens in the denominators"):
        token_weights("sample", mask, sample_index, prompt_index, bad)
    with pytest.raises(ValueError, match="differs from the sum of sample_num_tokens"):
        AggregationDenominators(num_prompts=1, num_samples=1, num_tokens=5,
                                sample_num_tokens=torch.tensor([2]),
                                prompt_num_tokens=torch.tensor([2]))
    with pytest.raises(ValueError, match="3 completions but 2 prompt ids"):
        AggregationDenominators.from_sample_token_counts([1, 2, 3], [0, 0])
    with pytest.raises(ValueError, match=r"token_loss has shape \(7,\)"):
        aggregate_loss(token_loss[:7], "token", mask, sample_index, prompt_index)
