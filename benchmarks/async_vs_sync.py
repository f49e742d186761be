"""Asynchronous vs synchronous RL: wall time of the loop of `megatron-rl train` for the same number
of optimizer steps under several schedules and weight-update pause modes, measured in the same
run.

Setup: the tiny recipe (examples/configs/tiny_pipeline.yaml: one SGLang CPU generator, one
Megatron trainer rank, Ray; 4 prompts x 4 samples per step) from a random tiny Llama written once
by tools/make_tiny_checkpoint.py into a temporary directory. Schedules (rollout.mode and
rollout.max_off_policyness k):

- sync (k = 0): the baseline; the generators produce a step's groups, then wait while the trainer
  trains and pushes the weights;
- pipeline k = 1, 2 and 4: Pipeline-RL; generation runs up to k steps ahead of the trainer and
  the weights are pushed in flight (weight_sync.pause_mode in_place: running requests keep their
  KV cache and go on with the new weights);
- pipeline k = 2 with pause_mode retract (running requests are requeued; their KV is recomputed
  with the new weights) and abort (they end and are resubmitted from what they generated);
- ppo_off_policy k = 2: 2 x prompts_per_step groups generated with one policy, then 2 steps.

Every run uses algorithm.zero_variance_filter=false (the random model solves nothing: with the
filter no step would train), eval.interval_steps=0, eval.at_step_zero=false and
checkpoint.interval_steps=0 (no validation or checkpoint inside or before the loop), and runs as
its own `python -m megatron_rl.cli train` subprocess (OMP_NUM_THREADS=1) so that Ray and SGLang
start and stop cleanly. The runs alternate (A B C D A B C D ...) so that slow drifts of the
machine hit all schedules alike.

What is timed is the loop, not start-up (Ray, SGLang, the checkpoint conversion): from each run's
TensorBoard scalars, loop seconds = the sum of perf/step_seconds over the N steps (take groups ->
train -> push weights; the first step includes filling the pipeline; the TensorBoard writes
between steps, ~1% of the first-to-last-step wall time on the tiny recipe, are left out). The
trainer's wait for rollouts is perf/trainer_wait_seconds and the weight push weight_sync/seconds,
both per step.

Reading the table (medians over the repeats, spread = min-max):
- loop s: loop seconds for N steps; s/step = loop s / N; after step 1: the mean step of steps
  2..N (the steady state: step 1 waits for the pipeline to fill, which with a larger k means more
  groups generated at once, so on short runs it weighs against larger k).
- wait share: the share of the loop the trainer spent waiting for rollouts (near 1: generation
  is the bottleneck; near 0: the step's groups were ready when the trainer asked).
- sync s/step, sync share: weight-sync seconds per step and their share of the loop.
- mean lag: the trained tokens' staleness in steps (rollout/staleness/mean_lag averaged over the
  steps), 0 for sync; requeued: groups regenerated because they went staler than k (the run's
  total).
- paused share: the share of the loop the generators were paused for weight updates (first pause
  request to last continue, weight_sync/paused_s); in_place keeps generating right up to it.
- gen busy: the share of the loop's wall time in which the generator had requests in flight and
  was not paused for a weight update (perf/generator_busy_fraction, weighted by step time); gen
  tok/s: completion tokens returned per second of loop (perf/generation_tokens_per_s).
- speed-up: the sync baseline's median loop seconds / this schedule's (> 1 = faster than sync),
  with the min-max of the per-repeat ratios (each repeat's sync run against its own run).

On a 2-core machine the generator and the trainer share the cores (with Ray, the driver and the
verifiers), so asynchrony cannot overlap much generation with training: there the ratio measures
the schedules' scheduling overhead (and contention), not the speed-up Pipeline-RL gives when
generators and trainers run on their own GPUs.

Run: .venv/bin/python benchmarks/async_vs_sync.py [--steps 8] [--repeats 3] [--keep-dir]
     [--only "sync (k=0)" --only "pipeline k=2" ...]
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "examples/configs/tiny_pipeline.yaml"

# (name, overrides): the order is the order of each round of runs; the first is the baseline.
VARIANTS: list[tuple[str, list[str]]] = [
    ("sync (k=0)", ["rollout.mode=pipeline", "rollout.max_off_policyness=0"]),
    ("pipeline k=1", ["rollout.mode=pipeline", "rollout.max_off_policyness=1"]),
    ("pipeline k=2", ["rollout.mode=pipeline", "rollout.max_off_policyness=2"]),
    ("pipeline k=4", ["rollout.mode=pipeline", "rollout.max_off_policyness=4"]),
    ("k=2 retract", ["rollout.mode=pipeline", "rollout.max_off_policyness=2",
                     "weight_sync.pause_mode=retract"]),
    ("k=2 abort", ["rollout.mode=pipeline", "rollout.max_off_policyness=2",
                   "weight_sync.pause_mode=abort"]),
    ("ppo_off_policy k=2", ["rollout.mode=ppo_off_policy", "rollout.max_off_policyness=2"]),
]
COMMON = ["algorithm.zero_variance_filter=false", "eval.interval_steps=0",
          "eval.at_step_zero=false", "checkpoint.interval_steps=0", "logging.progress_bar=false",
          "logging.log_interval=1"]
RUN_TIMEOUT_S = 1800


def train_command(checkpoint: str, output_dir: str, steps: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", "train", RECIPE, f"output_dir={output_dir}",
            f"model.hf_checkpoint={checkpoint}", f"train.num_steps={steps}", *COMMON, *overrides]


def run_process(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, str, float]:
    """Run `cmd` in its own session; on a timeout or Ctrl-C interrupt it (the driver tears Ray and
    SGLang down on KeyboardInterrupt), then kill its process group if it does not exit."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as err:
        _stop(proc)
        stdout, stderr = proc.communicate()
        if isinstance(err, KeyboardInterrupt):
            raise
        stderr += f"\n[async_vs_sync] timed out after {timeout:.0f} s"
        return -1, stdout, stderr, time.perf_counter() - started
    return proc.returncode, stdout, stderr, time.perf_counter() - started


def _stop(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def read_scalars(event_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(str(event_dir), size_guidance={SCALARS: 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()[SCALARS]}


def summarize(scalars: dict[str, dict[int, float]], steps: int) -> dict[str, float]:
    """The loop's numbers of one run from its TensorBoard scalars (steps 1..N)."""
    wanted = list(range(1, steps + 1))

    def per_step(tag: str) -> list[float]:
        values = scalars.get(tag, {})
        missing = [s for s in wanted if s not in values]
        if missing:
            raise RuntimeError(f"{tag}: no value for step(s) {missing}")
        return [values[s] for s in wanted]

    step_s, wait_s = per_step("perf/step_seconds"), per_step("perf/trainer_wait_seconds")
    sync_s = per_step("weight_sync/seconds")
    busy, tokens_per_s = per_step("perf/generator_busy_fraction"), \
        per_step("perf/generation_tokens_per_s")
    paused_s = per_step("weight_sync/paused_s")
    lag = scalars.get("rollout/staleness/mean_lag", {})
    loop = sum(step_s)
    return dict(loop_s=loop, step_s=loop / steps, wait_share=sum(wait_s) / loop,
                steady_s=sum(step_s[1:]) / (steps - 1) if steps > 1 else float("nan"),
                sync_s=sum(sync_s) / steps, sync_share=sum(sync_s) / loop,
                busy=sum(b * s for b, s in zip(busy, step_s)) / loop,
                paused_share=sum(paused_s) / loop,
                tokens_per_s=sum(t * s for t, s in zip(tokens_per_s, step_s)) / loop,
                mean_lag=statistics.mean(lag.values()) if lag else float("nan"),
                requeued=scalars.get("rollout/staleness/requeued", {}).get(steps, float("nan")),
                skipped=sum(scalars.get("train/skipped", {}).values()))


def tail(text: str, chars: int = 4000) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per schedule (alternating); "
                        "the table shows medians and min-max")
    parser.add_argument("--keep-dir", action="store_true", help="keep the temporary directory "
                        "(checkpoint, each run's output_dir with TensorBoard and generator logs)")
    parser.add_argument("--only", action="append", default=[], metavar="SCHEDULE",
                        help="run only these schedules (repeatable; the first listed is the "
                        f"baseline); choose from: {', '.join(n for n, _ in VARIANTS)}")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    known = dict(VARIANTS)
    unknown = [name for name in args.only if name not in known]
    if unknown:
        parser.error(f"--only {unknown}: unknown schedule(s); choose from {list(known)}")
    variants = [(name, known[name]) for name in args.only] if args.only else VARIANTS

    print("command:", shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])))
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; {args.steps} steps per run, {args.repeats} repeat(s) of "
          f"{len(variants)} schedules", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="async_vs_sync-"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results: dict[str, list[dict]] = {name: [] for name, _ in variants}
    try:
        checkpoint = tmp / "tiny_llama_checkpoint"
        proc = subprocess.run([sys.executable, "tools/make_tiny_checkpoint.py", str(checkpoint)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            print(f"make_tiny_checkpoint.py failed (rc {proc.returncode}):\n"
                  f"{tail(proc.stderr)}", file=sys.stderr)
            return 1
        example = train_command(str(checkpoint), str(tmp / "runs" / "NAME"), args.steps,
                                variants[0][1])
        print("each run:", shlex.join(example), "(with the schedule's rollout.* overrides)",
              flush=True)
        total = args.repeats * len(variants)
        for repeat in range(args.repeats):
            for index, (name, overrides) in enumerate(variants):
                number = repeat * len(variants) + index + 1
                slug = name.split(" (")[0].replace(" ", "_").replace("=", "")
                out = tmp / "runs" / f"r{repeat + 1}_{index}_{slug}"
                cmd = train_command(str(checkpoint), str(out), args.steps, overrides)
                rc, stdout, stderr, wall = run_process(cmd, env, RUN_TIMEOUT_S)
                if rc != 0:
                    print(f"[{number}/{total}] {name}: FAILED (rc {rc}) after {wall:.0f} s\n"
                          f"command: {shlex.join(cmd)}\n--- stdout tail ---\n{tail(stdout, 2000)}"
                          f"\n--- stderr tail ---\n{tail(stderr)}", file=sys.stderr)
                    return 1
                row = summarize(read_scalars(out / "tensorboard"), args.steps)
                row["process_s"] = wall
                results[name].append(row)
                print(f"[{number}/{total}] {name:<18} loop {row['loop_s']:7.2f} s "
                      f"({row['step_s']:.2f} s/step, wait {row['wait_share']:.0%}, "
                      f"sync {row['sync_s']:.2f} s/step, gen busy {row['busy']:.0%})  "
                      f"whole process {wall:.0f} s"
                      + (f"  WARNING: {row['skipped']:.0f} step(s) skipped"
                         if row["skipped"] else ""), flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep_dir:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(results, args.steps)
    return 0


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _spread(rows: list[dict], key: str, fmt: str) -> str:
    values = [r[key] for r in rows]
    return f"{format(min(values), fmt)}-{format(max(values), fmt)}"


def print_table(results: dict[str, list[dict]], steps: int) -> None:
    from rich.console import Console
    from rich.table import Table

    baseline = next(iter(results.values()))
    base_median = _median(baseline, "loop_s")
    table = Table(title=f"loop of megatron-rl train, tiny recipe, {steps} steps: median "
                        f"(min-max) over {len(baseline)} run(s) each, same run")
    for column in ("schedule", "loop s", "s/step", "after step 1", "wait share", "sync s/step",
                   "sync share", "paused share", "gen busy", "gen tok/s", "mean lag", "requeued",
                   f"speed-up vs {next(iter(results))}"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for name, rows in results.items():
        ratios = [b["loop_s"] / r["loop_s"] for b, r in zip(baseline, rows)]
        speed_up = base_median / _median(rows, "loop_s")
        table.add_row(
            name,
            f"{_median(rows, 'loop_s'):.2f} ({_spread(rows, 'loop_s', '.2f')})",
            f"{_median(rows, 'step_s'):.2f}",
            f"{_median(rows, 'steady_s'):.2f}",
            f"{_median(rows, 'wait_share'):.0%} ({_spread(rows, 'wait_share', '.0%')})",
            f"{_median(rows, 'sync_s'):.3f} ({_spread(rows, 'sync_s', '.3f')})",
            f"{_median(rows, 'sync_share'):.1%}",
            f"{_median(rows, 'paused_share'):.1%}",
            f"{_median(rows, 'busy'):.2f} ({_spread(rows, 'busy', '.2f')})",
            f"{_median(rows, 'tokens_per_s'):.0f}",
            f"{_median(rows, 'mean_lag'):.2f}",
            f"{_median(rows, 'requeued'):.0f}",
            f"{speed_up:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    Console(width=220).print(table)
    print("speed-up = sync median loop s / schedule's; in brackets the per-repeat ratios. On 2 "
          "cores generator and trainer share the CPU: the ratio is scheduling overhead, not the "
          "GPU speed-up (see the module docstring).")


if __name__ == "__main__":
    sys.exit(main())
