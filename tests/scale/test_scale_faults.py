"""Faults at scale: the real control plane (train.py's driver, the rollout manager, the async
client, GeneratorHealth's health checks and concurrent restarts, the weight push and its retry,
the run checkpoint, --resume, the ledger) on the simulated cluster while a seeded fault plan
(megatron_rl/simulation/faults.py) kills, hangs and slows engines and loses a node of 8 engines,
or the trainer's node.

No stand-in here beyond the simulated cluster itself (simulation/cluster.py): the faults act on
the simulated engines and node table; detecting and recovering from them is the code `megatron-rl
train` runs. Bounds are in model time on the simulated clock, from the model's own figures.
"""
from __future__ import annotations

import json
import time

import pytest

from megatron_rl.config import load_config
from megatron_rl.resilience.ledger import check_ledger, read_jsonl
from megatron_rl.scaling.cost import PRESETS

pytestmark = pytest.mark.integration

RECIPE = "examples/llama3_8b/h100_80gpus.yaml"  # 64 single-GPU engines: 8 to an H100 node
NUM_ENGINES, ENGINES_PER_NODE = 64, 8
PROMPTS_PER_STEP, SAMPLES, K = 32, 4, 1
TIME_SCALE = 20.0
# GeneratorHealth's settings for the run (wall seconds, as the control plane counts them).
HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S = 1.0, 2.0


def recipe(tmp_path, *overrides):
    from megatron_rl.simulation.simulate import stand_in_model

    model = stand_in_model(tmp_path / "model", context=4096)
    return load_config(RECIPE, [
        f"output_dir={tmp_path / 'run'}", f"model.hf_checkpoint={model}",
        "data.prompts=rg/basic_arithmetic", "data.num_generated_prompts=400",
        f"rollout.num_generators={NUM_ENGINES}", f"rollout.samples_per_prompt={SAMPLES}",
        f"rollout.max_off_policyness={K}",
        f"train.global_batch_size={PROMPTS_PER_STEP * SAMPLES}",
        # Token budgets in units of the granularity (settings()).
        "rollout.max_prompt_tokens=256", "rollout.thinking_budget=24",
        "rollout.thinking_budget_min=16", "rollout.solution_budget=8",
        "train.micro_batch_max_tokens=512", "eval.interval_steps=0", "eval.at_step_zero=false",
        "eval.num_heldout_prompts=8", "algorithm.zero_variance_filter=false",
        "logging.progress_bar=false",
        f"rollout.health_check_interval_s={HEALTH_INTERVAL_S}",
        f"rollout.health_check_timeout_s={HEALTH_TIMEOUT_S}",
        "weight_sync.timeout_s=3", "rollout.max_generator_restarts=3", *overrides])


def settings(granularity: int = 256):
    """Granularity 256: a completion takes ~50 model s, so that the faults land in generation."""
    from megatron_rl.simulation.cluster import SimulationSettings

    return SimulationSettings(hardware="H100", model=PRESETS["paper-8b"],
                              token_granularity=granularity,
                              median_tokens=12, sigma=0.5, time_scale=TIME_SCALE,
                              engines_per_node=ENGINES_PER_NODE)


def recovery_bound_model_s(cluster, cfg) -> float:
    """The longest a fault may take from injection to the engine back in the rotation, in model
    seconds, from the model and the control plane's own settings. Detection: a hung engine
    fails two health checks in a row (each up to rollout.health_check_interval_s apart and
    rollout.health_check_timeout_s long), and a weight sync under way first waits
    weight_sync.timeout_s for it, then a health check, on each of its SYNC_ATTEMPTS tries.
    Then the restart (EngineTiming.start_seconds: launch + the weights from disk) and the
    take-back at the driver's next checks (three waits of WAIT_SLICE_S). The control plane
    counts its settings in wall seconds: x time_scale (at 20: a 20 s health interval, 40 s
    health timeout, 60 s sync timeout in model time)."""
    from megatron_rl.cluster.weights import SYNC_ATTEMPTS
    from megatron_rl.resilience.stop import WAIT_SLICE_S

    rollout = cfg.rollout
    detect_wall = 2 * (rollout.health_check_interval_s + rollout.health_check_timeout_s) \
        + SYNC_ATTEMPTS * (cfg.weight_sync.timeout_s + rollout.health_check_timeout_s)
    return cluster.engine_timing.start_seconds() \
        + cluster.clock.time_scale * (detect_wall + 3 * WAIT_SLICE_S)


def test_engines_dying_hanging_slowing_and_a_lost_node_of_8_recover_concurrently(tmp_path):
    """64 engines (8 nodes of 8) under a seeded plan, during the generation after step 2: 3
    engines die, 4 slow down 3-fold, 2 hang, node 2 (8 engines) is lost, and engines die at
    random (1 per engine-hour) until step 3. Every fault is detected and recovered by the real
    GeneratorHealth (the hung ones by its health checks' timeouts) within the bound above;
    restarts take the modelled start time; the lost node's engines restart at one moment on one
    spare node and are all back within about one start time (serially it would be 8); the
    slowed engines keep serving; the run finishes its steps and the ledger accounts for every
    group exactly once."""
    from megatron_rl.simulation.cluster import SimulatedBackend
    from megatron_rl.simulation.faults import FaultPlan
    from megatron_rl.simulation.simulate import simulate

    steps = 6
    cfg = recipe(tmp_path, f"train.num_steps={steps}")
    # Step 2's optimizer step ends while the engines generate step 3's groups (k = 1): the
    # faults land in that generation.
    plan = FaultPlan.parse("kill=3@step2+5s,slow=4x3@step2+5s,hang=2@step2+8s,node=2@step2+10s,"
                           "random=die:1@step2..step3,seed=3")
    backend = SimulatedBackend(settings(), on_start=plan.install)
    started = time.perf_counter()
    status, report = simulate(cfg, backend)
    wall = time.perf_counter() - started
    cluster, out = backend.cluster, tmp_path / "run"
    pool, injected = cluster.generators, plan.record()
    faults = read_jsonl(out / "faults.jsonl")
    start_s = cluster.engine_timing.start_seconds()
    bound = recovery_bound_model_s(cluster, cfg)
    print(f"{wall:.0f} s wall; start {start_s:.1f} model s, bound {bound:.0f} model s; "
          f"injected {json.dumps(injected)}\nrestarts {json.dumps(pool.restarts)}")
    assert status == 0
    records = read_jsonl(out / "ledger.jsonl")
    assert check_ledger(records) == {"lost": [], "duplicated": []}
    assert [r["step"] for r in records if "step" in r] == list(range(1, steps + 1))
    # The faults hit work in flight: the engines that died held requests (their groups were
    # generated again elsewhere, as the whole ledger shows).
    assert sum(e.stats.dropped for e in pool.retired) > 0

    by_kind = {}
    for entry in injected:
        by_kind.setdefault(entry["kind"], []).append(entry)
    assert "error" not in by_kind
    assert [len(e["indices"]) for e in by_kind["kill"] if e["origin"] == "plan"] == [3]
    assert [len(e["indices"]) for e in by_kind["hang"]] == [2]
    assert [len(e["indices"]) for e in by_kind["slow"]] == [4]
    [node] = by_kind["node"]
    on_node = list(range(2 * ENGINES_PER_NODE, 3 * ENGINES_PER_NODE))
    assert sorted(node["indices"] + [int(n.split("-")[1]) for n in node["starting"]]) == on_node
    assert len(node["indices"]) >= ENGINES_PER_NODE - 3  # at most the 3 killed were restarting

    # Every engine that died, hung or lost its node was restarted after it: not at once but
    # after the modelled start time, and GeneratorHealth took it back within the bound (its
    # faults.jsonl record: recovered_at, converted to model time).
    recovered, took = [f for f in faults if f["kind"] == "generator"], []
    assert recovered and all(f["recovered_at"] is not None for f in recovered), recovered

    def names(record: dict, name: str) -> bool:
        """Whether a faults.jsonl record is about generator `name`: by its name, or (a failed
        request's message) by the URL of one of its dead incarnations."""
        return f"generator {name!r}" in record["what"] or any(
            e.url in record["what"] for e in pool.retired if e.name == name)

    for entry in (e for e in injected if e["kind"] in ("kill", "hang", "node")):
        for name in entry["targets"] + entry.get("starting", []):
            index = pool.names.index(name)
            ok = [r for r in pool.restarts if r["index"] == index
                  and r["asked_model_s"] >= entry["model_s"] and r["up_model_s"] != "failed"]
            assert ok and isinstance(ok[0]["up_model_s"], float), (entry, name, pool.restarts)
            assert ok[0]["up_model_s"] - ok[0]["asked_model_s"] >= start_s
            back = [plan.model_time(f["recovered_at"]) for f in recovered
                    if names(f, name) and plan.model_time(f["recovered_at"]) >= ok[0]["up_model_s"]]
            assert back, (entry, name)
            assert back[0] - entry["model_s"] <= bound, (entry, name, back[0])
            took.append((back[0] - entry["model_s"], entry["kind"], name))
            if entry["kind"] == "hang":  # detected by the health checks' timeouts
                assert any(names(f, name) and "no health answer" in f["what"]
                           for f in recovered), name
    # Every engine restarted was taken back into the rotation, at least once (one that failed
    # again before, e.g. a random death of a restarted engine, was restarted again).
    assert len(recovered) >= len({r["index"] for r in pool.restarts})

    # The lost node's engines restarted together: all asked before any was up, all up within
    # about one start time of the first ask (serially it would be 8), on one spare node.
    lost = [next(r for r in pool.restarts if r["index"] == i and r["asked_model_s"]
                 >= node["model_s"]) for i in node["indices"]]
    first_ask = min(r["asked_model_s"] for r in lost)
    assert max(r["asked_model_s"] for r in lost) < min(r["up_model_s"] for r in lost)
    assert max(r["up_model_s"] for r in lost) - first_ask < 2 * start_s
    assert {r["node"] for r in lost} == {NUM_ENGINES // ENGINES_PER_NODE}  # the first spare
    print(f"recoveries (injection -> back in the rotation, model s): {len(took)}, "
          f"median {sorted(took)[len(took) // 2][0]:.0f}, max {max(took)[0]:.0f} "
          f"({max(took)[1]} {max(took)[2]}; bound {bound:.0f}); "
          f"node {node['node']}: {len(lost)} restarts asked within "
          f"{max(r['asked_model_s'] for r in lost) - first_ask:.1f} model s, all up "
          f"{max(r['up_model_s'] for r in lost) - first_ask:.1f} model s after the first ask "
          f"(start time {start_s:.1f})")

    # The slowed engines kept serving at their slower pace (those the node loss spared).
    [slow] = by_kind["slow"]
    for index, before in zip(slow["indices"], slow["decode_tokens_before"]):
        if index in on_node:
            continue
        engine = pool.engines[index]
        assert engine.slowdown == 3.0 and engine not in pool.retired  # never taken out
        assert engine.stats.decode_tokens > before

    # At the end every engine served again (the run's end then stopped them all), and no
    # restart was still under way.
    assert len(pool.serving()) == NUM_ENGINES
    assert all(r["up_model_s"] is not None for r in pool.restarts)
    assert report["overall"]["engines_restarted"] == len(pool.retired)


def test_a_lost_trainer_node_stops_the_run_with_75_and_a_resume_finishes_it(tmp_path):
    """The trainer's node is lost after step 2: the real driver stops with NodeLost (exit
    status 75, one line naming the node, its trainer ranks and the --resume to run); the run
    resumed on a fresh simulated cluster in the same output_dir finishes, with every group in
    the ledger exactly once across both."""
    from megatron_rl.resilience.recovery import NodeLost
    from megatron_rl.simulation.cluster import SimulatedBackend
    from megatron_rl.simulation.faults import FaultPlan
    from megatron_rl.simulation.simulate import simulate
    from megatron_rl.train import train

    engines, steps = 16, 3
    overrides = [f"rollout.num_generators={engines}", f"train.num_steps={steps}",
                 "checkpoint.interval_steps=1"]
    plan = FaultPlan.parse("trainer-node@step2")
    backend = SimulatedBackend(settings(64), on_start=plan.install)
    with pytest.raises(NodeLost) as stopped:
        train(recipe(tmp_path, *overrides), backend)
    message = str(stopped.value)
    print(message)
    assert stopped.value.exit_status == 75
    assert "\n" not in message and "exit status 75" in message
    assert "lost node 10.255.0.1 (Ray node id simulated-tr)" in message  # its address, id
    assert "trainer rank 0" in message
    assert "--resume` continues from" in message
    [lost] = plan.record()
    assert lost["kind"] == "trainer-node" and lost["step"] >= 2

    out = tmp_path / "run"
    resumed = SimulatedBackend(settings(64))
    status, report = simulate(recipe(tmp_path, *overrides, "checkpoint.resume=always"), resumed)
    assert status == 0
    records = read_jsonl(out / "ledger.jsonl")
    assert check_ledger(records) == {"lost": [], "duplicated": []}
    assert [r["step"] for r in records if "step" in r] == list(range(1, steps + 1))
    assert resumed.cluster.trainers.steps == steps
