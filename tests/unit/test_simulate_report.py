"""`megatron-rl simulate`'s report, sweep and synchronous comparison (simulation/simulate.py,
simulation/sweep.py): the --sweep spec's parsing and its errors, the argmin of GPU-hours per
step, the speed-up arithmetic, the cost model's figures for one split against estimate_cost's
own, the report built from a hand-made scalars dict, and the engine's queue-wait statistics.

build_report reads a started SimulatedCluster; here a stand-in with the attributes it reads
(clock, engines' statistics, devices) takes its place, said where it is made."""
import asyncio
import dataclasses
import math
import types

import aiohttp
import pytest

from megatron_rl.scaling.cost import PRESETS, estimate_cost
from megatron_rl.simulation import EngineTiming, SimClock, get_profile
from megatron_rl.simulation import sweep
from megatron_rl.simulation.engine import (CompletionLengths, EngineSettings, EngineStats,
                                           SimulatedEngine)
from megatron_rl.simulation.simulate import (add_sync, build_parser, build_report,
                                             print_report)

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ --sweep spec

def test_sweep_spec_one_string_or_one_item_per_key():
    assert sweep.parse_sweep(["generators=8,14,20 k=0,1,2,4,8"]) == {
        "generators": [8, 14, 20], "k": [0, 1, 2, 4, 8]}
    assert sweep.parse_sweep(["k=0,8", "generators=14"]) == {"k": [0, 8], "generators": [14]}
    assert sweep.parse_sweep(["k=2"]) == {"k": [2]}


@pytest.mark.parametrize("spec, message", [
    ("", "empty"),
    ("engines=8,14", "KEY=V1,V2"),
    ("generators", "KEY=V1,V2"),
    ("k=1,two", "whole numbers"),
    ("k=", "whole numbers"),
    ("k=-1,0", "must be >= 0"),
    ("generators=0,8", "must be >= 1"),
    ("k=1,1", "repeats"),
    ("k=1 k=2", "given twice"),
])
def test_sweep_spec_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        sweep.parse_sweep([spec])


def test_the_cli_takes_sweep_no_sync_and_faults():
    args = build_parser().parse_intermixed_args(
        ["r.yaml", "a.b=1", "--sweep", "generators=8,14 k=0,8", "--no-sync", "--faults", "x"])
    assert args.sweep == ["generators=8,14 k=0,8"] and args.no_sync and args.faults == "x"
    assert args.overrides == ["a.b=1"] and args.warmup_steps is None


def test_grid_points_take_the_recipes_value_for_a_key_not_swept():
    assert sweep.grid_points({"k": [0, 4]}, generators=14, k=8) == [(14, 0), (14, 4)]
    assert sweep.grid_points({"generators": [8, 20], "k": [0, 1]}, generators=14, k=8) == [
        (8, 0), (8, 1), (20, 0), (20, 1)]
    assert sweep.point_overrides(8, 2) == ["rollout.num_generators=8",
                                           "rollout.max_off_policyness=2"]


# ------------------------------------------------------------------ argmin, speed-up

def test_argmin_picks_fewest_gpu_hours_skipping_failed_points_and_breaking_ties():
    rows = [{"generators": 8, "k": 0, "gpu_hours_per_step": 3.0, "step_model_s": 200.0},
            {"generators": 14, "k": 2, "gpu_hours_per_step": math.nan, "step_model_s": 1.0},
            {"generators": 14, "k": 8, "gpu_hours_per_step": 2.5, "step_model_s": 130.0},
            {"generators": 20, "k": 8, "gpu_hours_per_step": 2.5, "step_model_s": 100.0}]
    assert sweep.argmin(rows) is rows[3]  # tie on GPU-hours: the shorter step
    assert sweep.argmin(rows[:3]) is rows[2]
    with pytest.raises(ValueError, match="no sweep point has a finite"):
        sweep.argmin([rows[1]])


def test_speed_up_is_sync_over_async_per_generator_count():
    assert sweep.speed_up(300.0, 120.0) == pytest.approx(2.5)
    assert math.isnan(sweep.speed_up(0.0, 120.0)) and math.isnan(sweep.speed_up(300.0, math.nan))
    rows = [{"generators": 8, "k": 0, "step_model_s": 240.0},
            {"generators": 8, "k": 4, "step_model_s": 160.0},
            {"generators": 14, "k": 4, "step_model_s": 100.0}]  # no k = 0 for 14
    sweep.add_speed_ups(rows)
    assert [r["speed_up_vs_k0"] for r in rows[:2]] == [1.0, 1.5]
    assert math.isnan(rows[2]["speed_up_vs_k0"])


def test_stale_share_is_the_tokens_of_lag_one_and_more():
    assert sweep.stale_share([600.0, 300.0, 100.0]) == pytest.approx(0.4)
    assert math.isnan(sweep.stale_share([0.0, 0.0]))


def test_the_cost_models_figures_for_one_split_are_estimate_costs():
    """analytic(): the step for one split from estimate_cost's own device-seconds (by hand
    here), synchronous at k = 0 (decode x long_tail_factor), granularity scaling the generated
    tokens back to model tokens; its best split is best_layout's for the same devices."""
    model = dataclasses.replace(PRESETS["scout-gb200"], generated_tokens=256)
    a = sweep.analytic(model, generators=14, devices_per_engine=4, trainer_devices=16, k=8,
                       token_granularity=64)
    report = estimate_cost(dataclasses.replace(model, generated_tokens=256 * 64,
                                               generator_devices_per_instance=4,
                                               total_devices=72))
    step = max(report.generator_device_seconds / 56, report.train_device_seconds / 16)
    assert a["step_s"] == pytest.approx(step)
    assert a["gpu_hours_per_step"] == pytest.approx(72 * step / 3600)
    assert a["best_split"] == [report.layout.num_generator_devices,
                               report.layout.num_trainer_devices]
    sync = sweep.analytic(model, generators=14, devices_per_engine=4, trainer_devices=16, k=0,
                          token_granularity=64)
    decode_bound = report.decode_device_seconds / 56 > report.train_device_seconds / 16
    assert decode_bound  # Scout's generators are the bottleneck at 56 + 16
    slower = (report.decode_device_seconds * model.long_tail_factor
              + report.prefill_device_seconds) / 56
    assert sync["step_s"] == pytest.approx(slower)


# ------------------------------------------------------------------ the report

def _stand_in_backend(engine_batches, *, time_scale=20.0, devices=72, waits=(10.0, 4.0),
                      admitted=8):
    """A stand-in for a finished SimulatedCluster: only what build_report reads."""
    engines = [types.SimpleNamespace(stats=EngineStats(max_batch=b)) for b in engine_batches]
    stats = {"retractions": 3, "busy_model_s": 500.0, "max_lag_model_s": 0.2,
             "queue_wait_total_model_s": waits[0] * admitted / 2 + waits[1] * admitted / 2,
             "queue_wait_max_model_s": 12.0, "admitted": admitted}
    cluster = types.SimpleNamespace(
        clock=SimClock(time_scale), num_devices=devices, profile=get_profile("GB200"),
        generators=types.SimpleNamespace(engines=engines, retired=[]),
        engine_settings=EngineSettings(max_running_requests=256, token_granularity=64),
        layout=types.SimpleNamespace(devices_per_generator=4, colocated=False,
                                     num_trainer_ranks=devices - 4 * len(engines)),
        trainers=types.SimpleNamespace(modelled_s={"train": 30.0}),
        engine_stats=lambda: stats)
    return types.SimpleNamespace(cluster=cluster)


def _cfg(k):
    return types.SimpleNamespace(name="scout", rollout=types.SimpleNamespace(max_off_policyness=k))


SCALARS = {
    0: {"perf/validation_seconds": 2.0},
    1: {"perf/step_seconds": 10.0, "perf/generator_busy_fraction": 0.0,
        "perf/trainer_idle_fraction": 0.9, "rollout/interruption_rate": 0.5,
        "rollout/staleness/lag_0": 100.0},
    2: {"perf/step_seconds": 5.0, "perf/generator_busy_fraction": 0.9,
        "perf/trainer_idle_fraction": 0.2, "rollout/interruption_rate": 0.4,
        "rollout/staleness/lag_0": 30.0, "rollout/staleness/lag_1": 70.0},
    3: {"perf/step_seconds": 6.0, "perf/generator_busy_fraction": 0.8,
        "perf/trainer_idle_fraction": 0.3, "rollout/interruption_rate": 0.6,
        "rollout/staleness/lag_1": 50.0, "rollout/staleness/lag_2": 50.0,
        "perf/validation_seconds": 3.0},
}


def test_report_from_scalars_converts_to_model_time_and_leaves_out_the_fill():
    from megatron_rl.rollout.staleness import SCALAR_PREFIX

    assert SCALAR_PREFIX == "rollout/staleness"  # the tags SCALARS is written with
    report = build_report(_cfg(2), _stand_in_backend([256, 200, 256, 10]), SCALARS)
    steps = report["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]  # step 0 holds only the validation
    assert [s["step_model_s"] for s in steps] == [200.0, 100.0, 120.0]  # x time scale 20
    assert steps[0]["gpu_hours"] == pytest.approx(200.0 * 72 / 3600)
    assert steps[1]["staleness_tokens"] == [30.0, 70.0, 0.0]
    o = report["overall"]
    assert o["steps_counted"] == [2, 3]  # step 1, the pipeline's fill, left out
    assert o["step_model_s"] == pytest.approx(110.0)
    assert o["gpu_hours_per_step"] == pytest.approx(110.0 * 72 / 3600)
    assert o["generator_busy_share"] == pytest.approx(0.85)
    assert o["trainer_idle_share"] == pytest.approx(0.25)
    assert o["interruption_rate"] == pytest.approx(0.5)
    assert o["staleness_tokens"] == [30.0, 120.0, 50.0]
    assert o["engine_max_batch"] == {"min": 10, "median": 228.0, "max": 256,
                                     "engines_at_limit": 2}
    assert o["queue_wait_mean_model_s"] == pytest.approx(7.0)
    assert o["queue_wait_max_model_s"] == 12.0
    assert o["validation_model_s"] == {0: 40.0, 3: 60.0}
    assert report["trainer_devices"] == 72 - 4 * 4
    every = build_report(_cfg(2), _stand_in_backend([256]), SCALARS, warmup_steps=0)
    assert every["overall"]["step_model_s"] == pytest.approx(140.0)
    only = build_report(_cfg(2), _stand_in_backend([256]), {1: SCALARS[1]}, warmup_steps=1)
    assert only["overall"]["steps_counted"] == [1]  # nothing after the fill: all steps


def test_the_sync_run_gives_the_speed_up_and_both_gpu_hours():
    report = build_report(_cfg(2), _stand_in_backend([256]), SCALARS)
    sync = build_report(_cfg(0), _stand_in_backend([256]),
                        {s: {**m, "perf/step_seconds": m.get("perf/step_seconds", 0) * 2}
                         for s, m in SCALARS.items() if s})
    sync["output_dir"], sync["exit_status"] = "out_sync", 0
    add_sync(report, sync)
    assert report["speed_up"] == pytest.approx(2.0)
    assert report["sync"]["gpu_hours_per_step"] == pytest.approx(220.0 * 72 / 3600)
    assert report["sync"]["output_dir"] == "out_sync"


def test_the_printed_report_names_the_sync_run_queue_waits_and_validation(capsys):
    report = build_report(_cfg(2), _stand_in_backend([256]), SCALARS)
    sync = build_report(_cfg(0), _stand_in_backend([256]),
                        {s: {**m, "perf/step_seconds": m.get("perf/step_seconds", 0) * 2}
                         for s, m in SCALARS.items() if s})
    sync["output_dir"], sync["exit_status"] = "out_sync", 0
    add_sync(report, sync)
    report["cost_model"] = {"step_s": 142.4, "gpu_hours_per_step": 2.847}
    print_report(report)
    out = " ".join(capsys.readouterr().out.split())
    assert "queue wait before admission: mean 7.0, max 12.0 model s" in out
    assert "validation: step 0: 40.0 model s, step 3: 60.0 model s" in out
    assert "synchronous (k = 0, out_sync): step 220.0 model s" in out
    assert "speed-up of k = 2: 2.00x" in out and "step 142.4 s, 2.847 GPU-hours" in out


# ------------------------------------------------------------------ the engine's queue waits

def test_queue_wait_is_the_model_time_from_arrival_to_admission():
    """Two identical requests in one batched /generate to an engine of one slot: the second
    waits the first's prefill and decode longer than the first, less the few microseconds of
    wall time between their arrivals (x time scale 20: under 0.01 model s)."""
    profile = get_profile("H100")
    timing = EngineTiming(model=profile.cost_config(PRESETS["paper-8b"]), profile=profile)
    prompt = list(range(10, 42))

    async def scenario():
        engine = SimulatedEngine(EngineSettings(max_running_requests=1, lengths=CompletionLengths(
            median_tokens=300, sigma=0.0)), timing, SimClock(20.0))
        url = await engine.start()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/generate", json={
                        "input_ids": [prompt, prompt],
                        "sampling_params": {"max_new_tokens": 1000}}) as response:
                    assert response.status == 200, await response.text()
            return engine.stats
        finally:
            await engine.kill()

    stats = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    first = stats.queue_wait_total_model_s - stats.queue_wait_max_model_s
    one = timing.prefill_seconds(len(prompt)) + sum(
        timing.decode_step_seconds(1, len(prompt) + t) for t in range(300))
    assert len(stats.admission_order) == 2 and stats.finished == 2
    assert one - 0.01 < stats.queue_wait_max_model_s - first <= one * (1 + 1e-9)


def test_the_sweep_table_marks_the_argmin_and_the_plot_is_written(tmp_path):
    rows = [{"generators": g, "k": k, "devices": 4 * g + 16, "step_model_s": s,
             "gpu_hours_per_step": (4 * g + 16) * s / 3600, "generator_busy_share": 0.9,
             "trainer_idle_share": 0.2, "stale_token_share": 0.5, "cost_step_s": 100.0,
             "cost_gpu_hours_per_step": 2.0}
            for g, k, s in [(8, 0, 600.0), (8, 4, 200.0), (14, 0, 500.0), (14, 4, 140.0)]]
    sweep.add_speed_ups(rows)
    table = sweep.sweep_table(rows, "t")
    gpu_hours = table.columns[4]._cells
    assert [c.endswith(" *") for c in gpu_hours] == [False, True, False, False]  # 48 x 200 s
    assert table.columns[5]._cells == ["1.00", "3.00", "1.00", "3.57"]
    sweep.plot(rows, tmp_path / "sweep.png", "t")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the recipe as simulated


def test_the_scout_recipe_as_simulated_here(monkeypatch):
    """`megatron-rl simulate examples/llama4_scout/gb200_1rack.yaml` with nothing else given: 8
    of its 7100 steps; granularity 64 (32768 / 64 = 512 returned tokens of thinking) with the
    budgets converted; the zero-variance filter off (simulated rewards are all 0); generated
    prompts (the recipe's data/math_prompts.jsonl is not here); and, at a hard limit of 20000
    open files with 4 CPUs (the code sandbox's 4 workers hold up to 4 x 16 pipe ends): (8 + 1) x
    48 x 16 = 6912 training requests in flight leave 20000 - 1024 - 64 - 6912 = 12000 files for
    validation, 750 prompts x 16 (not 1000), and 2 x (6912 + 750 x 16) + 1088 > 20000, so the
    engines go to a child process."""
    import os
    import resource

    from megatron_rl.simulation.simulate import as_simulated

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 20000))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    extra, g, notices, child = as_simulated("examples/llama4_scout/gb200_1rack.yaml", [],
                                            steps=None, granularity=None)
    settings = dict(o.split("=", 1) for o in extra)
    assert g == 64 and child
    assert settings == {
        "train.num_steps": "27", "rollout.thinking_budget": "512",
        "rollout.thinking_budget_min": "432", "rollout.solution_budget": "32",
        "algorithm.zero_variance_filter": "false", "eval.at_step_zero": "false",
        "eval.interval_steps": "0",
        "data.prompts": "rg/basic_arithmetic",
        # 48 groups x (27 steps + k 8 + 2) + 1000 held out
        "data.num_generated_prompts": str(48 * 37 + 1000),
        "eval.num_heldout_prompts": "750"}
    assert len(notices) == 7 and "750 (not 1000)" in notices[5]


def test_what_the_user_gives_is_kept(monkeypatch):
    """A granularity given keeps the budgets as given (in its units), steps given are used,
    and a setting the user overrode is not touched."""
    import resource

    from megatron_rl.simulation.simulate import as_simulated

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 10 ** 6))
    extra, g, notices, child = as_simulated(
        "examples/llama4_scout/gb200_1rack.yaml",
        ["algorithm.zero_variance_filter=true", "data.prompts=rg/basic_arithmetic",
         "eval.at_step_zero=true"],
        steps=3, granularity=128)
    assert g == 128 and not child and extra == ["train.num_steps=3"] and notices == []
