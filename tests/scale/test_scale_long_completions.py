"""The scale tier: 32k-token completions (the Scout recipe's 32,768-token thinking budget with
forced interruption) while the trainer pushes new weights in flight, three optimizer steps.

What it shows, on the run's own outputs (the groups each step trained on, as the driver hands
them to write_rollout_samples): every sampled token's version label is the version its engine
held at the decode step that produced it, reconstructed independently from the engine's record
of when it took each update (EngineStats.version_steps) and when each request's running
segments began (EngineStats.requests); some completions span an update mid-request; and every
token's staleness at the step that trained it, (step - 1) - version, lies in [0, k].

No stand-in beyond the simulated cluster itself (engines and trainer timing); everything above
the seam is the code `megatron-rl train` runs.
"""
from __future__ import annotations

import bisect
import time

import pytest

from megatron_rl.config import load_config
from megatron_rl.resilience.ledger import check_ledger, read_jsonl
from megatron_rl.scaling.cost import PRESETS

pytestmark = pytest.mark.integration

GRANULARITY = 64  # model tokens per returned token
THINKING = 32768 // GRANULARITY  # the recipe's 32k thinking budget: 512 returned tokens
THINKING_MIN = 27648 // GRANULARITY
SOLUTION = 2048 // GRANULARITY
K, STEPS, NUM_ENGINES = 2, 3, 4


def expected_versions(starts, version_steps, first_token: int, num_tokens: int) -> list[int]:
    """The version of output tokens first_token .. first_token + num_tokens - 1 of a request
    whose running segments began at `starts` [(token, engine step)]: token i was decoded at
    engine step s0 + i - t0 (its segment's start (t0, s0)), under the last version the engine
    took at or before that step (version_steps [(step, version)]; 0 before the first)."""
    steps = [s for s, _ in version_steps]
    firsts = [t for t, _ in starts]
    versions = []
    for token in range(first_token, first_token + num_tokens):
        t0, s0 = starts[bisect.bisect_right(firsts, token) - 1]
        at = bisect.bisect_right(steps, s0 + token - t0) - 1
        versions.append(version_steps[at][1] if at >= 0 else 0)
    return versions


def test_32k_token_completions_carry_exact_versions_across_in_flight_updates(tmp_path,
                                                                             monkeypatch):
    import megatron_rl.metrics as run_metrics
    from megatron_rl.simulation.cluster import SimulatedBackend, SimulationSettings
    from megatron_rl.simulation.simulate import simulate, stand_in_model

    trained: list[tuple[int, list]] = []  # (step, the groups it trained on)
    write = run_metrics.write_rollout_samples

    def keep(path, step, groups, rewards):
        trained.append((step, list(groups)))
        write(path, step, groups, rewards)

    monkeypatch.setattr(run_metrics, "write_rollout_samples", keep)
    model = stand_in_model(tmp_path / "model", context=40960)
    cfg = load_config("examples/llama4_scout/gb200_1rack.yaml", [
        f"output_dir={tmp_path / 'run'}", f"model.hf_checkpoint={model}",
        "data.prompts=rg/basic_arithmetic", "data.num_generated_prompts=200",
        f"rollout.num_generators={NUM_ENGINES}", f"rollout.max_off_policyness={K}",
        "train.global_batch_size=32", f"train.num_steps={STEPS}",
        # Token budgets in units of the granularity (64 model tokens each): 32,768 thinking
        # tokens (forced interruption at a budget drawn in [27,648, 32,768]), 2,048 solution.
        "rollout.max_prompt_tokens=128", f"rollout.thinking_budget={THINKING}",
        f"rollout.thinking_budget_min={THINKING_MIN}", f"rollout.solution_budget={SOLUTION}",
        "train.micro_batch_max_tokens=768", "eval.interval_steps=0", "eval.at_step_zero=false",
        "eval.num_heldout_prompts=8", "algorithm.zero_variance_filter=false",
        "logging.progress_bar=false", "logging.rollout_samples=true"])
    backend = SimulatedBackend(SimulationSettings(
        hardware="GB200", model=PRESETS["scout-gb200"], token_granularity=GRANULARITY,
        median_tokens=4 * THINKING, sigma=0.0, time_scale=50.0, record_requests=True))
    started = time.perf_counter()
    status, _ = simulate(cfg, backend)
    wall = time.perf_counter() - started
    assert status == 0
    engines = backend.cluster.generators.engines
    assert not backend.cluster.generators.retired
    records = read_jsonl(tmp_path / "run" / "ledger.jsonl")
    assert check_ledger(records) == {"lost": [], "duplicated": []}
    assert [step for step, _ in trained] == list(range(1, STEPS + 1))
    # Every engine took versions 1 .. STEPS, in order, once each.
    for engine in engines:
        assert [v for _, v in engine.stats.version_steps] == list(range(1, STEPS + 1))

    requests = {}  # (input tokens, first 16 output ids) -> (engine, segment starts)
    for engine in engines:
        for key, starts in engine.stats.requests.items():
            assert key not in requests, "two requests with the same key: the check is ambiguous"
            requests[key] = (engine, starts)
    tokens = spanning = 0
    for step, groups in trained:
        for sample in (s for g in groups for s in g.samples):
            assert len(sample.token_ids) > THINKING_MIN  # a 32k-token completion (x 64)
            bounds = list(sample.segment_offsets) + [len(sample.token_ids)]
            for start, end in zip(bounds, bounds[1:]):
                if not sample.loss_mask[start]:  # the interruption phrase: no policy sampled it
                    assert set(sample.versions[start:end]) == {-1}
                    continue
                key = (len(sample.prompt_token_ids) + start,
                       tuple(sample.token_ids[start:start + 16]))
                engine, starts = requests[key]
                labels = list(sample.versions[start:end])
                assert labels == expected_versions(starts, engine.stats.version_steps, 0,
                                                   end - start), (step, sample.group_id)
                spanning += len(set(labels)) > 1
                tokens += end - start
            lags = [(step - 1) - v for v in sample.sampled_versions]
            assert 0 <= min(lags) and max(lags) <= K, (step, sample.group_id, lags)
    assert spanning > 0  # some request's tokens span an in-flight update
    print(f"32k-token completions, {STEPS} steps, k = {K}: {tokens} sampled tokens checked, "
          f"{spanning} requests spanning an update; {wall:.0f} s wall")
