"""The scale tier: the real control plane against 256 simulated engines (Scout's recipe at 16
NVL72 racks: 256 engines x 4 GB200, 128 trainer GPUs), engines in a child process
(SimulationSettings.engines_in_child_process) so that the driver holds one socket per request
in flight, as on a real cluster.

This is the scaled-down run (4,096 requests in flight, one step: about 10,000 served); the full one
(16,384 in flight, about 100,000 served) is benchmarks/simulated_256_engines.py, minutes of wall
time on 2 cores. 100,000 requests in flight at once cannot run on this machine at all: the real
client holds one socket per request in flight and the hard RLIMIT_NOFILE here is 20,000
(run_setup reserves the requests in flight + 1,024 before it starts, so at most 18,976).
No stand-in beyond the simulated cluster itself; no timing threshold: the wall time is printed.
"""
from __future__ import annotations

import time

import pytest

from megatron_rl.config import load_config
from megatron_rl.resilience.ledger import check_ledger, read_jsonl
from megatron_rl.scaling.cost import PRESETS

pytestmark = pytest.mark.integration

NUM_ENGINES, PROMPTS_PER_STEP, SAMPLES, K, STEPS = 256, 128, 16, 1, 1
IN_FLIGHT = (K + 1) * PROMPTS_PER_STEP * SAMPLES  # 4096: 16 per engine


def test_256_engines_serve_the_run_with_4096_requests_in_flight(tmp_path):
    from megatron_rl.simulation.cluster import SimulatedBackend, SimulationSettings
    from megatron_rl.simulation.simulate import simulate, stand_in_model

    model = stand_in_model(tmp_path / "model", context=4096)
    cfg = load_config("examples/llama4_scout/gb200_1rack.yaml", [
        f"output_dir={tmp_path / 'run'}", f"model.hf_checkpoint={model}",
        "data.prompts=rg/basic_arithmetic",
        f"data.num_generated_prompts={(STEPS + K + 1) * PROMPTS_PER_STEP + 200}",
        f"rollout.num_generators={NUM_ENGINES}", "parallelism.world_size=128",
        f"rollout.max_off_policyness={K}",
        f"train.global_batch_size={PROMPTS_PER_STEP * SAMPLES}", f"train.num_steps={STEPS}",
        # Token budgets in units of the granularity below (64 model tokens each); every
        # thinking segment reaches its budget, so every sample is two requests.
        "rollout.max_prompt_tokens=256", "rollout.thinking_budget=8",
        "rollout.thinking_budget_min=6", "rollout.solution_budget=4",
        "train.micro_batch_max_tokens=512", "eval.interval_steps=0", "eval.at_step_zero=false",
        "eval.num_heldout_prompts=8", "algorithm.zero_variance_filter=false",
        "logging.progress_bar=false", "rollout.no_progress_timeout_s=900"])
    backend = SimulatedBackend(SimulationSettings(
        hardware="GB200", model=PRESETS["scout-gb200"],
        max_running_requests=IN_FLIGHT // NUM_ENGINES, token_granularity=64,
        median_tokens=200, sigma=0.0, time_scale=200.0, engines_in_child_process=True))
    started = time.perf_counter()
    status, report = simulate(cfg, backend)
    wall = time.perf_counter() - started
    assert status == 0
    cluster = backend.cluster
    engines = cluster.generators.engines
    assert len(engines) == NUM_ENGINES and not cluster.generators.retired
    assert not cluster.engine_host.process.is_alive()  # the child is gone with the run
    stats = [engine.stats for engine in engines]
    # Every engine served its groups: groups go to engine group_id % 256, each of the
    # (STEPS + K) x 256 groups started is 16 thinking requests, each trained sample two.
    trained = STEPS * PROMPTS_PER_STEP * SAMPLES
    served = sum(len(s.admission_order) for s in stats)
    assert all(len(s.admission_order) >= 2 * SAMPLES for s in stats)
    assert served >= 2 * trained
    assert sum(s.priority_admissions for s in stats) >= trained  # one continuation each
    assert cluster.trainers.pushed == {e.url: STEPS for e in engines}
    records = read_jsonl(tmp_path / "run" / "ledger.jsonl")
    assert check_ledger(records) == {"lost": [], "duplicated": []}
    assert [len(r["trained"]) for r in records if "step" in r] == [PROMPTS_PER_STEP] * STEPS
    print(f"256 engines, {IN_FLIGHT} requests in flight, {served} served: {wall:.0f} s wall; "
          f"smallest engine max batch {min(s.max_batch for s in stats)}; {report['overall']}")
