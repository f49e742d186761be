"""The simulator against real runs on this machine: the tiny recipe (examples/configs/
tiny_pipeline.yaml: one SGLang CPU generator, one Megatron trainer rank, 4 prompts x 4 samples
per step) at k = 0, 1, 2 (rollout.max_off_policyness), run for real (`megatron-rl train`, Ray,
SGLang, Megatron) and simulated (`megatron-rl simulate --hardware cpu`: the same driver against a
simulated engine and trainer timed by the measured `cpu` profile, benchmarks/cpu_profile.py),
`--repeats` times each, alternating (real k=0, simulated k=0, real k=1, ...) so that drifts of
the machine's load hit both alike.

Both runs get the same recipe and overrides: the same engine count, batch, token budgets and
steps; algorithm.zero_variance_filter=false (the random model solves nothing; with the filter no
step would train), no evaluation or checkpoints inside the loop. The simulated one also gets
--time-scale 1 (model time = wall time: the real driver's own CPU time then counts once, as in
the real run) and --median-tokens 1e6: the random tiny model almost never samples EOS, so every
real completion runs to its budget; a huge median makes every simulated one do the same.

Compared over steps 2..N (step 1 fills the pipeline and includes start-up effects), from each
run's TensorBoard scalars:
- step time: mean perf/step_seconds (simulated: x time scale = model seconds);
- generator busy share: perf/generator_busy_fraction weighted by step time;
- staleness histogram: the trained tokens' share at lag 0..k (rollout/staleness/lag_*);
- besides, to place a gap: the generator's completion tokens per second of step
  (perf/generation_tokens_per_s weighted by step time), the trainer's perf/train_seconds and
  weight_sync/seconds per step.
The table gives medians and the spread (min-max) over repeats, and the error of the medians
against the goals of issue 38: 15 % on step time, 0.05 on busy share.

On this 2-core machine a real run's engine, trainer rank, driver and Ray share the cores (and
other work on the machine shares them too: the load average is printed before and after); the
`cpu` profile was measured one process at a time, so contention is not in its figures.

Run: .venv/bin/python benchmarks/simulate_vs_real.py [--steps 8] [--repeats 3] [--ks 0,1,2]
     [--keep-dir]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's megatron_rl, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks"))
from async_vs_sync import COMMON, RECIPE, read_scalars, run_process, tail  # noqa: E402

RUN_TIMEOUT_S = 900
GOAL_STEP = 0.15  # relative error of the median step time (issue 38)
GOAL_BUSY = 0.05  # absolute error of the median generator busy share


def command(kind: str, checkpoint: str, out: str, steps: int, k: int) -> list[str]:
    overrides = [f"output_dir={out}", f"model.hf_checkpoint={checkpoint}",
                 f"train.num_steps={steps}", *COMMON, "rollout.mode=pipeline",
                 f"rollout.max_off_policyness={k}"]
    if kind == "real":
        return [sys.executable, "-m", "megatron_rl.cli", "train", RECIPE, *overrides]
    return [sys.executable, "-m", "megatron_rl.cli", "simulate", RECIPE, "--hardware", "cpu",
            "--time-scale", "1", "--median-tokens", "1e6", *overrides]


def summarize(scalars: dict[str, dict[int, float]], steps: int, k: int,
              time_scale: float = 1.0) -> dict:
    """Steps 2..N of one run: mean step (s), busy share, staleness shares, train and sync s."""
    wanted = list(range(2, steps + 1))

    def per_step(tag: str) -> list[float]:
        values = scalars.get(tag, {})
        missing = [s for s in wanted if s not in values]
        if missing:
            raise RuntimeError(f"{tag}: no value for step(s) {missing}")
        return [values[s] for s in wanted]

    step_s = [s * time_scale for s in per_step("perf/step_seconds")]
    busy = per_step("perf/generator_busy_fraction")
    lags = [sum(scalars.get(f"rollout/staleness/lag_{lag}", {}).get(s, 0.0) for s in wanted)
            for lag in range(k + 1)]
    total = sum(lags) or 1.0
    return {"step_s": statistics.fmean(step_s),
            "busy": sum(b * s for b, s in zip(busy, step_s)) / sum(step_s),
            "staleness": [n / total for n in lags],
            "gen_tok_s": sum(t * s for t, s in zip(per_step("perf/generation_tokens_per_s"),
                                                   step_s)) / sum(step_s),
            "train_s": statistics.fmean(per_step("perf/train_seconds")) * time_scale,
            "sync_s": statistics.fmean(per_step("weight_sync/seconds")) * time_scale}


def _med(rows: list[dict], key: str, index: int | None = None) -> float:
    return statistics.median(r[key] if index is None else r[key][index] for r in rows)


def _cell(rows: list[dict], key: str, fmt: str, index: int | None = None) -> str:
    values = [r[key] if index is None else r[key][index] for r in rows]
    return (f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-"
            f"{format(max(values), fmt)})")


def print_table(results: dict, steps: int) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tiny recipe, steps 2..{steps}: median (min-max) over the repeats")
    for column in ("k", "run", "step s", "gen busy", "staleness share lag 0..k", "gen tok/s",
                   "train s", "sync s"):
        table.add_column(column, justify="right")
    verdicts = []
    for k, by_kind in results.items():
        for kind in ("real", "simulated"):
            rows = by_kind[kind]
            if not rows:
                continue
            table.add_row(str(k), kind, _cell(rows, "step_s", ".3f"), _cell(rows, "busy", ".2f"),
                          " / ".join(_cell(rows, "staleness", ".2f", i) for i in range(k + 1)),
                          _cell(rows, "gen_tok_s", ".0f"), _cell(rows, "train_s", ".3f"),
                          _cell(rows, "sync_s", ".3f"))
        real, sim = by_kind["real"], by_kind["simulated"]
        if real and sim:
            step_err = _med(sim, "step_s") / _med(real, "step_s") - 1.0
            busy_err = _med(sim, "busy") - _med(real, "busy")
            stale_err = max(abs(_med(sim, "staleness", i) - _med(real, "staleness", i))
                            for i in range(k + 1))
            verdicts.append({"k": k, "step_error": step_err, "busy_error": busy_err,
                             "staleness_max_share_error": stale_err})
    Console(width=200).print(table)
    for v in verdicts:
        print(f"k={v['k']}: step time {v['step_error']:+.1%} (goal within {GOAL_STEP:.0%}: "
              f"{'met' if abs(v['step_error']) <= GOAL_STEP else 'NOT met'}); busy share "
              f"{v['busy_error']:+.3f} (goal within {GOAL_BUSY}: "
              f"{'met' if abs(v['busy_error']) <= GOAL_BUSY else 'NOT met'}); staleness "
              f"shares off by at most {v['staleness_max_share_error']:.2f}")
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ks", default="0,1,2", help="comma-separated max_off_policyness values")
    parser.add_argument("--keep-dir", action="store_true")
    parser.add_argument("--json", help="also write the per-run rows and verdicts here")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 (step 1 is left out) and --repeats >= 1")

    from megatron_rl.simulation.profiles import get_profile

    profile = get_profile("cpu")
    if not profile.measured:
        print("the cpu profile is not measured (megatron_rl/simulation/cpu_profile.json "
              "missing): run benchmarks/cpu_profile.py first", file=sys.stderr)
        return 1
    print("command:", shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])))
    print(f"cpu profile measured {profile.measured_costs.provenance.get('date')} at load "
          f"{profile.measured_costs.provenance.get('load_average_before')}")
    print("load average before:", os.getloadavg(), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="simulate_vs_real-"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {k: {"real": [], "simulated": []} for k in ks}
    try:
        checkpoint = str(tmp / "tiny_llama_checkpoint")
        subprocess.run([sys.executable, "tools/make_tiny_checkpoint.py", checkpoint], cwd=ROOT,
                       env=env, check=True, capture_output=True, timeout=600)
        for kind in ("real", "simulated"):
            print(f"each {kind} run:", shlex.join(command(kind, checkpoint, "OUT", args.steps,
                                                          ks[0])))
        for repeat in range(args.repeats):
            for k in ks:
                for kind in ("real", "simulated"):
                    out = tmp / f"r{repeat + 1}_k{k}_{kind}"
                    cmd = command(kind, checkpoint, str(out), args.steps, k)
                    rc, stdout, stderr, wall = run_process(cmd, env, RUN_TIMEOUT_S)
                    if rc != 0:
                        print(f"{kind} k={k} repeat {repeat + 1}: FAILED (rc {rc}) after "
                              f"{wall:.0f} s\n{shlex.join(cmd)}\n--- stdout ---\n"
                              f"{tail(stdout, 2000)}\n--- stderr ---\n{tail(stderr)}",
                              file=sys.stderr)
                        return 1
                    row = summarize(read_scalars(out / "tensorboard"), args.steps, k)
                    results[k][kind].append(row)
                    print(f"[r{repeat + 1} k={k} {kind:9}] step {row['step_s']:.3f} s, busy "
                          f"{row['busy']:.2f}, staleness "
                          + " / ".join(f"{x:.2f}" for x in row["staleness"])
                          + f", train {row['train_s']:.3f} s, sync {row['sync_s']:.3f} s; "
                          f"process {wall:.0f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep_dir:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("load average after:", os.getloadavg())
    verdicts = print_table(results, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "verdicts": verdicts},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
