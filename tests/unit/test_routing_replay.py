"""Routing replay pieces that need neither a server nor a distributed trainer: the compact table
(SGLang's base64 payload -> uint8/uint16), its assembly over a sample's requests, its travel
through TrainBatch and micro-batch packing, the per-router installation (sequence-parallel slice,
pipeline layers, padding dummies, validation errors naming the layer) and megatron-core's
RouterReplay subclass (replay, flip count, recompute in backward). End to end with the real
engine and trainer: tests/integration/test_routing_replay.py; layouts: tests/dist/."""
import base64
import dataclasses
import math
import types

import numpy as np
import pytest
import torch

from megatron_rl.rollout import GeneratorError
from megatron_rl.rollout import sglang_server
from megatron_rl.rollout.samples import Segment, assemble_sample
from megatron_rl.rollout.types import (GenerationResult, compact_expert_ids,
                                       decode_routed_experts)
from megatron_rl.trainer import TrainBatch, pack_micro_batches, shard_for_data_parallel

pytestmark = pytest.mark.unit
URL = "http://127.0.0.1:30000"


def _encoded(ids) -> str:
    return base64.b64encode(np.asarray(ids, dtype=np.int32).tobytes()).decode()


def test_compact_ids_use_one_byte_up_to_256_experts_and_two_beyond():
    assert compact_expert_ids([[0, 255]]).dtype == torch.uint8
    wide = compact_expert_ids([[0, 256], [3, 65535]])
    assert wide.dtype == torch.uint16 and wide.long().tolist() == [[0, 256], [3, 65535]]
    with pytest.raises(ValueError, match="expert ids must be in"):
        compact_expert_ids([[-1, 2]])


def test_sglang_payload_decodes_to_one_row_per_position():
    # 2 prompt + 3 output tokens: 4 positions x (2 layers x top-2).
    ids = np.arange(16).reshape(4, 2, 2) % 4
    table = decode_routed_experts(_encoded(ids), 4, "x")
    assert table.dtype == torch.uint8 and table.shape == (4, 4)
    assert table.long().reshape(4, 2, 2).tolist() == ids.tolist()
    with pytest.raises(ValueError, match="do not split into 5 positions"):
        decode_routed_experts(_encoded(ids), 5, "x")


def test_generation_result_carries_routed_experts_and_refuses_their_absence():
    out = {"output_ids": [7, 8, 9], "meta_info": {
        "finish_reason": {"type": "stop"},
        "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None], [-2.0, 9, None]],
        "weight_versions": [{"version": "0", "start": 0, "end": 3}],
        "routed_experts": _encoded(np.zeros((4, 1, 2)) + [0, 1])}}
    result = sglang_server._generation_result(out, [1, 2], 0, 0, URL, routed_experts=True)
    assert result.routed_experts.shape == (4, 2)
    del out["meta_info"]["routed_experts"]
    assert sglang_server._generation_result(out, [1, 2], 0, 0, URL).routed_experts is None
    with pytest.raises(GeneratorError, match="enable-return-routed-experts"):
        sglang_server._generation_result(out, [1, 2], 0, 0, URL, routed_experts=True)
    with pytest.raises(ValueError, match="one row per position"):
        GenerationResult(prompt_index=0, sample_index=0, prompt_token_ids=(1, 2),
                         token_ids=(3,), logprobs=(0.0,), versions=(0,), finish_reason="stop",
                         routed_experts=torch.zeros(3, 2, dtype=torch.uint8))


def test_server_flag_and_request_field(tmp_path):
    from megatron_rl.config import RolloutConfig

    rollout = RolloutConfig(thinking_budget_min=10, thinking_budget=20)
    assert rollout.routing_replay  # on by default; only MoE models act on it
    dense = SGLangServerSettings_for(tmp_path / "dense", {"num_hidden_layers": 2}, rollout)
    moe = SGLangServerSettings_for(tmp_path / "moe", {"text_config": {"num_local_experts": 4}},
                                   rollout)
    assert "--enable-return-routed-experts" not in dense.server_args(port=1)
    assert "--enable-return-routed-experts" in moe.server_args(port=1)
    off = SGLangServerSettings_for(tmp_path / "off", {"num_experts": 4},
                                   dataclasses.replace(rollout, routing_replay=False))
    assert not off.enable_return_routed_experts


def SGLangServerSettings_for(directory, config: dict, rollout):
    import json

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return sglang_server.SGLangServerSettings.from_rollout_config(rollout, str(directory),
                                                                  device="cpu")


def _rows(first: int, count: int, width: int = 2) -> torch.Tensor:
    """Rows whose values name the request (first) and position, for tracing where rows went."""
    return compact_expert_ids(torch.full((count, width), first)
                              + torch.arange(count).unsqueeze(1) * 0)


def test_sample_keeps_each_request_rows_for_the_tokens_it_sampled():
    prompt = (1, 2, 3)
    first = Segment(token_ids=(4, 5), logprobs=(0.0, 0.0), versions=(0, 0),
                    routed_experts=_rows(1, 3 + 2 - 1))
    phrase = Segment(token_ids=(6, 7), sampled=False)
    # The answer request's input is prompt + first + phrase (7 tokens), output 2 tokens.
    answer = Segment(token_ids=(8, 9), logprobs=(0.0, 0.0), versions=(1, 1),
                     routed_experts=_rows(2, 7 + 2 - 1))
    sample = assemble_sample(group_id=0, sample_index=0, prompt_token_ids=prompt,
                             segments=[first, phrase, answer], finish_reason="stop")
    table = sample.routed_experts[:, 0].tolist()
    assert len(table) == 3 + 6 - 1
    # Positions 0..3 (prompt, and token 4 predicting 5) from the first request; from the last
    # token the first request sampled on (the phrase it never saw, then the answer) the second's.
    assert table == [1, 1, 1, 1, 2, 2, 2, 2]
    # An inserted tail (no later request) repeats the last row: it precedes no sampled token.
    tail = assemble_sample(group_id=0, sample_index=0, prompt_token_ids=prompt,
                           segments=[first, phrase], finish_reason="length")
    assert tail.routed_experts[:, 0].tolist() == [1, 1, 1, 1, 1, 1]
    plain = Segment(token_ids=(4,), logprobs=(0.0,), versions=(0,))
    assert assemble_sample(group_id=0, sample_index=0, prompt_token_ids=prompt,
                           segments=[plain], finish_reason="stop").routed_experts is None
    with pytest.raises(ValueError, match="every request"):
        assemble_sample(group_id=0, sample_index=0, prompt_token_ids=prompt,
                        segments=[first, plain], finish_reason="stop")


def _batch(lengths=(5, 3, 7, 4), width=4, seed=0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 50, (n,), generator=gen) for n in lengths]
    # Distinct top-2 of 4 experts per position and layer (width = layers x 2).
    tables = [compact_expert_ids(torch.rand(n - 1, width // 2, 4, generator=gen).argsort(-1)
                                 [..., :2].reshape(n - 1, width)) for n in lengths]
    return TrainBatch(token_ids=ids, loss_mask=[torch.tensor([0] + [1] * (n - 1)) for n in lengths],
                      old_logprobs=[torch.zeros(n) for n in lengths],
                      advantages=torch.ones(len(lengths)), prompt_ids=torch.zeros(len(lengths)),
                      sample_ids=torch.arange(len(lengths)), routed_experts=tables)


def test_tables_travel_with_their_tokens_through_sharding_and_packing():
    batch = _batch()
    for dp_rank in range(2):
        indices = shard_for_data_parallel(batch, dp_rank, 2)
        for mb in pack_micro_batches(batch, indices, max_tokens=16, pad_to_multiple=4):
            assert mb.routed_experts.shape == (*mb.input_ids.shape, 4)
            assert mb.routed_experts.dtype == torch.uint8  # compact until installed
            for row in range(mb.input_ids.shape[0]):
                sample = int(mb.sample_index[row, 0])
                n = batch.token_ids[sample].numel() - 1
                assert torch.equal(mb.input_ids[row, :n], batch.token_ids[sample][:-1])
                assert torch.equal(mb.routed_experts[row, :n], batch.routed_experts[sample])
                assert not mb.routed_experts[row, n:].any()  # padding: zeros here


def test_batch_refuses_tables_of_the_wrong_shape_or_a_partial_set():
    batch = _batch()
    with pytest.raises(ValueError, match="one row per input position"):
        dataclasses.replace(batch, routed_experts=[t[1:] for t in batch.routed_experts])
    samples = [types.SimpleNamespace(prompt_token_ids=(1, 2), token_ids=(3,), loss_mask=(1,),
                                     logprobs=(0.0,), routed_experts=r)
               for r in (torch.zeros(2, 2, dtype=torch.uint8), None)]
    with pytest.raises(ValueError, match="1 of 2 samples carry routed experts"):
        TrainBatch.from_groups([samples], [[1.0, -1.0]])
    assert TrainBatch.from_groups([samples[:1]], [[1.0]]).routed_experts[0].shape == (2, 2)


@pytest.fixture(scope="module")
def replay_class():
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    from megatron_rl.trainer.routing_replay import _make_replay_class

    return _make_replay_class()


def _replay(replay_class, *, layers=(1, 2), num_layers=2, top_k=2, tp=(0, 1), sp=False):
    """A RoutingReplay over stand-in routers (only layer_number and router_replay are used)."""
    from megatron_rl.trainer.routing_replay import RoutingReplay

    replay = RoutingReplay.__new__(RoutingReplay)
    replay.num_layers, replay.top_k, replay.num_experts = num_layers, top_k, 4
    replay.tp_rank, replay.tp_size = tp
    replay.sequence_parallel = sp
    replay.routers = [types.SimpleNamespace(layer_number=n, router_replay=replay_class(n - 1))
                      for n in layers]
    return replay


def test_installation_slices_positions_and_layers_and_pads_with_dummies(replay_class):
    batch = _batch(lengths=(5, 3), width=2 * 2)
    (mb,) = pack_micro_batches(batch, [0, 1], max_tokens=64, pad_to_multiple=2)
    b, s = mb.input_ids.shape  # [2, 4]
    # Pipeline stage 2 of 2 holds layer 2 only; sequence parallel rank 1 of 2 the second half.
    replay = _replay(replay_class, layers=(2,), tp=(1, 2), sp=True)
    replay.install(mb, "replay")
    router = replay.routers[0].router_replay
    table = mb.routed_experts.long().reshape(b, s, 2, 2)
    want = table[:, s // 2:, 1].transpose(0, 1).reshape(-1, 2)  # [s/2 * b, k], s-major
    valid = (~mb.padding_mask)[:, s // 2:].transpose(0, 1).reshape(-1)
    assert torch.equal(router.target_topk_idx[valid], want[valid])
    assert router.target_topk_idx[~valid].tolist() == [[0, 1]] * int((~valid).sum())
    assert torch.equal(router.valid, valid)
    replay.clear()
    assert router.target_topk_idx is None and router.replay_backward_list == []


def test_installation_errors_name_the_layer(replay_class):
    batch = _batch(lengths=(5, 3), width=4)
    (mb,) = pack_micro_batches(batch, [0, 1], max_tokens=64)
    with pytest.raises(ValueError, match="2 layers x top-1"):
        _replay(replay_class, top_k=1).install(mb, "replay")
    bad = mb.routed_experts.clone()
    bad[0, 1, 2] = 9  # layer 1, first of its top-2
    with pytest.raises(ValueError, match=r"layer 1: expert ids in \[0, 9\].*4 experts"):
        _replay(replay_class).install(dataclasses.replace(mb, routed_experts=bad), "replay")
    twice = mb.routed_experts.clone()
    twice[0, 0, :2] = 3
    with pytest.raises(ValueError, match="layer 0: a token lists the same expert twice"):
        _replay(replay_class).install(dataclasses.replace(mb, routed_experts=twice), "replay")


def test_router_replay_uses_the_table_counts_flips_and_recomputes_in_backward(replay_class):
    router = replay_class(0)
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.6, 0.1, 0.2, 0.1], [0.0, 0.0, 0.1, 0.9]],
                          requires_grad=True)

    def default(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k=k, dim=1)

    target = torch.tensor([[1, 2], [3, 1], [0, 1]])  # token 0 agrees with its own top-2
    router.install(target, torch.tensor([True, True, False]), "replay")
    probs, used = router.get_replay_topk(scores, 2, None, None, default)
    assert torch.equal(used, target)
    assert torch.equal(probs, scores.gather(1, target))  # the trainer's own gating weights
    assert (router.num_flips, router.num_decisions) == (1, 2)  # padding token not counted
    # A recompute inside backward (activation checkpointing) replays the same indices.
    seen = []

    def recompute(grad):
        seen.append(router.get_replay_topk(scores.detach(), 2, None, None, default)[1])
        return grad

    probs.register_hook(recompute)
    probs.sum().backward()
    assert torch.equal(seen[0], target) and scores.grad is not None
    router.clear()
    router.install(target, torch.ones(3, dtype=torch.bool), "observe")
    _, own = router.get_replay_topk(scores, 2, None, None, default)
    assert torch.equal(own, default(scores, 2)[1])  # observe: own routing, flips counted
    assert router.num_decisions == 5
    router.clear()
    assert torch.equal(router.get_replay_topk(scores, 2, None, None, default)[1], own)


def test_flip_fraction_of_no_decisions_is_nan():
    from megatron_rl.trainer.routing_replay import FlipCount

    assert math.isnan(FlipCount(0, 0).fraction) and FlipCount(1, 4).fraction == 0.25
