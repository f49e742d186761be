"""`megatron-rl simulate RECIPE --sweep "generators=8,14,20 k=0,1,2,4,8"`: the recipe simulated
at every point of a grid over rollout.num_generators and rollout.max_off_policyness (k), and
what it owns around those runs: parsing the sweep spec, the grid's overrides, the argmin of
GPU-hours per step, the cost model's analytic figures for the same points (scaling/cost.py's
estimate_cost and best_layout, not a second model), the speed-up of each k over k = 0, and the
table, plot and JSON record.

The trainer is kept at the recipe's parallelism.world_size at every point: its ranks must be a
whole multiple of the recipe's parallel grid (TP x PP x CP, EP x ETP x PP), which "the rest of
the devices" rarely is; so the points differ in total devices, and GPU-hours per step (step time
x all devices) is what compares them.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

SWEEP_KEYS = {"generators": "rollout.num_generators", "k": "rollout.max_off_policyness"}
SWEEP_EXAMPLE = 'generators=8,14,20 k=0,1,2,4,8'


def parse_sweep(specs: Sequence[str]) -> dict[str, list[int]]:
    """`["generators=8,14,20 k=0,1,2,4,8"]` (one string, or one item per key) -> {"generators":
    [8, 14, 20], "k": [0, 1, 2, 4, 8]}; a key not given is absent (the recipe's value)."""
    grid: dict[str, list[int]] = {}
    items = [item for spec in specs for item in spec.replace(";", " ").split()]
    if not items:
        raise ValueError(f"--sweep: empty; give e.g. --sweep \"{SWEEP_EXAMPLE}\"")
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or key not in SWEEP_KEYS:
            raise ValueError(f"--sweep: {item!r} is not KEY=V1,V2,... with KEY one of "
                             f"{', '.join(SWEEP_KEYS)}; e.g. --sweep \"{SWEEP_EXAMPLE}\"")
        if key in grid:
            raise ValueError(f"--sweep: {key} is given twice; list all its values once "
                             f"({key}=A,B,C)")
        try:
            numbers = [int(v) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"--sweep: {item!r}: the values must be whole numbers separated "
                             f"by commas, e.g. {key}=1,2,4") from None
        smallest = 1 if key == "generators" else 0
        if any(n < smallest for n in numbers):
            raise ValueError(f"--sweep: {item!r}: {key} must be >= {smallest}")
        if len(set(numbers)) != len(numbers):
            raise ValueError(f"--sweep: {item!r} repeats a value")
        grid[key] = numbers
    return grid


def grid_points(grid: dict[str, list[int]], *, generators: int, k: int) -> list[tuple[int, int]]:
    """(generators, k) for every point, the recipe's value where the grid does not vary it."""
    return [(g, kk) for g in grid.get("generators", [generators]) for kk in grid.get("k", [k])]


def point_overrides(generators: int, k: int) -> list[str]:
    return [f"{SWEEP_KEYS['generators']}={generators}", f"{SWEEP_KEYS['k']}={k}"]


def argmin(rows: Sequence[dict], key: str = "gpu_hours_per_step") -> dict:
    """The row with the fewest `key` (finite values only); ties go to the shorter step, then
    to fewer devices."""
    finite = [r for r in rows if math.isfinite(r.get(key, math.nan))]
    if not finite:
        raise ValueError(f"no sweep point has a finite {key}: every run failed or took no "
                         "optimizer step (see each point's simulation.json)")
    return min(finite, key=lambda r: (r[key], r.get("step_model_s", math.inf),
                                      r.get("devices", math.inf)))


def speed_up(sync_step_s: float, async_step_s: float) -> float:
    """Synchronous step time over asynchronous: > 1 when the asynchronous run is faster."""
    if not (sync_step_s > 0 and async_step_s > 0):
        return math.nan
    return sync_step_s / async_step_s


def add_speed_ups(rows: list[dict], *, step_key: str = "step_model_s",
                  out_key: str = "speed_up_vs_k0") -> None:
    """Each row's `out_key`: the k = 0 row's `step_key` (same generators) over its own; NaN
    where the grid has no k = 0 for those generators."""
    sync = {r["generators"]: r[step_key] for r in rows if r["k"] == 0}
    for r in rows:
        r[out_key] = speed_up(sync.get(r["generators"], math.nan), r[step_key])


def analytic(model, *, generators: int, devices_per_engine: int, trainer_devices: int, k: int,
             token_granularity: int = 1) -> dict:
    """What `megatron-rl cost` says for one point: estimate_cost of the simulated model (the
    recipe's token budgets are in units of token_granularity, so the generated tokens are
    scaled back to model tokens), synchronous (pipeline_rl=False: decode x long_tail_factor)
    at k = 0. The step for this split is best_layout's formula for one split: the slower of
    the generators' and the trainer's device-time over their devices, plus weight_sync_seconds."""
    from megatron_rl.scaling.cost import best_layout, estimate_cost

    gen_devices = generators * devices_per_engine
    total = gen_devices + trainer_devices
    config = dataclasses.replace(model, generated_tokens=model.generated_tokens * token_granularity,
                                 pipeline_rl=k > 0, total_devices=total,
                                 generator_devices_per_instance=devices_per_engine)
    report = estimate_cost(config)
    step = report.split_step_seconds(gen_devices, trainer_devices)
    best = best_layout(report)
    return {"step_s": step, "gpu_hours_per_step": total * step / 3600.0,
            "balanced_gpu_hours_per_step": report.gpu_hours_per_step,
            "best_split": [best.num_generator_devices, best.num_trainer_devices],
            "best_split_gpu_hours_per_step": best.gpu_hours_per_step}


def sweep_row(report: dict, cost: dict) -> dict:
    o = report["overall"]
    return {"generators": report["engines"], "k": report["max_off_policyness"],
            "trainer_devices": report["trainer_devices"], "devices": report["devices"],
            "step_model_s": o["step_model_s"], "gpu_hours_per_step": o["gpu_hours_per_step"],
            "generator_busy_share": o["generator_busy_share"],
            "trainer_idle_share": o["trainer_idle_share"],
            "stale_token_share": stale_share(o["staleness_tokens"]),
            "engine_max_lag_model_s": o["engine_max_lag_model_s"],
            "cost_step_s": cost.get("step_s", math.nan),
            "cost_gpu_hours_per_step": cost.get("gpu_hours_per_step", math.nan)}


def stale_share(staleness_tokens: Sequence[float]) -> float:
    """Share of the trained tokens generated by an older policy than the step's (lag >= 1)."""
    total = sum(staleness_tokens)
    return (total - staleness_tokens[0]) / total if total else math.nan


def sweep_table(rows: Sequence[dict], title: str):
    from rich.table import Table

    best = argmin(rows)
    table = Table(title=title)
    for column in ("generators", "k", "devices", "step (model s)", "GPU-h / step",
                   "speed-up vs k=0", "generator busy", "trainer idle", "stale tokens",
                   "cost model step (s)", "cost model GPU-h / step"):
        table.add_column(column, justify="right")
    for r in rows:
        mark = " *" if r is best else ""
        table.add_row(str(r["generators"]), str(r["k"]), str(r["devices"]),
                      f"{r['step_model_s']:.1f}", f"{r['gpu_hours_per_step']:.3f}{mark}",
                      f"{r['speed_up_vs_k0']:.2f}", f"{r['generator_busy_share']:.2f}",
                      f"{r['trainer_idle_share']:.2f}", f"{r['stale_token_share']:.2f}",
                      f"{r['cost_step_s']:.1f}", f"{r['cost_gpu_hours_per_step']:.3f}")
    return table


def plot(rows: Sequence[dict], path, title: str) -> None:
    """GPU-hours per step against k, one line per generator count: simulated (solid, dots) and
    the cost model (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for g in sorted({r["generators"] for r in rows}):
        points = sorted((r for r in rows if r["generators"] == g), key=lambda r: r["k"])
        ks = [r["k"] for r in points]
        line, = ax.plot(ks, [r["gpu_hours_per_step"] for r in points], "o-",
                        label=f"{g} engines (simulated)")
        ax.plot(ks, [r["cost_gpu_hours_per_step"] for r in points], "--",
                color=line.get_color(), label=f"{g} engines (cost model)")
    best = argmin(rows)
    ax.plot([best["k"]], [best["gpu_hours_per_step"]], "k*", markersize=14, label="argmin")
    ax.set_xticks(sorted({r["k"] for r in rows}))
    ax.set_xlabel("k (rollout.max_off_policyness)")
    ax.set_ylabel("GPU-hours per step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
