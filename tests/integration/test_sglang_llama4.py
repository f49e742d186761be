"""Llama-4 through the real SGLang CPU engine, synced from a 2-rank Megatron trainer.

A tiny random Llama-4 (the llama4 family's "tiny" size: chunked attention, NoPE layer with
temperature tuning, q/k L2 norm, llama3 RoPE, top-1 MoE with a shared expert; bf16 on disk, in the
Llama4ForConditionalGeneration layout SGLang loads Llama-4 from) is served by SGLang in bf16,
started once for this module. A torchrun subprocess (_llama4_sync_worker.py) builds the llama4
family's Megatron model in bf16 at TP2 + SP x EP2 (ETP1) and syncs it into the server with
WeightSync (bf16 buckets over gloo).

References and tolerances. Trainer and generator hold the same bf16 weights (syncing bf16
parameters to a bf16 generator is lossless) and both compute in bf16 with an FP32 head, so what
separates their log-probs is bf16 activation rounding in two different implementations. The
yardstick is transformers computing in FP32 on the synced bf16 weights, i.e. the exact function of
those weights. Measured max |diff| per token over 37 scored tokens (chunked sequences up to 20
tokens), on the earlier CI machine / on a 2-core AMD EPYC:
  after sync 1: generator vs trainer 0.016 / 0.022, generator vs transformers 0.015 / 0.015,
                trainer vs transformers 0.024 / 0.018;
  after sync 2: generator vs trainer 0.014 / 0.061, generator vs transformers - / 0.013,
                trainer vs transformers - / 0.070;
stale (unsynced) weights 2.9 nats, the train step moved the trainer by 2.3-2.4. The EPYC's
0.061 / 0.070 after sync 2 is one token (the fourth of the 20-token sequence; every other token
is within 0.021) where the trainer's bf16 flipped a top-1 router near-tie: after the step, layer
1's router logits there are 0.0505 vs 0.0482 for two experts (gap 0.0023; bf16 activations move
that gap by ~0.01: transformers in bf16 reads 0.013), and forcing transformers' FP32 run onto the
runner-up expert moves that token by 0.065. A flipped expert choice is a discrete jump that a
bf16 implementation may or may not take on a given CPU's kernels, not a sync fault (the generator
stays within 0.013 of the FP32 function of the weights sync 2 sent). LOGPROB_TOLERANCE = 0.15 is
2x the largest measured gap (one such flip) and 15x below the stale / moved differences the test
also asserts.
Greedy tokens (12 per prompt, decode crossing chunk boundaries): bf16 may flip a near-tie, so the
checks are (1) teacher forcing: every token SGLang chose is transformers' FP32 argmax given the
same prefix, or within GREEDY_LOGIT_BAND = 0.05 of it (measured: all 36 are the argmax); (2) the
free-running completions equal transformers' own greedy decoding up to its first near-tie (top-1 /
top-2 logit gap <= the band; measured: 6 of 36 steps are near-ties, smallest gap 0.007, and the
completions are equal in full); (3) most steps are decided by more than the band (not vacuous).

SGLang 0.5.23's CPU path needs three Llama-4 fixes, applied by megatron_rl/platform/sglang_cpu.py
in every server process: top-1 router weight on the expert input (native MoE), RoPE written back
in place (without it no layer rotates q/k on CPU), chunked local attention in the torch_native
backend; and the server must run with --disable-hybrid-swa-memory (torch_native cannot read
SGLang's separate sliding-window KV pool).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _workers import WorkerLaunch  # noqa: E402

LOGPROB_TOLERANCE = 0.15
GREEDY_LOGIT_BAND = 0.05


@pytest.fixture(scope="module")
def sync_result(tmp_path_factory) -> dict:
    """Serve the tiny Llama-4 and run the trainer launch against it; the worker's measurements.
    The server starts while the trainer builds its model (its rank 0 waits for /health): the
    two start-ups overlap instead of adding up."""
    from _hf_families import save_tiny_llama4

    from megatron_rl.rollout import SGLangServer, SGLangServerSettings

    directory = tmp_path_factory.mktemp("tiny_llama4")
    server = SGLangServer.launch(SGLangServerSettings(
        model_path=str(save_tiny_llama4(directory / "model")), dtype="bfloat16",
        mem_fraction_static=0.05, max_total_tokens=8192, startup_timeout_s=240,
        request_timeout_s=120, log_path=str(directory / "server.log")), wait=False)
    worker = WorkerLaunch("_llama4_sync_worker.py", server.settings.model_path, server.url,
                          num_ranks=2, directory=directory)
    try:
        server.wait_until_healthy()  # fails early, with the server's log, if it cannot start
        return worker.result(timeout_s=400)
    finally:
        worker.kill()  # its own process group: torchrun and both ranks
        server.shutdown()


def test_generator_serves_the_trainer_log_probs_after_sync(sync_result):
    r = sync_result
    # Before any sync the generator serves its own (different) random weights.
    assert r["stale_max_diff"] > 10 * LOGPROB_TOLERANCE
    assert r["sync1"]["version"] == 1 and r["sync1"]["num_buckets"] > 1
    assert r["hf_dtypes"] == ["torch.bfloat16"]
    assert r["generator_version_1"] == 1 and r["server_version_1"] == "1"
    assert r["synced_max_diff"] < LOGPROB_TOLERANCE
    # Both bf16 implementations are as close to the FP32 function of the same weights.
    assert r["generator_vs_transformers"] < LOGPROB_TOLERANCE
    assert r["trainer_vs_transformers"] < LOGPROB_TOLERANCE


def test_greedy_tokens_equal_transformers(sync_result):
    r = sync_result
    # Teacher forcing: each token the generator picked greedily is transformers' argmax given
    # the same prefix, or within bf16 noise of it (a near-tie either could win).
    gaps = [gap for steps in r["generator_steps"] for gap in steps["chosen_gap"]]
    assert max(gaps) <= GREEDY_LOGIT_BAND
    # Free running: the completions equal transformers' own greedy decoding up to its first
    # near-tie (the whole completion when there is none).
    for generated, reference, steps in zip(r["greedy_generator"], r["greedy_transformers"],
                                           r["transformers_steps"]):
        near_ties = [t for t, margin in enumerate(steps["margin"]) if margin <= GREEDY_LOGIT_BAND]
        agree_until = near_ties[0] if near_ties else len(reference)
        assert generated[:agree_until] == reference[:agree_until]
    # Not vacuous: most steps are decided by far more than the band.
    margins = [m for steps in r["transformers_steps"] for m in steps["margin"]]
    assert sum(m > GREEDY_LOGIT_BAND for m in margins) >= 0.8 * len(margins)
    assert all(v == 1 for versions in r["greedy_versions"] for v in versions)


def test_second_sync_after_a_train_step_moves_the_generator(sync_result):
    r = sync_result
    assert not r["step_skipped"]
    assert r["trainer_moved"] > 10 * LOGPROB_TOLERANCE
    assert r["before_sync2_max_diff"] > 10 * LOGPROB_TOLERANCE
    assert r["sync2_version"] == 2
    assert r["generator_version_2"] == 2 and r["server_version_2"] == "2"
    assert r["synced2_max_diff"] < LOGPROB_TOLERANCE
    # Both sides against the FP32 function of the weights sync 2 sent (a sync fault shows here
    # on the generator's side, a bf16 router near-tie on either).
    assert r["generator_vs_transformers_2"] < LOGPROB_TOLERANCE
    assert r["trainer_vs_transformers_2"] < LOGPROB_TOLERANCE
