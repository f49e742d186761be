"""The real control plane (megatron_rl/train.py's driver, the rollout manager, the async client,
forced interruption, the weight push, the ledger) against 256 simulated engines (Scout's recipe
at 16 NVL72 racks: 256 engines x 4 GB200, 128 trainer GPUs) until about --requests generation
requests have been served, with as many in flight as this machine's open-file limit allows.
Prints the wall time, the requests the engines served and the simulator's report.

    python benchmarks/simulated_256_engines.py                    # ~100k requests
    python benchmarks/simulated_256_engines.py --steps 2 --prompts-per-step 128   # the test's size

Why not 100k in flight: the real client holds one socket per request in flight (rollout/
async_client.py) and run_setup reserves (k + 1) x prompts per step x 16 + the validation's
requests + 1,024 descriptors before it starts; the hard RLIMIT_NOFILE here is 20,000, so at most
18,976 requests can be in flight in one driver process (production machines raise the limit;
async_client.reserve_open_files names it). The engines run in a child process
(SimulationSettings.engines_in_child_process) so the driver's side is one descriptor per
request. The default here: k = 1, 512 prompts x 16 per step, 16,384 requests in flight (64 per
engine); each sample is two requests (forced interruption's continuation), so --requests
100000 is about 6 steps.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path


def run(args: argparse.Namespace, out: Path) -> dict:
    from megatron_rl.config import load_config
    from megatron_rl.resilience.ledger import check_ledger, read_jsonl
    from megatron_rl.scaling.cost import PRESETS
    from megatron_rl.simulation.cluster import SimulatedBackend, SimulationSettings
    from megatron_rl.simulation.simulate import simulate, stand_in_model

    samples = 16
    in_flight = (args.k + 1) * args.prompts_per_step * samples
    steps = args.steps or max(1, math.ceil(args.requests / (2 * args.prompts_per_step * samples))
                              - args.k)
    model = stand_in_model(out / "model", context=4096)
    cfg = load_config("examples/llama4_scout/gb200_1rack.yaml", [
        f"output_dir={out / 'run'}", f"model.hf_checkpoint={model}",
        "data.prompts=rg/basic_arithmetic",
        f"data.num_generated_prompts={(steps + args.k + 1) * args.prompts_per_step + 200}",
        f"rollout.num_generators={args.engines}", "parallelism.world_size=128",
        f"rollout.max_off_policyness={args.k}",
        f"train.global_batch_size={args.prompts_per_step * samples}",
        f"train.num_steps={steps}",
        "rollout.max_prompt_tokens=256", "rollout.thinking_budget=8",
        "rollout.thinking_budget_min=6", "rollout.solution_budget=4",
        "train.micro_batch_max_tokens=512", "eval.interval_steps=0", "eval.at_step_zero=false",
        "eval.num_heldout_prompts=8", "algorithm.zero_variance_filter=false",
        "logging.progress_bar=false", "rollout.no_progress_timeout_s=900"])
    backend = SimulatedBackend(SimulationSettings(
        hardware="GB200", model=PRESETS["scout-gb200"],
        max_running_requests=in_flight // args.engines, token_granularity=64,
        median_tokens=200, sigma=0.0, time_scale=args.time_scale,
        engines_in_child_process=True))
    started = time.perf_counter()
    status, report = simulate(cfg, backend)
    wall = time.perf_counter() - started
    engines = backend.cluster.generators.engines
    stats = [e.stats for e in engines]
    records = read_jsonl(out / "run" / "ledger.jsonl")
    return {"exit_status": status, "wall_s": round(wall, 1), "engines": len(engines),
            "steps": steps, "requests_in_flight": in_flight,
            "requests_served": sum(len(s.admission_order) for s in stats),
            "max_batch_min": min(s.max_batch for s in stats),
            "ledger": check_ledger(records), "overall": report["overall"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=256)
    parser.add_argument("--prompts-per-step", type=int, default=512)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=0, help="0: from --requests")
    parser.add_argument("--time-scale", type=float, default=200.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(args, Path(tmp)), indent=1))


if __name__ == "__main__":
    main()
