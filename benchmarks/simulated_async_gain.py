"""The async-vs-sync gain of the ScaleRL recipe at scale, from the simulator: Llama-4 Scout
(examples/llama4_scout/gb200_1rack.yaml) at k = 0, 1, 2, 4, 8 on one GB200 NVL72 rack (the
recipe: 14 engines x 4 GPUs + 16 trainer GPUs) and on four (4x both: 56 engines x 4 GPUs + 64
trainer GPUs, parallelism.world_size=64 rollout.num_generators=56; the batch stays 48 x 16, as in
the recipe's generated block for more racks). Each point is `megatron-rl simulate`'s run
(simulation/simulate.py Runner), sequentially in this process; prints per point: step time and
GPU-hours per step (mean over the steps after the first, the pipeline's fill), the speed-up over
k = 0 on the same devices, generator busy, trainer idle, the share of trained tokens from an
older policy, the engines' largest lag behind the clock (near 0: this machine kept up), and what
`megatron-rl cost` says for the same split (synchronous at k = 0: decode x long_tail_factor).

    python benchmarks/simulated_async_gain.py --steps 8 --time-scale 32 --sync-time-scale 32 \
        --token-granularity 128

Time scales: the asynchronous runs return tokens continuously, so the process must keep up
with the engines: --time-scale on one rack, divided by the racks (the same tokens per step in a
step that many times shorter). The synchronous runs' steps are long (the longest completion
decodes alone at the end) and their token rate low: --sync-time-scale for them. The wall time
of the driver's own work counts as model time x the time scale (docs/simulation.md), so the
scale is kept as low as the wall time allows; each row says how far the engines fell behind.

Token budgets are the recipe's in units of the granularity g: the thinking budget 32768 model
tokens (forced interruption from 27648), the solution budget 2048, prompts of the rg task ~40
returned tokens (x g model tokens). The record goes to OUT/async_gain.json; each point's
simulation.json to OUT/racks{R}_k{K}/.

Measured here (docs/simulation.md, "Async vs sync at scale", 2026-12-05, idle machine): 37 min
for the ten points with the command above: 2.6-4.3 min a one-rack point, 2.5-6.4 min a four-rack
one; the engines stayed within 39 model s of the clock on one rack and 8 on four.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

RECIPE = "examples/llama4_scout/gb200_1rack.yaml"
RACKS = {1: [], 4: ["parallelism.world_size=64", "rollout.num_generators=56"]}


def workload(g: int, steps: int, k_max: int) -> list[str]:
    """The recipe's budgets in units of g, synthetic prompts, no validation, every group
    trained (the simulated rewards are all 0: docs/simulation.md)."""
    return [f"rollout.thinking_budget={32768 // g}", f"rollout.thinking_budget_min={27648 // g}",
            f"rollout.solution_budget={max(1, 2048 // g)}", "data.prompts=rg/basic_arithmetic",
            f"data.num_generated_prompts={48 * (steps + k_max + 2)}", "eval.interval_steps=0",
            "eval.at_step_zero=false", "eval.num_heldout_prompts=16",
            "algorithm.zero_variance_filter=false",
            f"train.num_steps={steps}", "logging.progress_bar=false"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=16.0)
    parser.add_argument("--sync-time-scale", type=float, default=32.0)
    parser.add_argument("--token-granularity", type=int, default=128)
    parser.add_argument("--k", default="0,1,2,4,8")
    parser.add_argument("--racks", default="1,4")
    parser.add_argument("--out", default="runs/simulated_async_gain")
    args = parser.parse_args()

    from megatron_rl.console import print_table, report_console
    from megatron_rl.simulation import sweep
    from megatron_rl.simulation.cluster import SimulationSettings
    from megatron_rl.simulation.simulate import Runner

    ks = [int(k) for k in args.k.split(",")]
    racks = [int(r) for r in args.racks.split(",")]
    settings = SimulationSettings(hardware="GB200", time_scale=args.time_scale,
                                  token_granularity=args.token_granularity)
    rows, started = [], time.perf_counter()
    for rack in racks:
        # Every k over the same steps (2..N; the Runner's default leaves out k + 1 steps, which
        # at k = 8 of 8 steps is none), and the whole run (1..N) beside it.
        runner = Runner(RECIPE, workload(args.token_granularity, args.steps, max(ks))
                        + RACKS[rack] + [f"output_dir={args.out}/racks{rack}"], settings,
                        warmup_steps=1)
        for k in ks:
            t0 = time.perf_counter()
            runner.settings = dataclasses.replace(
                settings, time_scale=args.sync_time_scale if k == 0 else args.time_scale / rack)
            status, report = runner.run([f"rollout.max_off_policyness={k}"],
                                        output_dir=f"{args.out}/racks{rack}_k{k}")
            rows.append(sweep.sweep_row(report, report["cost_model"])
                        | {"racks": rack, "exit_status": status,
                           "wall_s": time.perf_counter() - t0,
                           "time_scale": runner.settings.time_scale,
                           "queue_wait_mean_model_s":
                               report["overall"]["queue_wait_mean_model_s"],
                           "all_steps_model_s": statistics.fmean(
                               s["step_model_s"] for s in report["steps"])})
            print(f"racks {rack} k {k}: exit {status}, "
                  f"{rows[-1]['step_model_s']:.1f} model s per step, "
                  f"{rows[-1]['wall_s']:.0f} s wall", flush=True)
    sweep.add_speed_ups(rows)
    sweep.add_speed_ups(rows, step_key="all_steps_model_s", out_key="all_steps_speed_up_vs_k0")

    from rich.table import Table

    table = Table(title=f"Scout, ScaleRL recipe, GB200 NVL72: async (k) vs sync (k = 0); "
                        f"{args.steps} steps, mean of steps 2..{args.steps} (and 1..{args.steps}: "
                        f"with the pipeline's fill); token granularity "
                        f"{args.token_granularity}")
    for column in ("racks", "engines + trainers", "k", "step (model s)", "GPU-h / step",
                   "speed-up vs k=0", "step, 1..N", "speed-up, 1..N", "generator busy",
                   "trainer idle", "stale tokens", "time scale", "max lag (model s)", "cost model step (s)",
                   "cost model GPU-h / step"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["racks"]), f"{r['generators']} x 4 + {r['trainer_devices']}",
                      str(r["k"]), f"{r['step_model_s']:.1f}", f"{r['gpu_hours_per_step']:.3f}",
                      f"{r['speed_up_vs_k0']:.2f}", f"{r['all_steps_model_s']:.1f}",
                      f"{r['all_steps_speed_up_vs_k0']:.2f}", f"{r['generator_busy_share']:.2f}",
                      f"{r['trainer_idle_share']:.2f}", f"{r['stale_token_share']:.2f}",
                      f"{r['time_scale']:g}", f"{r['engine_max_lag_model_s']:.1f}",
                      f"{r['cost_step_s']:.1f}",
                      f"{r['cost_gpu_hours_per_step']:.3f}")
    print_table(report_console(), table)
    wall = time.perf_counter() - started
    print(f"wall time {wall / 60:.1f} min")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_gain.json").write_text(json.dumps(
        {"args": vars(args), "rows": rows, "wall_s": wall}, indent=1))
    return max(r["exit_status"] for r in rows) if all(
        math.isfinite(r["step_model_s"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
