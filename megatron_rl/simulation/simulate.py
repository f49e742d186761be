"""`megatron-rl simulate RECIPE.yaml [--hardware GB200] [--steps N] [--time-scale X] [overrides]`:
the recipe's real control plane (megatron_rl/train.py's driver, the rollout manager, the async
client, GeneratorHealth, validation, checkpoints, the ledger) against the simulated cluster
(simulation/cluster.py, chosen here and only here through cluster/backend.py's seam), then a
report per step and overall, read from what the run itself logged (TensorBoard) and the
engines' statistics: step time in model seconds, GPU-hours per step, generator busy share,
trainer idle share, the per-token staleness histogram, the engine batch sizes reached against
max_running_requests, the interruption rate, queue waits, validation time; a JSON record in
output_dir/simulation.json. By default the same recipe is simulated again synchronously
(rollout.max_off_policyness=0, output_dir + "_sync") for the speed-up; `--sweep` runs a grid
(simulation/sweep.py); `--faults` installs simulation/faults.py's FaultPlan in every run.

Wall-clock figures the driver logs are converted to model time by the clock's time_scale, so
the driver's own CPU time is counted as if the cluster spent it x time_scale: keep time_scale
modest (docs/simulation.md, "What bounds a simulation on this machine").
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

USAGE_EPILOG = """Overrides are the recipe's section.field=value, as for `megatron-rl train`. A
recipe without model.hf_checkpoint (the large presets) gets a stand-in tokenizer and config.json
written to OUTPUT_DIR/simulated_model: token ids are simulated, the text only feeds the real
verifiers (which give 0). Unless --no-sync (or k is 0 already), the recipe is run again with
rollout.max_off_policyness=0 into OUTPUT_DIR_sync: the driver then admits only the current step's
groups, so the generators idle while the trainer steps (synchronous RL on separate generator and
trainer devices) and the report gives the speed-up. --sweep "generators=8,14,20 k=0,1,2,4,8" runs
every point (trainer devices: the recipe's parallelism.world_size) into OUTPUT_DIR_sweep/."""


# A recipe's num_steps (thousands) would simulate the whole run: by default 3 (k + 1) steps
# (at least 8), the first k + 1 the fill (--warmup-steps), and SYNC_STEPS of the k = 0 run.
DEFAULT_STEPS = 8
SYNC_STEPS = 4
AUTO_RETURNED_TOKENS = 512  # the longest thinking part, in returned tokens, at the default
_BUDGETS = ("thinking_budget", "thinking_budget_min", "solution_budget")


def as_simulated(recipe: str, overrides: Sequence[str], *, steps: int | None,
                 granularity: int | None) -> tuple[list[str], int, list[str], bool]:
    """What makes a recipe simulate in minutes on this machine, where the user did not say
    otherwise -> (overrides to add, token granularity, one notice line for each):
    - at most DEFAULT_STEPS steps;
    - a token granularity g (unless given): the recipe's token budgets in units of g;
    - algorithm.zero_variance_filter=false: every simulated reward is 0, so the filter would
      drop every group and no step would ever be taken;
    - generated prompts (rg/basic_arithmetic) when the recipe's prompt file is not here: the
      engines' tokens are simulated, only the prompts' number and lengths matter;
    - fewer held-out prompts when the requests in flight at once (training at the staleness
      bound plus a validation) need more open files than this machine's hard limit allows
      (one socket each, async_client.reserve_open_files), and the engines in a child process
      when two files a request (both ends in one process) would not fit.
    -> (overrides, granularity, notices, engines in a child process)
    """
    import resource

    from megatron_rl.config import load_config
    from megatron_rl.rewards.sandbox import SandboxConfig, sandbox_open_files
    from megatron_rl.rollout.async_client import RESERVED_OPEN_FILES
    from megatron_rl.rollout.staleness import StalenessSettings

    given = {o.split("=", 1)[0] for o in overrides}
    cfg = load_config(recipe, list(overrides))
    extra, notices = [], []
    if steps is not None:
        extra.append(f"train.num_steps={steps}")
    elif "train.num_steps" not in given:
        default = max(DEFAULT_STEPS, 3 * (cfg.rollout.max_off_policyness + 1))
        if cfg.train.num_steps > default:
            extra.append(f"train.num_steps={default}")
            notices.append(f"{default} of the recipe's {cfg.train.num_steps} steps, the first "
                           f"{cfg.rollout.max_off_policyness + 1} the pipeline's fill (--steps N "
                           "for more)")
    r = cfg.rollout
    if granularity is None:
        granularity = 1
        while r.thinking_budget / granularity > AUTO_RETURNED_TOKENS:
            granularity *= 2
        if granularity > 1:
            thinking = r.thinking_budget // granularity
            budgets = {"thinking_budget": thinking,
                       "thinking_budget_min": min(thinking, max(
                           1, r.thinking_budget_min // granularity)),
                       "solution_budget": max(1, -(-r.solution_budget // granularity))}
            extra += [f"rollout.{name}={value}" for name, value in budgets.items()]
            notices.append(
                f"token granularity {granularity}: a returned token stands for {granularity} "
                "model tokens; budgets " + ", ".join(
                    f"{name} {getattr(r, name)} -> {budgets[name]}" for name in _BUDGETS)
                + " (--token-granularity G to choose it, budgets then in its units)")
    if cfg.algorithm.zero_variance_filter and "algorithm.zero_variance_filter" not in given:
        extra.append("algorithm.zero_variance_filter=false")
        notices.append("algorithm.zero_variance_filter=false: every simulated reward is 0, and "
                       "the filter would drop every group")
    if not given & {"eval.at_step_zero", "eval.interval_steps"} and (
            cfg.eval.at_step_zero or cfg.eval.interval_steps):
        # (the driver also validates after the last step)
        extra += ["eval.at_step_zero=false", "eval.interval_steps=0"]
        notices.append(f"no validation (eval.at_step_zero=false, eval.interval_steps=0): one of "
                       f"{cfg.eval.num_heldout_prompts} x {cfg.eval.samples_per_prompt} samples of "
                       f"up to {r.max_response_tokens} tokens is hours of model time and many "
                       "minutes here; give eval.at_step_zero=true or eval.interval_steps=N to "
                       "have its time in the report")
    prompts = cfg.data.prompts
    if not prompts.startswith("rg/") and not Path(prompts).exists():
        cfg = load_config(recipe, list(overrides) + extra)
        groups = cfg.train.global_batch_size // r.samples_per_prompt
        count = groups * (cfg.train.num_steps + r.max_off_policyness + 2) \
            + cfg.eval.num_heldout_prompts
        extra += ["data.prompts=rg/basic_arithmetic", f"data.num_generated_prompts={count}"]
        notices.append(f"data.prompts: {prompts} is not here; {count} generated "
                       "rg/basic_arithmetic prompts instead (their lengths, not their text, "
                       "reach the simulated engines)")
    cfg = load_config(recipe, list(overrides) + extra)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    training = StalenessSettings.from_run_config(cfg).max_outstanding_groups \
        * cfg.rollout.samples_per_prompt
    # What the driver reserves besides the requests (RunSetup._reserve_open_files).
    reserved = RESERVED_OPEN_FILES + sandbox_open_files(SandboxConfig.from_run_config(cfg))
    room = hard - reserved - training
    heldout = cfg.eval.num_heldout_prompts
    if hard != resource.RLIM_INFINITY and heldout * cfg.eval.samples_per_prompt > room > 0:
        fits = max(1, room // cfg.eval.samples_per_prompt)
        extra.append(f"eval.num_heldout_prompts={fits}")
        notices.append(f"eval.num_heldout_prompts={fits} (not {heldout}): {training} training "
                       f"requests at the staleness bound and {heldout} x "
                       f"{cfg.eval.samples_per_prompt} validation ones would be in flight at "
                       f"once, one open file each, over this machine's hard limit of {hard} "
                       "(`ulimit -Hn`); the validation time reported is for the fewer")
    in_flight = training + min(heldout, max(1, room // cfg.eval.samples_per_prompt)) \
        * cfg.eval.samples_per_prompt
    # Engines in this process hold the other end of every socket: two files a request.
    child = hard != resource.RLIM_INFINITY and 2 * in_flight + reserved > hard
    if child:
        notices.append(f"the engines run in a child process: {in_flight} requests in flight, "
                       "two open files each in one process, exceed the hard limit of "
                       f"{hard}")
    return extra, granularity, notices, child


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl simulate", epilog=USAGE_EPILOG,
        description="run a recipe's real control plane against simulated engines and trainer")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    parser.add_argument("--hardware", default="GB200",
                        help="hardware profile: H100, H200, B200, GB200, H20, cpu (default GB200)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps to simulate (default: the recipe's num_steps, at "
                             f"most 3 (k + 1) or {DEFAULT_STEPS}; the k = 0 run: "
                             f"{SYNC_STEPS})")
    parser.add_argument("--time-scale", type=float, default=20.0,
                        help="model seconds per wall second (default 20: lower it when the "
                             "report says the engines fell behind the clock)")
    parser.add_argument("--token-granularity", type=int, default=None,
                        help="model tokens per returned token; given, the recipe's token budgets "
                             "are in these units (docs/simulation.md). Default: the power of two "
                             f"that leaves at most {AUTO_RETURNED_TOKENS} returned tokens of "
                             "thinking, the budgets converted")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="per engine (default: the cost model's 256)")
    parser.add_argument("--engines-in-child-process", action="store_true",
                        help="serve the engines from a child process: one open file per request "
                             "in flight in the driver instead of two (over ~9000 in flight)")
    parser.add_argument("--median-tokens", type=float, default=None,
                        help="median completion length (default: half the thinking budget)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="first steps left out of the overall figures: the pipeline's fill "
                             "(default k + 1: the first step's wait fills k + 1 steps' groups, "
                             "which the next k drain faster than the steady state)")
    parser.add_argument("--no-sync", action="store_true",
                        help="skip the synchronous (k = 0) run and the speed-up")
    parser.add_argument("--sweep", action="append", default=[], metavar="SPEC",
                        help='a grid, e.g. --sweep "generators=8,14,20 k=0,1,2,4,8"')
    parser.add_argument("--faults", default=None, metavar="SPEC",
                        help="faults to inject in each run (simulation/faults.py's FaultPlan)")
    return parser


def stand_in_model(directory: Path, *, context: int) -> str:
    """A tokenizer and a config.json for a recipe without model.hf_checkpoint: what the driver
    reads before it starts (tokenizer, context length); the simulated engines need no weights."""
    from transformers import LlamaConfig

    from megatron_rl.config import INTERRUPTION_PHRASE
    from megatron_rl.data.tokenizer import train_tokenizer

    if not (directory / "config.json").is_file():
        texts = [INTERRUPTION_PHRASE, "<think> </think> <answer> </answer>"] + [
            f"What is {a} + {b}? The answer is {a + b}." for a in range(40) for b in range(10)]
        tokenizer = train_tokenizer(texts, vocab_size=512)
        tokenizer.save_pretrained(directory)
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2,
                    max_position_embeddings=context).save_pretrained(directory)
    return str(directory.resolve())


def read_scalars(tensorboard_dir: str) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} of what the run logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(tensorboard_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            steps.setdefault(event.step, {})[tag] = event.value
    return steps


def build_report(cfg, backend, scalars: dict[int, dict[str, float]], *,
                 warmup_steps: int = 1) -> dict:
    """The simulation's record: per step and overall, in model seconds. The overall figures
    leave out the first `warmup_steps` steps (the pipeline's fill: every run starts with no
    completion in flight) when later steps remain."""
    from megatron_rl.rollout.staleness import SCALAR_PREFIX

    cluster = backend.cluster
    scale = cluster.clock.time_scale
    k = cfg.rollout.max_off_policyness
    steps = []
    for step in sorted(s for s in scalars if s > 0 and "perf/step_seconds" in scalars[s]):
        m = scalars[step]
        steps.append({
            "step": step,
            "step_model_s": m["perf/step_seconds"] * scale,
            "gpu_hours": m["perf/step_seconds"] * scale * cluster.num_devices / 3600.0,
            "generator_busy_share": m.get("perf/generator_busy_fraction", math.nan),
            "trainer_idle_share": m.get("perf/trainer_idle_fraction", math.nan),
            "interruption_rate": m.get("rollout/interruption_rate", math.nan),
            "staleness_tokens": [m.get(f"{SCALAR_PREFIX}/lag_{lag}", 0.0)
                                 for lag in range(k + 1)],
        })
    engines = cluster.generators.engines + cluster.generators.retired
    limit = cluster.engine_settings.max_running_requests
    batches = [e.stats.max_batch for e in cluster.generators.engines]
    stats = cluster.engine_stats()
    counted = steps[warmup_steps:] or steps
    step_s = [s["step_model_s"] for s in counted]
    mean_step = statistics.fmean(step_s) if step_s else math.nan
    staleness = [sum(s["staleness_tokens"][lag] for s in counted) for lag in range(k + 1)]
    validation = {step: m["perf/validation_seconds"] * scale for step, m in sorted(scalars.items())
                  if "perf/validation_seconds" in m}

    def mean(key):
        values = [s[key] for s in counted if math.isfinite(s[key])]
        return statistics.fmean(values) if values else math.nan

    return {
        "recipe": cfg.name, "hardware": cluster.profile.name, "time_scale": scale,
        "token_granularity": cluster.engine_settings.token_granularity,
        "engines": len(cluster.generators.engines),
        "trainer_devices": cluster.layout.num_trainer_ranks,  # all of them when colocated
        "colocated": cluster.layout.colocated,
        "devices": cluster.num_devices, "max_off_policyness": k,
        "steps": steps,
        "overall": {
            "steps_counted": [s["step"] for s in counted],
            "step_model_s": mean_step,
            "gpu_hours_per_step": mean_step * cluster.num_devices / 3600.0,
            "generator_busy_share": mean("generator_busy_share"),
            "trainer_idle_share": mean("trainer_idle_share"),
            "interruption_rate": mean("interruption_rate"),
            "staleness_tokens": staleness,
            "max_running_requests": limit,
            "engine_max_batch": {"min": min(batches), "median": statistics.median(batches),
                                 "max": max(batches),
                                 "engines_at_limit": sum(b >= limit for b in batches)},
            "engine_retractions": stats["retractions"],
            "engine_busy_model_s": stats["busy_model_s"],
            "engine_max_lag_model_s": stats["max_lag_model_s"],
            "queue_wait_mean_model_s": stats["queue_wait_total_model_s"] / stats["admitted"]
            if stats["admitted"] else math.nan,
            "queue_wait_max_model_s": stats["queue_wait_max_model_s"],
            "validation_model_s": validation,
            "engines_restarted": len(cluster.generators.retired),
            "trainer_modelled_s": dict(cluster.trainers.modelled_s),
        },
    } | {"all_engines": len(engines)}


def print_report(report: dict) -> None:
    from rich.table import Table

    from megatron_rl.console import print_table, report_console

    console = report_console()
    k = report["max_off_policyness"]
    table = Table(title=f"simulated {report['recipe']} on {report['hardware']} "
                        f"({report['engines']} engines, {report['trainer_devices']} trainer "
                        f"devices; time scale {report['time_scale']:g})")
    for column in ("step", "step (model s)", "generator busy", "trainer idle", "interrupted",
                   f"staleness tokens (lag 0..{k})"):
        table.add_column(column, justify="right")
    for s in report["steps"]:
        table.add_row(str(s["step"]), f"{s['step_model_s']:.1f}",
                      f"{s['generator_busy_share']:.2f}", f"{s['trainer_idle_share']:.2f}",
                      f"{s['interruption_rate']:.2f}",
                      " ".join(f"{n:.0f}" for n in s["staleness_tokens"]))
    print_table(console, table)
    o = report["overall"]
    batch = o["engine_max_batch"]
    total = sum(o["staleness_tokens"]) or 1.0
    console.print(
        f"overall: step {o['step_model_s']:.1f} model s, {o['gpu_hours_per_step']:.3f} "
        f"GPU-hours per step; generator busy {o['generator_busy_share']:.2f}, trainer idle "
        f"{o['trainer_idle_share']:.2f}, interruption rate {o['interruption_rate']:.2f}\n"
        f"staleness (token share by lag 0..{k}): "
        + " ".join(f"{n / total:.2f}" for n in o["staleness_tokens"])
        + f"\nengine batch reached: min {batch['min']}, median {batch['median']:g}, max "
        f"{batch['max']} of max_running_requests {o['max_running_requests']} "
        f"({batch['engines_at_limit']} of {report['engines']} engines at it); "
        f"{o['engine_retractions']} KV retractions; engines fell behind the clock by at most "
        f"{o['engine_max_lag_model_s']:.1f} model s (large: lower --time-scale)\n"
        f"queue wait before admission: mean {o['queue_wait_mean_model_s']:.1f}, max "
        f"{o['queue_wait_max_model_s']:.1f} model s; validation: "
        + (", ".join(f"step {step}: {v:.1f} model s"
                     for step, v in o["validation_model_s"].items()) or "none run")
        + f"\noverall figures over steps {o['steps_counted']}")
    cost = report.get("cost_model")
    if cost and "error" in cost:
        console.print(f"cost model (megatron-rl cost) for this split: {cost['error']}")
    elif cost:
        console.print(f"cost model (megatron-rl cost) for this split: step {cost['step_s']:.1f} "
                      f"s, {cost['gpu_hours_per_step']:.3f} GPU-hours per step")
    sync = report.get("sync")
    if sync:
        console.print(
            f"synchronous (k = 0, {sync['output_dir']}): step {sync['step_model_s']:.1f} model s, "
            f"{sync['gpu_hours_per_step']:.3f} GPU-hours per step, generator busy "
            f"{sync['generator_busy_share']:.2f}, trainer idle {sync['trainer_idle_share']:.2f}"
            f"; speed-up of k = {k}: {report['speed_up']:.2f}x")


def simulate(cfg, backend, *, warmup_steps: int = 1) -> tuple[int, dict]:
    """Run the recipe's driver on `backend` (a SimulatedBackend) -> (exit status, report). A
    run that stops itself (NodeLost: a trainer node lost, exit 75) is reported as `megatron-rl
    train` reports it, one line and its exit status, and its report covers the steps it ran."""
    from megatron_rl.resilience.recovery import RunStopped
    from megatron_rl.train import train

    try:
        status = train(cfg, backend)
    except RunStopped as err:
        print(f"megatron-rl simulate: stopped: {err}", file=sys.stderr)
        status = getattr(err, "exit_status", 1)
    report = build_report(cfg, backend, read_scalars(cfg.tensorboard_dir),
                          warmup_steps=warmup_steps)
    report["exit_status"] = status
    report["output_dir"] = str(cfg.output_dir)
    cluster = backend.cluster
    report["cost_model"] = _cost_model(report, cluster)
    write_record(report)
    return status, report


def write_record(report: dict) -> None:
    (Path(report["output_dir"]) / "simulation.json").write_text(json.dumps(report, indent=1))


def _cost_model(report: dict, cluster) -> dict:
    from megatron_rl.simulation.sweep import analytic

    try:
        return analytic(cluster.engine_timing.model, generators=report["engines"],
                        devices_per_engine=cluster.layout.devices_per_generator,
                        trainer_devices=report["trainer_devices"],
                        k=report["max_off_policyness"],
                        token_granularity=report["token_granularity"])
    except ValueError as err:  # the cost model refuses the split (e.g. no KV room for one
        # sequence): the simulation's own figures stand; the comparison says why it is missing
        return {"error": str(err)}


def sync_summary(sync: dict) -> dict:
    """What a report keeps of its synchronous (k = 0) run."""
    o = sync["overall"]
    return {"output_dir": sync["output_dir"], "exit_status": sync["exit_status"],
            **{key: o[key] for key in ("step_model_s", "gpu_hours_per_step",
                                       "generator_busy_share", "trainer_idle_share",
                                       "queue_wait_mean_model_s", "engine_max_lag_model_s")},
            "cost_model": sync.get("cost_model")}


def add_sync(report: dict, sync: dict) -> None:
    from megatron_rl.simulation.sweep import speed_up

    report["sync"] = sync_summary(sync)
    report["speed_up"] = speed_up(sync["overall"]["step_model_s"],
                                  report["overall"]["step_model_s"])


class Runner:
    """Runs the recipe with extra overrides, each run into its own output_dir, sharing one
    stand-in model (written once) and the simulation settings."""

    def __init__(self, recipe: str, overrides: Sequence[str], settings, *,
                 faults: str | None = None, warmup_steps: int | None = None):
        from megatron_rl.config import load_config

        self.recipe, self.settings, self.faults = recipe, settings, faults
        self.warmup_steps = warmup_steps
        overrides = list(overrides)
        cfg = load_config(recipe, overrides)
        if not any(o.startswith("output_dir=") for o in overrides):
            overrides.append(f"output_dir={cfg.output_dir}_simulated")
            cfg = load_config(recipe, overrides)
        self.output_dir = str(cfg.output_dir)
        if cfg.model.hf_checkpoint is None:
            model = stand_in_model(Path(self.output_dir) / "simulated_model",
                                   context=cfg.rollout.max_sequence_tokens)
            overrides.append(f"model.hf_checkpoint={model}")
        self.overrides = [o for o in overrides if not o.startswith("output_dir=")]
        self.cfg = self.config()

    def config(self, extra: Sequence[str] = (), output_dir: str | None = None):
        from megatron_rl.config import load_config

        return load_config(self.recipe, self.overrides + list(extra)
                           + [f"output_dir={output_dir or self.output_dir}"])

    def run(self, extra: Sequence[str] = (), output_dir: str | None = None) -> tuple[int, dict]:
        from megatron_rl.simulation.cluster import SimulatedBackend

        cfg = self.config(extra, output_dir)
        plan = None
        if self.faults:
            from megatron_rl.simulation.faults import FaultPlan  # another module's interface

            plan = FaultPlan.parse(self.faults)
        backend = SimulatedBackend(self.settings,
                                   on_start=plan.install if plan is not None else None)
        warmup = self.warmup_steps if self.warmup_steps is not None \
            else cfg.rollout.max_off_policyness + 1
        status, report = simulate(cfg, backend, warmup_steps=warmup)
        if plan is not None:
            report["faults"] = plan.record()
            write_record(report)
        return status, report


def run_sweep(runner: Runner, grid: dict[str, list[int]]) -> tuple[int, dict]:
    """Every point of the grid, with a progress bar over the runs -> (worst exit status,
    record); the table, plot and record are written to OUTPUT_DIR_sweep/."""
    from megatron_rl.console import print_table, progress, report_console
    from megatron_rl.simulation import sweep

    cfg = runner.cfg
    points = sweep.grid_points(grid, generators=cfg.rollout.num_generators,
                               k=cfg.rollout.max_off_policyness)
    root = Path(f"{runner.output_dir}_sweep")
    rows, statuses = [], []
    bar = progress(points, desc="sweep", unit="run")
    for generators, k in bar:
        bar.set_postfix(generators=generators, k=k)
        status, report = runner.run(sweep.point_overrides(generators, k),
                                    output_dir=str(root / f"g{generators}_k{k}"))
        statuses.append(status)
        rows.append(sweep.sweep_row(report, report["cost_model"]) | {"exit_status": status})
    bar.close()
    sweep.add_speed_ups(rows)
    best = sweep.argmin(rows)
    cost_best = sweep.argmin(rows, key="cost_gpu_hours_per_step")
    title = (f"sweep of {cfg.name} on {runner.settings.hardware}: "
             f"{cfg.parallelism.world_size} trainer devices at every point")
    record = {"recipe": cfg.name, "hardware": runner.settings.hardware, "grid": grid,
              "trainer_devices": cfg.parallelism.world_size, "rows": rows,
              "argmin": {"generators": best["generators"], "k": best["k"],
                         "gpu_hours_per_step": best["gpu_hours_per_step"]},
              "cost_model_argmin": {"generators": cost_best["generators"], "k": cost_best["k"],
                                    "gpu_hours_per_step": cost_best["cost_gpu_hours_per_step"]}}
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps(record, indent=1))
    sweep.plot(rows, root / "sweep.png", title)
    console = report_console()
    print_table(console, sweep.sweep_table(rows, title))
    console.print(f"fewest GPU-hours per step (*): {best['generators']} engines, k = {best['k']}"
                  f" ({best['gpu_hours_per_step']:.3f}); the cost model's among these points: "
                  f"{cost_best['generators']} engines, k = {cost_best['k']} "
                  f"({cost_best['cost_gpu_hours_per_step']:.3f})\nrecord: {root / 'sweep.json'}, "
                  f"plot: {root / 'sweep.png'}")
    return max(statuses), record


def main(argv: Sequence[str]) -> int:
    from megatron_rl.config import ConfigError
    from megatron_rl.console import notice
    from megatron_rl.simulation.cluster import SimulationSettings
    from megatron_rl.simulation.sweep import parse_sweep

    args = build_parser().parse_intermixed_args(list(argv))
    overrides = list(args.overrides)
    try:
        extra, granularity, notices, child = as_simulated(args.recipe, overrides, steps=args.steps,
                                                   granularity=args.token_granularity)
        for line in notices:
            notice(line, program="megatron-rl simulate")
        overrides += extra
        grid = parse_sweep(args.sweep) if args.sweep else None
        if args.faults:
            from megatron_rl.simulation.faults import FaultPlan  # another module's interface

            FaultPlan.parse(args.faults)  # a bad spec fails here, before any run
        settings = SimulationSettings(hardware=args.hardware, time_scale=args.time_scale,
                                      token_granularity=granularity,
                                      max_running_requests=args.max_running_requests,
                                      median_tokens=args.median_tokens,
                                      engines_in_child_process=args.engines_in_child_process
                                      or child)
        runner = Runner(args.recipe, overrides, settings, faults=args.faults,
                        warmup_steps=args.warmup_steps)
    except (ConfigError, ValueError) as err:
        print(f"megatron-rl simulate: error: {err}", file=sys.stderr)
        return 2
    try:
        if grid is not None:
            status, _ = run_sweep(runner, grid)
            return status
        status, report = runner.run()
        if not args.no_sync and runner.cfg.rollout.max_off_policyness > 0 and status == 0:
            # k = 0 has no fill to drain: a few steps give its steady state (each waits for
            # the step's longest completion, the slow part of the simulation).
            steps = runner.cfg.train.num_steps if args.steps is not None \
                else min(runner.cfg.train.num_steps, SYNC_STEPS)
            sync_status, sync = runner.run(["rollout.max_off_policyness=0",
                                            f"train.num_steps={steps}"],
                                           output_dir=f"{runner.output_dir}_sync")
            add_sync(report, sync)
            write_record(report)
            status = status or sync_status
    except ConfigError as err:  # found once the run reads its data or checkpoint
        print(f"megatron-rl simulate: error: {err}", file=sys.stderr)
        return 2
    print_report(report)
    print(f"record: {Path(report['output_dir']) / 'simulation.json'}")
    return status
