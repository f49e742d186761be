"""TrainBatch validation, data-parallel sharding and micro-batch packing (hand-checked values)."""
import pytest
import torch

from megatron_rl.trainer.batch import (TrainBatch, pack_micro_batches, padding_micro_batch,
                                       shard_for_data_parallel)

pytestmark = pytest.mark.unit


def _batch(lengths, prompt_len=2):
    ids = [torch.arange(100, 100 + n) for n in lengths]
    masks = [torch.tensor([0] * prompt_len + [1] * (n - prompt_len)) for n in lengths]
    old = [torch.full((n,), -float(i + 1)) for i, n in enumerate(lengths)]
    num = len(lengths)
    return TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old,
                      advantages=torch.arange(num, dtype=torch.float32),
                      prompt_ids=torch.arange(num) // 2, sample_ids=torch.arange(num))


def test_shifted_targets_masks_and_padding():
    batch = _batch([5, 3])
    (mb,) = pack_micro_batches(batch, [0, 1], max_tokens=100)
    # Row 0 is the longest completion: 4 positions predicting tokens 1..4.
    assert mb.input_ids.tolist() == [[100, 101, 102, 103], [100, 101, 0, 0]]
    assert mb.targets.tolist() == [[101, 102, 103, 104], [101, 102, 0, 0]]
    assert mb.loss_mask.tolist() == [[False, True, True, True], [False, True, False, False]]
    assert mb.padding_mask.tolist() == [[False] * 4, [False, False, True, True]]
    assert mb.old_logprobs[0].tolist() == [-1.0] * 4
    assert mb.advantages[1].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert mb.num_loss_tokens == 4 and mb.num_tokens == 6


def test_token_budget_and_pad_multiple():
    batch = _batch([9, 7, 5, 3])  # 8, 6, 4, 2 positions
    mbs = pack_micro_batches(batch, range(4), max_tokens=12, pad_to_multiple=4)
    # Padded lengths 8, 8, 4, 4: [8] alone (2 x 8 > 12), then [6->8] alone, then 4 + 2 -> 2 x 4.
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(1, 8), (1, 8), (2, 4)]
    assert sorted(int(mb.sample_index[r, 0]) for mb in mbs for r in range(len(mb.input_ids))) \
        == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="micro_batch_max_tokens"):
        pack_micro_batches(batch, range(4), max_tokens=7)


def test_data_parallel_shards_balance_tokens_and_cover_the_batch():
    batch = _batch([10, 9, 4, 3, 3, 2])
    shards = [shard_for_data_parallel(batch, r, 2) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(6))
    # Longest-first greedy, ties to the lower rank: 10 -> r0, 9 -> r1, 4 -> r1 (13), 3 -> r0 (13),
    # 3 -> r0 (tie, 16), 2 -> r1 (15).
    assert shards == [[0, 3, 4], [1, 2, 5]]
    assert shard_for_data_parallel(_batch([4]), 1, 2) == []  # fewer completions than ranks


def test_padding_micro_batch_carries_no_loss():
    mb = padding_micro_batch(pad_to_multiple=4)
    assert mb.input_ids.shape == (1, 4) and mb.num_loss_tokens == 0


@pytest.mark.parametrize("change, message", [
    (dict(sample_ids=torch.tensor([0, 0])), "permutation"),
    (dict(advantages=torch.zeros(3)), "advantages"),
    (dict(loss_mask=[torch.tensor([1, 1, 1]), torch.tensor([0, 1, 1])]), "first token"),
    (dict(old_logprobs=[torch.zeros(2), torch.zeros(3)]), "must match token_ids"),
])
def test_bad_batches_are_rejected(change, message):
    fields = dict(token_ids=[torch.arange(3), torch.arange(3)],
                  loss_mask=[torch.tensor([0, 1, 1])] * 2,
                  old_logprobs=[torch.zeros(3)] * 2, advantages=torch.zeros(2),
                  prompt_ids=torch.zeros(2, dtype=torch.long), sample_ids=torch.arange(2))
    fields.update(change)
    with pytest.raises(ValueError, match=message):
        TrainBatch(**fields)


def test_denominator_inputs_are_indexed_by_sample_id():
    batch = TrainBatch(token_ids=[torch.arange(4), torch.arange(6)],
                       loss_mask=[torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 0, 1, 1])],
                       old_logprobs=[torch.zeros(4), torch.zeros(6)],
                       advantages=torch.zeros(2), prompt_ids=torch.tensor([7, 3]),
                       sample_ids=torch.tensor([1, 0]))
    assert batch.sample_num_loss_tokens() == [3, 3]
    assert batch.prompt_of_sample() == [3, 7]


def test_batch_from_rollout_groups():
    """Kept groups of rollout samples -> the trainer's batch: prompt tokens masked out with
    log-prob 0, inserted (interruption) tokens keep mask 0, advantages broadcast per sample."""
    from megatron_rl.rollout.samples import Segment, assemble_sample

    def sample(group_id, index, prompt, tokens, phrase=()):
        segments = [Segment(token_ids=tokens, logprobs=tuple(-0.5 for _ in tokens),
                            versions=(3,) * len(tokens))]
        if phrase:
            segments.append(Segment(token_ids=phrase, sampled=False))
        return assemble_sample(group_id=group_id, sample_index=index, prompt_token_ids=prompt,
                               segments=segments, finish_reason="stop")

    groups = [[sample(7, 0, (1, 2), (5, 6)), sample(7, 1, (1, 2), (8,), phrase=(9,))],
              [sample(4, 0, (3,), (10, 11, 12)), sample(4, 1, (3,), (13,))]]
    batch = TrainBatch.from_groups(groups, [[0.5, -0.5], [1.0, -1.0]])
    assert [t.tolist() for t in batch.token_ids] == [[1, 2, 5, 6], [1, 2, 8, 9], [3, 10, 11, 12],
                                                     [3, 13]]
    assert [m.tolist() for m in batch.loss_mask] == [[0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 1, 1],
                                                     [0, 1]]
    assert batch.old_logprobs[1].tolist() == [0.0, 0.0, -0.5, 0.0]
    assert batch.advantages.tolist() == [0.5, -0.5, 1.0, -1.0]
    assert batch.prompt_ids.tolist() == [0, 0, 1, 1]
    assert batch.sample_num_loss_tokens() == [2, 1, 3, 1]
    with pytest.raises(ValueError, match="2 samples but 1 advantages"):
        TrainBatch.from_groups(groups[:1], [[0.5]])


def test_packing_matches_a_per_row_reference():
    # The collation is whole-tensor; a per-row reference of every field, with mixed lengths,
    # float64 advantages, permuted sample ids and a pad multiple.
    lengths = [7, 4, 6, 2, 5]
    batch = _batch(lengths)
    batch = TrainBatch(token_ids=batch.token_ids, loss_mask=batch.loss_mask,
                       old_logprobs=batch.old_logprobs,
                       advantages=torch.tensor([0.1, -2.5, 3.25, 1e-3, -0.7], dtype=torch.float64),
                       prompt_ids=torch.tensor([3, 3, 1, 0, 1]),
                       sample_ids=torch.tensor([4, 2, 0, 1, 3]))
    (mb,) = pack_micro_batches(batch, range(5), max_tokens=100, pad_to_multiple=4)
    order = [0, 2, 4, 1, 3]  # longest first
    assert mb.input_ids.shape == (5, 8)
    for row, i in enumerate(order):
        n = lengths[i] - 1
        ids = batch.token_ids[i]
        assert mb.input_ids[row].tolist() == ids[:-1].tolist() + [0] * (8 - n)
        assert mb.targets[row].tolist() == ids[1:].tolist() + [0] * (8 - n)
        mask = (batch.loss_mask[i][1:] != 0).tolist()
        assert mb.loss_mask[row].tolist() == mask + [False] * (8 - n)
        old = batch.old_logprobs[i][1:].tolist()
        assert mb.old_logprobs[row].tolist() == old + [0.0] * (8 - n)
        assert mb.advantages[row].tolist() == [float(torch.tensor(
            float(batch.advantages[i]), dtype=torch.float32))] * n + [0.0] * (8 - n)
        assert mb.sample_index[row].tolist() == [int(batch.sample_ids[i])] * n + [0] * (8 - n)
        assert mb.prompt_index[row].tolist() == [int(batch.prompt_ids[i])] * n + [0] * (8 - n)
        assert mb.padding_mask[row].tolist() == [False] * n + [True] * (8 - n)
        assert mb.position_ids[row].tolist() == list(range(8))
    assert mb.input_ids.dtype == mb.targets.dtype == mb.sample_index.dtype == torch.int64
    assert mb.old_logprobs.dtype == mb.advantages.dtype == torch.float32
