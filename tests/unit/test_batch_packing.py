"""Micro-batch packing (megatron_rl/trainer/batch.py, one gather per field) against a
straightforward per-completion reference on random ragged batches: every field, its dtype and
its padding, with routing tables, pad multiples, several micro-batches, a DP shard and inputs of
mixed dtypes."""
import pytest
import torch

from megatron_rl.trainer.batch import TrainBatch, pack_micro_batches, shard_for_data_parallel

pytestmark = pytest.mark.unit


def _random_batch(seed: int, num: int, *, routed: bool, mixed_dtypes: bool) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 30, (num,), generator=gen).tolist()
    token_ids, loss_mask, old_logprobs, routed_experts = [], [], [], []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, 1000, (n,), generator=gen)
        mask = (torch.rand(n, generator=gen) < 0.6).long()
        mask[0] = 0
        old = -5 * torch.rand(n, generator=gen, dtype=torch.float64)
        if mixed_dtypes and i % 2:
            ids, mask = ids.int(), mask.bool()
        if not (mixed_dtypes and i % 3):
            old = old.float()
        token_ids.append(ids)
        loss_mask.append(mask)
        old_logprobs.append(old)
        routed_experts.append(torch.randint(0, 256, (n - 1, 6), generator=gen).to(torch.uint8))
    prompt_ids = torch.randint(0, 5, (num,), generator=gen)
    return TrainBatch(token_ids=token_ids, loss_mask=loss_mask, old_logprobs=old_logprobs,
                      advantages=torch.randn(num, generator=gen, dtype=torch.float64),
                      prompt_ids=prompt_ids, sample_ids=torch.randperm(num, generator=gen),
                      routed_experts=routed_experts if routed else None)


def _reference_row(batch: TrainBatch, i: int, length: int) -> dict[str, torch.Tensor]:
    """Completion i's row of every field, sliced from its own tensors and zero-padded."""
    ids = batch.token_ids[i].to(torch.int64)
    n = ids.numel() - 1

    def row(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(length, *values.shape[1:], dtype=dtype)
        out[:n] = values.to(dtype)
        return out

    return dict(
        input_ids=row(ids[:-1], torch.int64),
        position_ids=torch.arange(length),
        targets=row(ids[1:], torch.int64),
        loss_mask=row(batch.loss_mask[i][1:] != 0, torch.bool),
        old_logprobs=row(batch.old_logprobs[i][1:].to(torch.float32), torch.float32),
        advantages=row(batch.advantages[i].to(torch.float32).expand(n), torch.float32),
        sample_index=row(batch.sample_ids[i].expand(n), torch.int64),
        prompt_index=row(batch.prompt_ids[i].expand(n), torch.int64),
        padding_mask=torch.arange(length) >= n,
        **({} if batch.routed_experts is None else
           dict(routed_experts=row(batch.routed_experts[i], torch.uint8))),
    )


@pytest.mark.parametrize("seed,routed,mixed_dtypes,pad_to_multiple,max_tokens", [
    (0, False, False, 1, 10_000), (1, True, False, 4, 120), (2, True, True, 3, 64),
    (3, False, True, 8, 200)])
def test_packing_matches_a_per_completion_reference(seed, routed, mixed_dtypes,
                                                    pad_to_multiple, max_tokens):
    batch = _random_batch(seed, 23, routed=routed, mixed_dtypes=mixed_dtypes)
    by_sample_id = {int(s): i for i, s in enumerate(batch.sample_ids)}
    indices = shard_for_data_parallel(batch, 0, 2) if seed % 2 else range(batch.num_samples)
    micro_batches = pack_micro_batches(batch, indices, max_tokens=max_tokens,
                                       pad_to_multiple=pad_to_multiple)
    packed = []
    for mb in micro_batches:
        rows, length = mb.input_ids.shape
        assert length % pad_to_multiple == 0 and rows * length <= max_tokens
        assert (mb.routed_experts is not None) == routed
        for r in range(rows):
            i = by_sample_id[int(mb.sample_index[r, 0])]  # position 0 is never padding
            packed.append(i)
            for name, expected in _reference_row(batch, i, length).items():
                got = getattr(mb, name)[r]
                assert got.dtype == expected.dtype, name
                assert torch.equal(got, expected), (name, i)
    assert sorted(packed) == sorted(indices)
    if seed == 1:  # not vacuous: several micro-batches and padded rows
        assert len(micro_batches) > 1 and any(mb.padding_mask.any() for mb in micro_batches)
