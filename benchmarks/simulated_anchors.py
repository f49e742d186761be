"""The simulator against published async-vs-sync figures (../shared/ANCHOR_FIGURES.md; issue 38):
each published case configured from its publisher's settings (GPUs and their split, prompts x
samples per step, response lengths, engine TP, staleness k), simulated twice with the real
driver (megatron_rl/train.py through `simulate`): the synchronous baseline, colocated as
published (generation and training alternate on all the GPUs), and the asynchronous setting on
split GPUs. Prints the simulated step times and speed-up beside the published ones.

    python benchmarks/simulated_anchors.py                 # every case
    python benchmarks/simulated_anchors.py --case nemo-qwen3-30b-1off --steps 3

ONE calibration for every case (CALIBRATION below: the cost model's default efficiency knobs,
with the engines' memory overhead factor at 1.0 because the publishers' gpu_memory_utilization
already budgets activations); nothing is tuned per case. What a publisher did not state is
assumed once, in the case's `assumed` text (docs/simulation.md, "Against published figures").

What bounds the run time here: the real client and driver spend ~3 ms of CPU a request, and
the clock's time scale multiplies every wall second the process spends into model time, so a
case must keep its requests per step few and its time scale low. The verl cases (512 prompts x
16 samples a step) therefore run a data-parallel fraction of the published cluster (`fraction`:
1/8 of the GPUs and of the prompts, each engine and trainer device with the published load);
the NeMo-RL cases run whole but the 8-step-off one (1/4: its requests in flight).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The cost model's efficiency knobs at their defaults (scaling/cost.py) on every case, the
# decode floor (decode_layer_overhead_us, decode_tp_layer_overhead_us) included at its fitted
# defaults (benchmarks/decode_floor_fit.py) and the trainer floor (train_min_tokens_per_device,
# benchmarks/trainer_floor_fit.py) too; the engines' memory overhead factor 1.0 (the
# publishers' memory-utilisation setting is the static fraction, activations included).
CALIBRATION = dict(decode_bandwidth_efficiency=0.6, decode_mfu=0.5, prefill_mfu=0.5,
                   train_mfu=0.4, memory_overhead_factor=1.0, max_running_requests=256)
# Completion lengths: lognormal with this sigma (p99 = 5x the median), its median solved so that
# the capped mean is the case's mean generated length. No publisher gives the distribution.
SIGMA = 0.7


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    source: str
    shape: str  # simulation/anchors.py SHAPES
    hardware: str
    prompts: int  # per optimizer step (per weight sync)
    samples: int
    prompt_tokens: int  # mean prompt length
    max_response: int
    mean_response: float
    engine_tp: int
    mem_fraction: float  # the engines' gpu_memory_utilization
    sync_gpus: int | None  # colocated baseline (None: no baseline)
    async_gen_gpus: int
    async_train_gpus: int
    k: int  # max_off_policyness of the async run
    published_sync_s: float | None
    published_async_s: float
    published_speedup: float | None
    fraction: float = 1.0  # data-parallel share of the published cluster simulated
    assumed: str = ""
    sync_split: bool = False  # the baseline on the async split (k = 0), not colocated
    # Steps a run at least: k = 8 admits 9 steps' prompts at once, and the steps after the
    # first take groups already generated until the pipeline is in its steady state.
    min_steps: int = 0
    # The published baseline's trainer recomputes the old policy's log-probs before each step
    # (SimulationSettings.recompute_old_logprobs): verl's colocated runs (their old_log_prob
    # column); its async runs take the rollout's (use_rollout_log_probs=True: no pass).
    baseline_recomputes_logprobs: bool = False
    # Optimizer steps a step's batch is split into (cost.CostConfig.optimizer_steps_per_step:
    # the trainer floor counts per optimizer step): verl train_batch / ppo_mini_batch, NeMo-RL
    # G-GBS / T-GBS, as published.
    optimizer_steps: int = 1


def _verl(gpus: int, sync_s: float, async_s: float, speedup: float, **kw) -> Case:
    half = gpus // 2
    fraction = kw.pop("fraction", 1 / 8 if gpus >= 64 else 1 / 4)
    base = dict(
        name=f"verl-7b-{gpus}", shape="qwen2.5-math-7b", hardware="H20", prompts=512,
        samples=16, prompt_tokens=200, max_response=28 * 1024, mean_response=1200.0,
        engine_tp=4, mem_fraction=0.8, sync_gpus=gpus, async_gen_gpus=half,
        async_train_gpus=half, k=1, baseline_recomputes_logprobs=True,
        optimizer_steps=512 // 32,  # train_batch_size / ppo_mini_batch_size
        published_sync_s=sync_s, published_async_s=async_s,
        published_speedup=speedup, fraction=fraction,
        source="verl docs/advance/fully_async.md @df340d70 (ANCHOR_FIGURES 1), 400-step totals",
        assumed="mean response 1200 tokens (unpublished: the published update_actor times at "
                "the calibration's train_mfu 0.4 imply 1370 (32 GPUs) and 1090 (16 GPUs, 10K) "
                "tokens a sample with the prompt), prompt ~200; baseline vLLM TP4 as the async "
                "scripts; staleness 0.5 + partial rollout as k = 1")
    return Case(**(base | kw))


# Published step times: the 400-step (verl 1d: 50-step) total / steps, where the doc gives
# totals; NeMo-RL: its step time.
CASES: dict[str, Case] = {c.name: c for c in (
    _verl(32, 3 * 86400 / 400 + 17 * 3600 / 400 + 5 * 60 / 400, 33 * 3600 / 400 + 26 * 60 / 400,
          2.66),
    _verl(64, 41 * 3600 / 400 + 32 * 60 / 400, 21 * 3600 / 400 + 40 * 60 / 400, 1.92),
    _verl(128, 40 * 3600 / 400 + 48 * 60 / 400, 17 * 3600 / 400 + 22 * 60 / 400, 2.35),
    _verl(128, 40 * 3600 / 400 + 48 * 60 / 400, 25 * 3600 / 400 + 53 * 60 / 400, 1.58,
          name="verl-7b-128-stream-k0", k=0,
          assumed="as verl-7b-128; the 'stream off-policy pipeline, staleness 0' row: k = 0 on "
                  "the 64:64 split against the colocated baseline"),
    _verl(16, 484.623, 489.953, (7 * 60 + 9) / (7 * 60 + 2),
          name="verl-7b-16-10k", max_response=10 * 1024, fraction=1 / 4, engine_tp=2,
          source="verl fully_async.md 'use_trainer_do_validate' (ANCHOR_FIGURES 1d): per-step "
                 "times; speed-up of the 50-step totals incl. validation",
          assumed="as verl-7b-32 with a 10K response cap; engine TP2 (unpublished for this "
                  "run); validation not simulated"),
    Case(name="nemo-dsv3-1off", shape="deepseek-v3", hardware="H100", prompts=32, samples=16,
         prompt_tokens=150, max_response=1536 - 150, mean_response=701.0, engine_tp=32,
         mem_fraction=0.8, sync_gpus=512, async_gen_gpus=256, async_train_gpus=256, k=1,
         published_sync_s=111.0, published_async_s=64.1, published_speedup=111.0 / 64.1,
         source="NeMo-RL performance-summary v0.6 (ANCHOR_FIGURES 5a)",
         assumed="prompt 150 tokens (unpublished; G-avg taken as generated only); BF16"),
    Case(name="nemo-qwen3-235b-1off", shape="qwen3-235b-a22b", hardware="H100", prompts=16,
         samples=32, prompt_tokens=150, max_response=8192 - 150, mean_response=5713.0,
         engine_tp=16, mem_fraction=0.9, sync_gpus=256, async_gen_gpus=128,
         async_train_gpus=128, k=1, published_sync_s=312.0, published_async_s=231.0,
         published_speedup=312.0 / 231.0, source="NeMo-RL performance-summary v0.6 (5a)",
         assumed="prompt 150; gpu_memory_utilization 0.9 (unpublished); the async engines' "
                 "TP8 (published) is not simulated: one engine TP for both runs, TP16"),
    Case(name="nemo-qwen3-30b-1off", shape="qwen3-30b-a3b", hardware="H100", prompts=64,
         samples=32, prompt_tokens=150, max_response=4096 - 150, mean_response=3203.0,
         engine_tp=2, mem_fraction=0.9, sync_gpus=32, async_gen_gpus=16, async_train_gpus=16,
         k=1, optimizer_steps=2048 // 512,  # G-GBS / T-GBS
         published_sync_s=192.0, published_async_s=152.0, published_speedup=192.0 / 152.0,
         source="NeMo-RL performance-summary v0.6 (5a)",
         assumed="prompt 150; gpu_memory_utilization 0.9 (unpublished)"),
    Case(name="nemo-qwen3-30b-8off", shape="qwen3-30b-a3b", hardware="H100", prompts=64,
         samples=32, prompt_tokens=150, max_response=4096 - 150, mean_response=3206.0,
         engine_tp=2, mem_fraction=0.9, sync_gpus=None, async_gen_gpus=64,
         async_train_gpus=128, k=8, optimizer_steps=2048 // 512, published_sync_s=None,
         published_async_s=34.5,
         published_speedup=None, source="NeMo-RL performance-summary v0.6 (5a)", fraction=1 / 4,
         min_steps=12,
         assumed="as nemo-qwen3-30b-1off; no same-GPU baseline published (step time only); "
                 "1/4 of it: (8 + 1) x 2048 requests in flight exceed the ~9000 one process "
                 "holds open (docs/simulation.md, open files)"),
)}


def median_for_mean(mean: float, cap: float, sigma: float = SIGMA) -> float:
    """The lognormal median whose mean, capped at `cap`, is `mean`."""
    from scipy import optimize, stats

    def capped_mean(median: float) -> float:
        mu = math.log(median)
        z = (math.log(cap) - mu) / sigma
        return (math.exp(mu + sigma ** 2 / 2) * stats.norm.cdf(z - sigma)
                + cap * stats.norm.sf(z))

    return optimize.brentq(lambda m: capped_mean(m) - mean, 1.0, cap)


def granularity(case: Case) -> int:
    """Model tokens per returned token: ~32 returned tokens for a mean completion (the client's
    per-token cost against the length distribution's resolution), a power of two."""
    return max(1, 2 ** round(math.log2(case.mean_response / 32)))


def run_one(case: Case, *, colocated: bool, steps: int, time_scale: float, work: Path) -> dict:
    """One simulation of `case` (the baseline when `colocated`, else the async split)."""
    from megatron_rl.config import load_config
    from megatron_rl.simulation.anchors import SHAPES
    from megatron_rl.simulation.cluster import SimulatedBackend, SimulationSettings
    from megatron_rl.simulation.simulate import simulate, stand_in_model

    g = granularity(case)
    steps = max(steps, case.min_steps)
    scale = case.fraction
    prompts = max(1, round(case.prompts * scale))
    if colocated:
        gpus = round(case.sync_gpus * scale)
        engines, trainer, k = gpus // case.engine_tp, gpus, 0
    else:
        engines = round(case.async_gen_gpus * scale) // case.engine_tp
        trainer = round(case.async_train_gpus * scale)
        k = 0 if case.sync_split else case.k
    if engines < 1:
        raise ValueError(f"{case.name}: fraction {scale} leaves no whole engine of "
                         f"{case.engine_tp} GPUs")
    budget = math.ceil(case.max_response / g)
    median = median_for_mean(case.mean_response / g, budget)
    out = work / f"{case.name}-{'sync' if colocated else 'async'}"
    # One-token prompts: a prompt token stands for g model tokens too, so the prompts are as
    # short as the stand-in tokenizer makes them (prompt_units(), ~1-2 tokens: g-2g model
    # tokens); the verifiers grade them (every reward 0).
    num_prompts = prompts * (steps + k + 4) + 64
    prompts_file = work / f"prompts-{num_prompts}.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"p{i}", "task": "math", "prompt": "1",
                                                "answer": "1"}) + "\n"
                                    for i in range(num_prompts)))
    prompt_units = 16
    model_dir = stand_in_model(work / f"model-{case.name}",  # its context fits this case
                               context=4 * (prompt_units + budget + 8))
    overrides = [
        f"output_dir={out}", f"model.hf_checkpoint={model_dir}",
        f"data.prompts={prompts_file}",
        f"rollout.num_generators={engines}", f"rollout.tp_size={case.engine_tp}",
        "rollout.ep_size=1",
        f"parallelism.world_size={trainer}", "parallelism.tensor_model_parallel_size=1",
        "parallelism.pipeline_model_parallel_size=1", "parallelism.expert_model_parallel_size=1",
        "parallelism.sequence_parallel=false",
        f"rollout.max_off_policyness={k}", f"cluster.colocated={str(colocated).lower()}",
        f"rollout.samples_per_prompt={case.samples}",
        f"train.global_batch_size={prompts * case.samples}", f"train.num_steps={steps}",
        f"rollout.max_prompt_tokens={prompt_units}", "rollout.forced_interruption=false",
        f"rollout.thinking_budget={budget}", f"rollout.thinking_budget_min={budget}",
        "rollout.solution_budget=1", f"rollout.mem_fraction_static={case.mem_fraction}",
        f"train.micro_batch_max_tokens={prompt_units + budget + 8}", "eval.interval_steps=0",
        "eval.at_step_zero=false", "eval.num_heldout_prompts=8",
        "algorithm.zero_variance_filter=false", "logging.progress_bar=false",
        "checkpoint.interval_steps=100000", "rollout.no_progress_timeout_s=3600"]
    cfg = load_config("examples/llama4_scout/gb200_1rack.yaml", overrides)
    model = SHAPES[case.shape].cost_config(hardware=case.hardware,
                                           mem_fraction_static=case.mem_fraction,
                                           optimizer_steps_per_step=case.optimizer_steps,
                                           **CALIBRATION)
    backend = SimulatedBackend(SimulationSettings(
        hardware=case.hardware, model=model, token_granularity=g, median_tokens=median,
        sigma=SIGMA, time_scale=time_scale, max_running_requests=CALIBRATION[
            "max_running_requests"],
        recompute_old_logprobs=colocated and case.baseline_recomputes_logprobs))
    began = time.perf_counter()
    status, report = simulate(cfg, backend)
    if status != 0:
        raise RuntimeError(f"{case.name}: the simulated run exited {status}; see {out}")
    steps_s = [s["step_model_s"] for s in report["steps"]]
    measured = steps_s[1:] if len(steps_s) > 1 else steps_s  # the first fills the pipeline
    o = report["overall"]
    return {"step_s": statistics.fmean(measured), "steps_s": steps_s,
            "wall_s": time.perf_counter() - began, "engines": engines, "trainer": trainer,
            "k": k, "granularity": g, "fraction": scale,
            "generator_busy": o["generator_busy_share"], "trainer_idle": o["trainer_idle_share"],
            "engine_max_lag_model_s": o["engine_max_lag_model_s"],
            "trainer_modelled_s": o["trainer_modelled_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="run only these (repeatable); default every case")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps a run (the first "
                        "is not measured)")
    parser.add_argument("--time-scale", type=float, default=10.0,
                        help="model seconds per wall second (low: the process's own CPU time "
                             "counts x this as cluster time)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    results = {}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="anchors-") as tmp:
        for name in args.case or list(CASES):
            case = CASES[name]
            result = {"case": dataclasses.asdict(case)}
            if case.sync_gpus is not None:
                result["sync"] = run_one(case, colocated=not case.sync_split, steps=args.steps,
                                         time_scale=args.time_scale, work=Path(tmp))
            result["async"] = run_one(case, colocated=False, steps=args.steps,
                                      time_scale=args.time_scale, work=Path(tmp))
            results[name] = result
            print_row(name, result, flush=True)
            if args.json:  # after each case: a later one may fail
                args.json.write_text(json.dumps(results, indent=1))
    print(f"all cases: {time.perf_counter() - began:.0f} s wall")
    return 0


def print_row(name: str, result: dict, flush: bool = False) -> None:
    case = result["case"]
    sync, asyn = result.get("sync"), result["async"]
    sim_speedup = sync["step_s"] / asyn["step_s"] if sync else math.nan
    pub_sync = case["published_sync_s"]
    pub_speed = case["published_speedup"]
    print(f"{name}: published sync {pub_sync or math.nan:.1f} s, async "
          f"{case['published_async_s']:.1f} s, speed-up {pub_speed or math.nan:.2f}x | "
          f"simulated sync {sync['step_s'] if sync else math.nan:.1f} s, async "
          f"{asyn['step_s']:.1f} s, speed-up {sim_speedup:.2f}x | wall "
          f"{(sync['wall_s'] if sync else 0) + asyn['wall_s']:.0f} s", flush=flush)
    print("   " + json.dumps({"sync": sync, "async": asyn}), flush=flush)


if __name__ == "__main__":
    sys.exit(main())
