"""Multi-rank SGLang CPU engines for test_sglang_tp_ep*.py (tensor- / expert-parallel generators).

One engine per layout, started once per test module (`engine_fixtures`), on the CPU settings that
SGLangServerSettings picks by itself for tp_size > 1: one core per rank
(SGLANG_CPU_OMP_THREADS_BIND "0|1") and a KV-cache bound per rank (max_total_tokens). Before each
test the engine is put back to its launch weights at version 0 (`reset`), so no test depends on
what an earlier one synced. `greedy_and_logprobs_vs_transformers` is the engine-layout check:
greedy completions and prompt log-probs against transformers on the same (launch) weights.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

PROMPTS = [[5, 17, 42, 99], [200, 4, 31], [2, 300, 45, 61, 19]]
MAX_NEW_TOKENS = 8


def launch_engine(directory: Path, save_model, *, dtype: str, tp_size: int, ep_size: int):
    """An SGLangGenerator of a freshly saved tiny model at the given layout, and its start-up
    seconds."""
    from megatron_rl.rollout import SGLangGenerator, SGLangServerSettings

    model_dir = directory / "model"
    save_model(model_dir)
    start = time.perf_counter()
    generator = SGLangGenerator.launch(SGLangServerSettings(
        model_path=str(model_dir), dtype=dtype, tp_size=tp_size, ep_size=ep_size,
        startup_timeout_s=600, request_timeout_s=240, log_path=str(directory / "server.log")))
    return generator, time.perf_counter() - start


def engine_fixtures(name: str, save_model, *, dtype: str, tp_size: int, ep_size: int):
    """(engine, fresh_engine) pytest fixtures for a test module: `engine` launches the layout
    once for the module (and shuts it down after), `fresh_engine` hands it to a test `reset`.
    Assign both at module level: `engine, fresh_engine = engine_fixtures(...)`."""
    @pytest.fixture(scope="module")
    def engine(tmp_path_factory):
        generator, _ = launch_engine(tmp_path_factory.mktemp(name), save_model, dtype=dtype,
                                     tp_size=tp_size, ep_size=ep_size)
        try:
            yield generator
        finally:
            generator.shutdown()

    @pytest.fixture
    def fresh_engine(engine):
        reset(engine)
        return engine

    return engine, fresh_engine


def reset(generator, timeout_s: float = 60.0) -> None:
    """Back to the launch weights, labelled version 0, nothing running, prefix cache flushed.
    An abort takes effect asynchronously (and right after launch the /health probe's one-token
    request may still be queued): SGLang then loads the weights but refuses the flush, so the
    reload is repeated until the engine is idle."""
    from megatron_rl.rollout import GeneratorError

    generator.resume()
    generator.abort()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            generator.update_weights_from_disk(generator.server.settings.model_path, version=0)
            return
        except GeneratorError as exc:
            if "not flushed" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def greedy_and_logprobs_vs_transformers(generator) -> dict:
    """Greedy completions of PROMPTS by the engine and by transformers (fp32) on the model
    folder's weights, and the max |log-prob difference| over the transformers completions."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(generator.server.settings.model_path,
                                                 dtype=torch.float32).eval()
    engine = generator.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW_TOKENS,
                                                        temperature=0.0, ignore_eos=True,
                                                        purpose="eval"))
    reference, max_diff = [], 0.0
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            reference.append(ids[0, len(prompt):].tolist())
        sequences = [p + r for p, r in zip(PROMPTS, reference)]
        for seq, scored in zip(sequences, generator.score(sequences)):
            logits = model(torch.tensor([seq])).logits[0, :-1].float()  # [len - 1, vocab]
            hf = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            max_diff = max(max_diff, float((hf - scored).abs().max()))
    return {"engine": [list(r.token_ids) for r in engine], "transformers": reference,
            "versions": sorted({v for r in engine for v in r.versions}),
            "max_logprob_diff": max_diff}


# The weight-sync tests' tolerance (test_sglang_weight_sync.py: both sides fp32, measured ~1e-6).
LOGPROB_TOLERANCE = 1e-4


def check_engine_layout(generator) -> dict:
    """Greedy tokens equal transformers', log-probs within LOGPROB_TOLERANCE, version 0."""
    got = greedy_and_logprobs_vs_transformers(generator)
    print(f"engine of {generator.num_ranks} ranks: greedy {got['engine']} (transformers "
          f"{got['transformers']}), max |logprob diff| vs transformers "
          f"{got['max_logprob_diff']:.3g}")
    assert got["engine"] == got["transformers"], got
    assert got["max_logprob_diff"] < LOGPROB_TOLERANCE, got
    assert got["versions"] == [0], got
    return got


def check_sync(result: dict, *, engine_ranks: list[int]) -> None:
    """The measurements of _tp_ep_sync_worker.py: every rank of every engine joined
    (`engine_ranks`, per engine); before any sync the engines serve other weights; after each
    sync their log-probs are the trainer's FP32 ones and every engine's version advanced; the train step between the syncs moved the trainer away first."""
    print(f"trainer {result['layout']} -> engine of {result['engine_ranks']} ranks: max |logprob "
          f"diff| stale {result['stale_max_diff']:.3g}, "
          + ", ".join(f"sync {s['version']} {s['max_diff']:.3g} ({s['total_buckets']} buckets, "
                      f"{s['total_bytes'] / 2**20:.2f} MiB, {s['seconds']:.2f} s)"
                      for s in result["syncs"])
          + f", before sync 2 {result['before_sync2_max_diff']:.3g}")
    assert result["engine_ranks"] == engine_ranks
    assert result["stale_max_diff"] > 0.1, result
    sync1, sync2 = result["syncs"]
    for version, sync in ((1, sync1), (2, sync2)):
        assert sync["version"] == version and sync["generator_version"] == [version], sync
        assert sync["server_version"] == [str(version)], sync
        assert sync["max_diff"] < LOGPROB_TOLERANCE, sync
        assert sync["total_buckets"] > 1, sync
    assert not result["step_skipped"]
    assert result["before_sync2_max_diff"] > 0.01, result
