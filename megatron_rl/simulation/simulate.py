"""`megatron-rl simulate RECIPE.yaml [--hardware GB200] [--steps N] [--time-scale X] [overrides]`:
the recipe's real control plane (megatron_rl/train.py's driver, the rollout manager, the async
client, GeneratorHealth, validation, checkpoints, the ledger) against the simulated cluster
(simulation/cluster.py, chosen here and only here through cluster/backend.py's seam), then a
report per step and overall, read from what the run itself logged (TensorBoard) and the
engines' statistics: step time in model seconds, GPU-hours per step, generator busy share,
trainer idle share, the per-token staleness histogram, the engine batch sizes reached against
max_running_requests, the interruption rate; a JSON record in output_dir/simulation.json.

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
verifiers (which give 0). Not yet: --faults, --sweep, the synchronous (k = 0) comparison run."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl simulate", epilog=USAGE_EPILOG,
        description="run a recipe's real control plane against simulated engines and trainer")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    parser.add_argument("--hardware", default="GB200",
                        help="hardware profile: H100, H200, B200, GB200, H20, cpu (default GB200)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps to simulate (default: the recipe's num_steps)")
    parser.add_argument("--time-scale", type=float, default=100.0,
                        help="model seconds per wall second (default 100)")
    parser.add_argument("--token-granularity", type=int, default=1,
                        help="model tokens per returned token (the recipe's token budgets are "
                             "then in these units; docs/simulation.md)")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="per engine (default: the cost model's 256)")
    parser.add_argument("--engines-in-child-process", action="store_true",
                        help="serve the engines from a child process: one open file per request "
                             "in flight in the driver instead of two (over ~9000 in flight)")
    parser.add_argument("--median-tokens", type=float, default=None,
                        help="median completion length (default: half the thinking budget)")
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


def build_report(cfg, backend, scalars: dict[int, dict[str, float]]) -> dict:
    """The simulation's record: per step and overall, in model seconds."""
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
    step_s = [s["step_model_s"] for s in steps]
    mean_step = statistics.fmean(step_s) if step_s else math.nan
    staleness = [sum(s["staleness_tokens"][lag] for s in steps) for lag in range(k + 1)]

    def mean(key):
        values = [s[key] for s in steps if math.isfinite(s[key])]
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
        f"{o['engine_max_lag_model_s']:.1f} model s (large: lower --time-scale)")


def simulate(cfg, backend) -> tuple[int, dict]:
    """Run the recipe's driver on `backend` (a SimulatedBackend) -> (exit status, report)."""
    from megatron_rl.train import train

    status = train(cfg, backend)
    report = build_report(cfg, backend, read_scalars(cfg.tensorboard_dir))
    report["exit_status"] = status
    out = Path(cfg.output_dir) / "simulation.json"
    out.write_text(json.dumps(report, indent=1))
    return status, report


def main(argv: Sequence[str]) -> int:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.simulation.cluster import SimulatedBackend, SimulationSettings

    args = build_parser().parse_intermixed_args(list(argv))
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.num_steps={args.steps}")
    try:
        cfg = load_config(args.recipe, overrides)
        if not any(o.startswith("output_dir=") for o in overrides):
            overrides.append(f"output_dir={cfg.output_dir}_simulated")
        cfg = load_config(args.recipe, overrides)
        if cfg.model.hf_checkpoint is None:
            model = stand_in_model(Path(cfg.output_dir) / "simulated_model",
                                   context=cfg.rollout.max_sequence_tokens)
            cfg = load_config(args.recipe, overrides + [f"model.hf_checkpoint={model}"])
        settings = SimulationSettings(hardware=args.hardware, time_scale=args.time_scale,
                                      token_granularity=args.token_granularity,
                                      max_running_requests=args.max_running_requests,
                                      median_tokens=args.median_tokens,
                                      engines_in_child_process=args.engines_in_child_process)
    except (ConfigError, ValueError) as err:
        print(f"megatron-rl simulate: error: {err}", file=sys.stderr)
        return 2
    status, report = simulate(cfg, SimulatedBackend(settings))
    print_report(report)
    print(f"record: {Path(cfg.output_dir) / 'simulation.json'}")
    return status
