"""The scale tier: the real control plane (megatron_rl/train.py's driver, the rollout manager and
its admission gate, the async client, forced interruption and continuations, GeneratorHealth,
the weight push, the run checkpoint, the ledger) at production size against the simulated
cluster (megatron_rl/simulation/cluster.py, chosen through cluster/backend.py's seam).

No stand-in here beyond the simulated cluster itself: the engines are aiohttp servers speaking
SGLang's HTTP API with modelled timing (simulation/engine.py), the trainer group sleeps modelled
durations; everything above the seam is the code `megatron-rl train` runs.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from megatron_rl.config import load_config
from megatron_rl.resilience.ledger import check_ledger, read_jsonl
from megatron_rl.scaling.cost import PRESETS

pytestmark = pytest.mark.integration

NUM_ENGINES = 64
MAX_RUNNING = 104  # > 100: the client used to cap every engine at 100 requests
# Scout's recipe at 64 prompts x 16 samples per step and k = 6: (6 + 1) x 64 groups in flight, a
# group's 16 samples on engine group_id % 64, so 7 x 16 = 112 requests per engine.
PROMPTS_PER_STEP, SAMPLES, K = 64, 16, 6


def hold_until_full(cluster, *, deadline_s: float = 600.0) -> threading.Thread:
    """Pause every engine (SGLang's /pause_generation: arrivals queue, nothing is admitted)
    until all of its 112 thinking requests have arrived, then continue it
    (/continue_generation): it admits max_running_requests of them at once. Without the hold
    the test would depend on wall time: one process sends the 7168 requests over tens of
    seconds (more on a busy machine), and an engine at a small batch finishes its first
    requests before its last arrive. Reaching the limit still shows only what the control plane
    delivered: more than max_running_requests requests in flight to every engine at once."""
    import aiohttp

    engines = cluster.generators.engines
    per_engine = (K + 1) * SAMPLES

    async def post(index, path, body):
        async with aiohttp.ClientSession(headers={
                "Authorization": f"Bearer {cluster.api_key}"}) as session:
            async with session.post(f"{engines[index].url}{path}", json=body) as response:
                assert response.status == 200, await response.text()

    async def everywhere(indices, path, body):
        await asyncio.gather(*(post(i, path, body) for i in indices))

    cluster.loop.call(everywhere(range(len(engines)), "/pause_generation", {"mode": "in_place"}))

    def watch():
        end = time.monotonic() + deadline_s
        waiting = set(range(len(engines)))
        while waiting and time.monotonic() < end:
            full = {i for i in waiting if engines[i].num_queued >= per_engine}
            if full:
                cluster.loop.call(everywhere(full, "/continue_generation", {}))
                waiting -= full
            time.sleep(0.2)
        cluster.loop.call(everywhere(waiting, "/continue_generation", {}))

    watcher = threading.Thread(target=watch, name="hold-until-full", daemon=True)
    watcher.start()
    return watcher


def test_64_engines_each_reach_max_running_requests_under_the_scout_recipe(tmp_path):
    """The Scout GB200 recipe on four racks' worth of engines (64 engines x 4 GPUs, 32 trainer
    GPUs), one optimizer step: every engine is sent more than 100 requests at once and decodes
    max_running_requests of them together, the step trains and pushes version 1 to all 64, and
    the ledger accounts for every group exactly once."""
    from megatron_rl.simulation.cluster import SimulatedBackend, SimulationSettings
    from megatron_rl.simulation.simulate import simulate, stand_in_model

    in_flight = (K + 1) * PROMPTS_PER_STEP * SAMPLES
    assert in_flight / NUM_ENGINES > 100 and in_flight % NUM_ENGINES == 0
    model = stand_in_model(tmp_path / "model", context=4096)
    cfg = load_config("examples/llama4_scout/gb200_1rack.yaml", [
        f"output_dir={tmp_path / 'run'}", f"model.hf_checkpoint={model}",
        "data.prompts=rg/basic_arithmetic", "data.num_generated_prompts=600",
        f"rollout.num_generators={NUM_ENGINES}", "parallelism.world_size=32",
        f"rollout.max_off_policyness={K}",
        f"train.global_batch_size={PROMPTS_PER_STEP * SAMPLES}", "train.num_steps=1",
        # Token budgets in units of the granularity below (64 model tokens each).
        "rollout.max_prompt_tokens=256", "rollout.thinking_budget=24",
        "rollout.thinking_budget_min=16", "rollout.solution_budget=40",
        "train.micro_batch_max_tokens=512", "eval.interval_steps=0", "eval.at_step_zero=false",
        "eval.num_heldout_prompts=8",
        "algorithm.zero_variance_filter=false", "logging.progress_bar=false",
        "rollout.no_progress_timeout_s=900"])  # held engines answer nothing meanwhile
    backend = SimulatedBackend(SimulationSettings(
        hardware="GB200", model=PRESETS["scout-gb200"], max_running_requests=MAX_RUNNING,
        token_granularity=64, median_tokens=200, sigma=0.0, time_scale=20.0),
        on_start=hold_until_full)
    started = time.perf_counter()
    status, report = simulate(cfg, backend)
    wall = time.perf_counter() - started
    assert status == 0
    cluster = backend.cluster
    batches = [engine.stats.max_batch for engine in cluster.generators.engines]
    assert len(batches) == NUM_ENGINES and not cluster.generators.retired  # none restarted
    assert batches == [MAX_RUNNING] * NUM_ENGINES, batches
    # Each engine was sent its 7 groups' thinking requests (more than it runs at once).
    admitted = [len(set(engine.stats.admission_order)) for engine in cluster.generators.engines]
    assert min(admitted) >= (K + 1) * SAMPLES, admitted
    # Version 1 reached every engine (the push over their HTTP API, in flight).
    assert cluster.trainers.pushed == {e.url: 1 for e in cluster.generators.engines}
    records = read_jsonl(tmp_path / "run" / "ledger.jsonl")
    assert check_ledger(records) == {"lost": [], "duplicated": []}
    [step] = [r for r in records if "step" in r]
    assert len(step["trained"]) == PROMPTS_PER_STEP
    assert records[-1]["next_group_id"] >= (K + 1) * PROMPTS_PER_STEP
    saved = json.loads((tmp_path / "run" / "simulation.json").read_text())
    assert saved["overall"]["engine_max_batch"]["engines_at_limit"] == NUM_ENGINES
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()  # the real save path
    print(f"64 engines x {in_flight // NUM_ENGINES} requests: {wall:.0f} s wall; "
          f"{json.dumps(report['overall'])}")
