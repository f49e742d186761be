"""Context parallelism's single-process pieces against hand-computed expectations: the
load-balanced positions each CP rank holds, the split of a packed micro-batch (every field,
padding included), SDPACoreAttention's global-position CP mask, and the CP config checks. The
multi-rank behaviour (all-gather attention, RL step at CP 2 == CP 1) is tests/dist/
test_context_parallel.py."""
import pytest
import torch

from megatron_rl.trainer.batch import (TrainBatch, pack_micro_batches, padding_micro_batch,
                                       split_for_context_parallel)

pytestmark = pytest.mark.unit


def test_load_balanced_positions_by_hand():
    from megatron_rl.ops.context_parallel import load_balanced_positions

    # 12 positions, CP 2: chunks of 3; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    assert load_balanced_positions(12, 0, 2).tolist() == [0, 1, 2, 9, 10, 11]
    assert load_balanced_positions(12, 1, 2).tolist() == [3, 4, 5, 6, 7, 8]
    # CP 3, 12 positions: chunks of 2; rank r keeps chunks r and 5 - r.
    assert [load_balanced_positions(12, r, 3).tolist() for r in range(3)] == \
        [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    assert load_balanced_positions(5, 0, 1).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="multiple of 2 \\* 2"):
        load_balanced_positions(10, 0, 2)


def _batch():
    # Two completions of 7 and 4 tokens (6 and 3 positions), prompt of 2 tokens each.
    ids = [torch.arange(10, 17), torch.arange(20, 24)]
    masks = [torch.tensor([0, 0, 1, 1, 1, 1, 1]), torch.tensor([0, 0, 1, 1])]
    old = [torch.arange(7, dtype=torch.float32) / -10, torch.arange(4, dtype=torch.float32) / -5]
    return TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old,
                      advantages=torch.tensor([1.0, -0.5]), prompt_ids=torch.tensor([0, 0]),
                      sample_ids=torch.tensor([1, 0]))


def test_split_of_a_packed_micro_batch_by_hand():
    # CP 2 pads to a multiple of 4: 6 positions -> 8, chunks of 2; rank 0: positions 0,1,6,7;
    # rank 1: positions 2,3,4,5.
    (mb,) = pack_micro_batches(_batch(), [0, 1], max_tokens=100, pad_to_multiple=4)
    assert mb.input_ids.tolist() == [[10, 11, 12, 13, 14, 15, 0, 0], [20, 21, 22, 0, 0, 0, 0, 0]]
    rank0 = split_for_context_parallel(mb, 0, 2)
    rank1 = split_for_context_parallel(mb, 1, 2)
    assert rank0.input_ids.tolist() == [[10, 11, 0, 0], [20, 21, 0, 0]]
    assert rank1.input_ids.tolist() == [[12, 13, 14, 15], [22, 0, 0, 0]]
    assert rank0.position_ids.tolist() == [[0, 1, 6, 7]] * 2  # global positions (RoPE's)
    assert rank1.position_ids.tolist() == [[2, 3, 4, 5]] * 2
    assert rank0.targets.tolist() == [[11, 12, 0, 0], [21, 22, 0, 0]]
    assert rank1.targets.tolist() == [[13, 14, 15, 16], [23, 0, 0, 0]]
    # loss_mask[1:] of completion 0 is [0, 1, 1, 1, 1, 1]; of completion 1 [0, 1, 1].
    assert rank0.loss_mask.tolist() == [[False, True, False, False], [False, True, False, False]]
    assert rank1.loss_mask.tolist() == [[True, True, True, True], [True, False, False, False]]
    assert rank0.padding_mask.tolist() == [[False, False, True, True], [False, False, True, True]]
    assert rank1.padding_mask.tolist() == [[False] * 4, [False, True, True, True]]
    assert rank1.old_logprobs[0].tolist() == pytest.approx([-0.3, -0.4, -0.5, -0.6])
    assert rank1.advantages.tolist() == [[1.0] * 4, [-0.5, 0.0, 0.0, 0.0]]
    assert rank0.sample_index.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    # Together the ranks hold every loss token and every real position exactly once.
    assert rank0.num_loss_tokens + rank1.num_loss_tokens == mb.num_loss_tokens == 7
    assert rank0.num_tokens + rank1.num_tokens == mb.num_tokens == 9
    assert split_for_context_parallel(mb, 0, 1) is mb


def test_split_keeps_routing_tables_and_padding_micro_batches():
    (mb,) = pack_micro_batches(_batch(), [0], max_tokens=100, pad_to_multiple=4)
    mb.routed_experts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1).expand(1, 8, 3)
    local = split_for_context_parallel(mb, 1, 2)
    assert local.routed_experts.shape == (1, 4, 3)
    assert local.routed_experts[0, :, 0].tolist() == [2, 3, 4, 5]
    assert local.routed_experts.dtype == torch.uint8
    pad = padding_micro_batch(4)  # the lock-step micro-batch: length 2 * CP, no loss
    assert [split_for_context_parallel(pad, r, 2).input_ids.shape for r in (0, 1)] == \
        [(1, 2), (1, 2)]
    assert split_for_context_parallel(pad, 1, 2).num_loss_tokens == 0
    with pytest.raises(ValueError, match="multiple of 2 \\* 2"):
        split_for_context_parallel(pack_micro_batches(_batch(), [0], max_tokens=100)[0], 0, 2)


def test_context_parallel_mask_is_causal_in_global_positions():
    from models.sdpa_attention import context_parallel_causal_mask

    # 8 positions over CP 2 (chunks of 2): rank 1 holds global 2, 3, 4, 5; the all-gathered
    # keys are rank 0's (0, 1, 6, 7) then rank 1's (2, 3, 4, 5).
    keys = [0, 1, 6, 7, 2, 3, 4, 5]
    masked = context_parallel_causal_mask(4, 1, 2)
    assert masked.tolist() == [[k > q for k in keys] for q in (2, 3, 4, 5)]
    assert context_parallel_causal_mask(4, 0, 2).tolist() == \
        [[k > q for k in keys] for q in (0, 1, 6, 7)]
    # Llama-4 chunks of 3 global positions: {0,1,2} {3,4,5} {6,7}.
    chunked = context_parallel_causal_mask(4, 1, 2, chunk_size=3)
    assert chunked.tolist() == [[k > q or k // 3 != q // 3 for k in keys] for q in (2, 3, 4, 5)]


def test_context_parallel_config_checks():
    from megatron_rl.trainer.model import check_context_parallel
    from megatron_rl.trainer.parallel import ParallelLayout

    cp = ParallelLayout(context_parallel_size=2)
    # The local spec's all-gather path and TE's CP attention are both allowed.
    check_context_parallel(cp, use_transformer_engine=False, environ={})
    check_context_parallel(cp, use_transformer_engine=True, cp_comm_type="a2a", environ={})
    with pytest.raises(ValueError, match="'p2p'.*local spec's all-gather"):
        check_context_parallel(cp, use_transformer_engine=False, cp_comm_type="p2p", environ={})
    with pytest.raises(ValueError, match="'ring'.*Transformer Engine"):
        check_context_parallel(cp, use_transformer_engine=True, cp_comm_type=["p2p", "ring"],
                               environ={})
    no_backend = {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"}
    with pytest.raises(ValueError, match="flash or fused attention"):
        check_context_parallel(cp, use_transformer_engine=True, environ=no_backend)
    check_context_parallel(ParallelLayout(), use_transformer_engine=True, environ=no_backend)


def test_llama4_chunked_layers_refuse_context_parallel_without_the_all_gather_path():
    from models.llama4.attention import Llama4CoreAttention
    from models.llama4.config import transformer_config

    class OtherBackend(torch.nn.Module):  # stands in for TEDotProductAttention (GPU only)
        def __init__(self, *_args, **_kwargs):
            super().__init__()

    config = transformer_config("tiny", context_parallel_size=2, use_cpu_initialization=True)
    assert config.is_rope_layer(1) and not config.is_rope_layer(4)
    with pytest.raises(NotImplementedError, match="chunked local attention .*SDPACoreAttention"):
        Llama4CoreAttention(config, 1, backend_attention=OtherBackend)
