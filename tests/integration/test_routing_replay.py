"""Routing replay end to end: the real SGLang CPU engine (bf16) returns each token's routed
experts, and the real Megatron trainer (FP32, identical weights) replays them.

Per family (tiny Qwen3-MoE: 4 experts, top-2, norm_topk_prob; tiny Llama-4: 4 experts, top-1
sigmoid with a shared expert), one bf16 server with --enable-return-routed-experts is started for
the module (platform/sglang_cpu.py fix 10 lets the CPU engine allocate the routed-experts buffer)
and one trainer launch (_routing_replay_worker.py) measures:
- the table SGLang returns: one row per position but the last, layers x top-k ids, uint8;
- without replay the trainer's own router picks other experts for some (token, layer) decisions
  (bf16 vs FP32 router logits), but for few of them: the generator's numbering of layers and
  experts is the trainer's (a permuted numbering would flip most decisions);
- with replay the trainer's log-probs match the generator's more closely (mean and max);
- with replay every router used exactly the generator's experts;
- a replayed RL step still moves the routers (gating weights are the trainer's own).
Measured values are in docs/routing_replay.md.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _workers import WorkerLaunch  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_moe", "llama4"])
def replay_result(request, tmp_path_factory) -> dict:
    """One bf16 server of the family with routed experts, and the trainer launch against it
    (started together: the trainer builds while the server starts). The KV pool is capped by
    max_total_tokens; mem_fraction_static only bounds SGLang's start-up memory check, which
    fails at 0.05 when other processes grow during the model load (shared CI machine)."""
    from _hf_families import save_tiny_llama4, save_tiny_qwen3_moe

    from megatron_rl.rollout import SGLangServer, SGLangServerSettings

    save = {"qwen3_moe": save_tiny_qwen3_moe, "llama4": save_tiny_llama4}[request.param]
    directory = tmp_path_factory.mktemp(f"routing_replay_{request.param}")
    server = SGLangServer.launch(SGLangServerSettings(
        model_path=str(save(directory / "model")), dtype="bfloat16", mem_fraction_static=0.2,
        max_total_tokens=4096, enable_return_routed_experts=True, startup_timeout_s=300,
        request_timeout_s=120, log_path=str(directory / "server.log")), wait=False)
    worker = WorkerLaunch("_routing_replay_worker.py", server.settings.model_path, server.url,
                          num_ranks=1, directory=directory)
    try:
        server.wait_until_healthy()
        result = worker.result(timeout_s=420)
    finally:
        worker.kill()
        server.shutdown()
    print(f"\n{request.param}: {result}")
    return result


def test_sglang_returns_a_compact_table_per_position(replay_result):
    table = replay_result["table"]
    assert table["dtype"] == "torch.uint8"
    assert table["shape"] == [table["rows_expected"], table["num_layers"] * table["top_k"]]
    assert table["max_id"] < table["num_experts"]
    assert table["bytes_per_token"] == table["num_layers"] * table["top_k"]


def test_flips_happen_without_replay_and_numbering_matches(replay_result):
    free = replay_result["without_replay"]
    assert free["num_decisions"] > 500
    assert free["num_flips"] > 0
    # Same layer and expert numbering on both sides: only near-ties flip.
    assert free["flip_fraction"] < 0.1


def test_replay_brings_trainer_log_probs_closer_to_the_generator(replay_result):
    free, replayed = replay_result["without_replay"], replay_result["with_replay"]
    assert replayed["num_loss_tokens"] == free["num_loss_tokens"]
    assert replayed["mean"] < free["mean"]
    assert replayed["max"] < free["max"]


def test_routers_used_exactly_the_generator_experts(replay_result):
    used = replay_result["experts_used"]
    assert used["checked"] > 1000
    assert used["mismatched"] == 0


def test_replayed_step_trains_the_routers(replay_result):
    step = replay_result["step"]
    assert not step["skipped"]
    assert step["flip_fraction"] > 0
    assert step["router_update"] > 1e-4


def test_the_step_reports_the_mismatch_with_and_without_replay(replay_result):
    """rollout.routing_replay_compare: the step scores its batch once more without replay,
    before the update: the same figure as the forward without replay above."""
    step, free = replay_result["step"], replay_result["without_replay"]
    assert step["logp_mismatch_without_replay"] == pytest.approx(free["mean"], rel=1e-6)
    assert step["logp_mismatch"] < step["logp_mismatch_without_replay"]
