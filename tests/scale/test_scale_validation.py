"""The scale tier: the Scout GB200 recipe's 1000-prompt x 16-sample validation (eval.
num_heldout_prompts, eval.samples_per_prompt of examples/llama4_scout/gb200_1rack.yaml) on 64
engines, beside the training requests that stay in flight while it runs (Pipeline-RL: the
rollout manager keeps generating through a validation).

What it shows: every engine reaches max_running_requests; forced interruption's continuations
(priority 1, rollout.continuations_first) are admitted before fresh requests that reached the
same engine earlier; validation results for all 1000 prompts x 16 samples; no hang; the ledger
accounts for every training group once.

The engines run in a child process (SimulationSettings.engines_in_child_process): the driver
then holds one socket per request in flight, as on a real cluster. 16,000 validation requests
plus the training requests cannot be in flight in one process here otherwise: two descriptors
per request against a hard limit of 20,000 open files. Even so the recipe's k = 8 cannot go
beside the validation on this machine: run_setup reserves (k + 1) x 48 x 16 + 16,000 + 1,024
descriptors = 23,936 at k = 8; k = 2 (2,304 training requests in flight) is the largest k whose
reservation, 19,328, fits under 20,000. No stand-in beyond the simulated cluster itself.
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
MAX_RUNNING = 104
HELDOUT, EVAL_SAMPLES = 1000, 16  # the recipe's eval.num_heldout_prompts, eval.samples_per_prompt
PROMPTS_PER_STEP, SAMPLES = 48, 16  # the recipe's 48 x 16 batch
K = 2  # the largest k whose open-file reservation fits this machine (module docstring)


def post_everywhere(cluster, indices, path: str, body: dict) -> None:
    """POST `path` to the engines `indices` over their HTTP API (SGLang's control calls)."""
    import aiohttp

    engines = cluster.generators.engines

    async def post(session, index):
        async with session.post(f"{engines[index].url}{path}", json=body) as response:
            assert response.status == 200, await response.text()

    async def everywhere():
        async with aiohttp.ClientSession(headers={
                "Authorization": f"Bearer {cluster.api_key}"}) as session:
            await asyncio.gather(*(post(session, i) for i in indices))

    if indices:
        cluster.loop.call(everywhere())


def hold_validation(monkeypatch, backend, *, deadline_s: float = 600.0) -> dict:
    """When the validation starts, pause every engine (in place: arrivals queue) until its
    share of the 16,000 validation requests has arrived, then continue it. One process sends
    the requests over tens of wall seconds; without the hold an engine would finish its first
    requests before its last arrive and the test would depend on wall time. What it shows is
    still the control plane's: more than max_running_requests requests at every engine at once.
    Returns {"held": engines held, "released_early": engines the deadline released}."""
    from megatron_rl.validation import HeldoutValidation

    original = HeldoutValidation.__call__
    outcome = {"held": 0, "released_early": 0}

    def held(self, step, *, version, metrics):
        cluster = backend.cluster
        engines = cluster.generators.engines
        share = {i: EVAL_SAMPLES * len(range(i, HELDOUT, len(engines)))
                 for i in range(len(engines))}  # run_anywhere: prompt i on engine i % n
        post_everywhere(cluster, list(share), "/pause_generation", {"mode": "in_place"})
        outcome["held"] = len(share)

        def watch():
            end = time.monotonic() + deadline_s
            waiting = set(share)
            while waiting and time.monotonic() < end:
                full = [i for i in waiting if engines[i].num_queued >= share[i]]
                post_everywhere(cluster, full, "/continue_generation", {})
                waiting -= set(full)
                time.sleep(0.2)
            outcome["released_early"] = len(waiting)
            post_everywhere(cluster, list(waiting), "/continue_generation", {})

        watcher = threading.Thread(target=watch, name="hold-validation", daemon=True)
        watcher.start()
        try:
            return original(self, step, version=version, metrics=metrics)
        finally:
            watcher.join()

    monkeypatch.setattr(HeldoutValidation, "__call__", held)
    return outcome


def test_scout_validation_1000_x_16_beside_training_on_64_engines(tmp_path, monkeypatch):
    """One optimizer step of Scout's recipe (48 x 16, k = 2) on 64 engines x 4 GB200 GPUs and
    32 trainer GPUs, then the recipe's 1000 x 16 validation while the next groups generate."""
    from megatron_rl.simulation.cluster import SimulatedBackend, SimulationSettings
    from megatron_rl.simulation.simulate import simulate, stand_in_model

    model = stand_in_model(tmp_path / "model", context=4096)
    cfg = load_config("examples/llama4_scout/gb200_1rack.yaml", [
        f"output_dir={tmp_path / 'run'}", f"model.hf_checkpoint={model}",
        "data.prompts=rg/basic_arithmetic", "data.num_generated_prompts=1400",
        f"rollout.num_generators={NUM_ENGINES}", "parallelism.world_size=32",
        f"rollout.max_off_policyness={K}", "train.num_steps=1",
        # Token budgets in units of the granularity below (64 model tokens each): every
        # thinking segment reaches its drawn budget (median 200 > 24), so every sample has a
        # continuation.
        "rollout.max_prompt_tokens=256", "rollout.thinking_budget=24",
        "rollout.thinking_budget_min=16", "rollout.solution_budget=8",
        "train.micro_batch_max_tokens=512", "eval.interval_steps=1", "eval.at_step_zero=false",
        "algorithm.zero_variance_filter=false", "logging.progress_bar=false",
        "rollout.no_progress_timeout_s=900"])  # held engines answer nothing meanwhile
    assert (cfg.eval.num_heldout_prompts, cfg.eval.samples_per_prompt) == (HELDOUT, EVAL_SAMPLES)
    assert cfg.rollout.continuations_first and cfg.rollout.forced_interruption
    assert cfg.prompts_per_step == PROMPTS_PER_STEP
    backend = SimulatedBackend(SimulationSettings(
        hardware="GB200", model=PRESETS["scout-gb200"], max_running_requests=MAX_RUNNING,
        token_granularity=64, median_tokens=200, sigma=0.0, time_scale=20.0,
        engines_in_child_process=True))
    hold = hold_validation(monkeypatch, backend)
    started = time.perf_counter()
    status, report = simulate(cfg, backend)
    wall = time.perf_counter() - started
    assert status == 0
    cluster = backend.cluster
    engines = cluster.generators.engines
    assert len(engines) == NUM_ENGINES and not cluster.generators.retired  # none restarted
    assert hold == {"held": NUM_ENGINES, "released_early": 0}
    stats = [engine.stats for engine in engines]
    assert [s.max_batch for s in stats] == [MAX_RUNNING] * NUM_ENGINES

    # Validation: all 1000 prompts, 16 samples each, every one through forced interruption.
    lines = read_jsonl(tmp_path / "run" / "validation_samples" / "step_000001.jsonl")
    per_prompt: dict[str, int] = {}
    for line in lines:
        per_prompt[line["prompt_id"]] = per_prompt.get(line["prompt_id"], 0) + 1
    assert len(per_prompt) == HELDOUT and set(per_prompt.values()) == {EVAL_SAMPLES}
    assert all(line["reward"] is not None for line in lines)  # graded, no verifier failure
    scaling = read_jsonl(tmp_path / "run" / "scaling.jsonl")  # one line per task
    assert {r["step"] for r in scaling} == {1}

    # Continuations first: no engine admitted a request while a higher-priority one (a
    # continuation, priority 1) waited, and continuations went ahead of fresh requests that had
    # reached the same engine earlier and were still queued. How many they overtook depends on
    # how soon the client sends them (wall time), so only the fleet's total is required to be
    # positive; the count per engine is printed. Every validation sample had one continuation.
    assert all(s.admitted_past_priority == 0 for s in stats)
    assert sum(s.priority_overtaken for s in stats) > 0
    assert sum(s.priority_admissions for s in stats) >= HELDOUT * EVAL_SAMPLES
    assert min(s.max_queued for s in stats) > MAX_RUNNING

    # Training: the step's 48 groups trained, version 1 pushed to all 64, the ledger whole.
    assert cluster.trainers.pushed == {e.url: 1 for e in engines}
    records = read_jsonl(tmp_path / "run" / "ledger.jsonl")
    assert check_ledger(records) == {"lost": [], "duplicated": []}
    [step] = [r for r in records if "step" in r]
    assert len(step["trained"]) == PROMPTS_PER_STEP
    assert records[-1]["next_group_id"] >= (K + 1) * PROMPTS_PER_STEP
    # The run checkpoint by the real save path, and the record `megatron-rl simulate` writes.
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()
    saved = json.loads((tmp_path / "run" / "simulation.json").read_text())
    assert saved["overall"]["engine_max_batch"]["engines_at_limit"] == NUM_ENGINES
    print(f"64 engines, 1000 x 16 validation beside (k + 1) x 48 x 16 = "
          f"{(K + 1) * PROMPTS_PER_STEP * SAMPLES} training requests: {wall:.0f} s wall; "
          f"continuations admitted {sum(s.priority_admissions for s in stats)}, fresh requests "
          f"they went ahead of {sum(s.priority_overtaken for s in stats)} (at "
          f"{sum(s.priority_overtaken > 0 for s in stats)} of 64 engines); "
          f"{json.dumps(report['overall'])}")
