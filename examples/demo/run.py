"""`make demo`: the main job at laptop size. A tiny Llama-4 MoE learns reasoning-gym's chain_sum
with ScaleRL under `megatron-rl train` on the real stack (one SGLang CPU generator, one Megatron
trainer rank, Ray, the Pipeline-RL loop with in-flight weight updates, reasoning-gym's scorer).

1. The base model: if `model.hf_checkpoint` (runs/demo_base/model) or the prompt pool
   (runs/demo_base/prompts.jsonl) is missing, tools/make_demo_base.py builds both: a tokenizer
   trained here, a random tiny Llama-4, a short supervised warm-up on worked solutions (with the
   project's Megatron trainer), exported to HF.
2. The run: `megatron-rl train examples/configs/demo.yaml` (with any overrides given here).
3. What it learned: held-out prompts with their decoded completions and scores before and after,
   the validation pass rate before and after, the sigmoid fit of the run's own curve, and the
   final pass rate predicted from the first half of the compute next to the observed one.

    python -m examples.demo.run [section.field=value ...]

Outputs under output_dir (runs/demo): scaling.jsonl, tensorboard/, validation_samples/,
checkpoints/, the fit's curve PNGs, config.yaml, the generator log.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "configs" / "demo.yaml"
NUM_SHOWN = 3  # held-out prompts shown before / after


def main(argv: list[str]) -> int:
    return run_demo(argv, name="demo", recipe=RECIPE,
                    builder=ROOT / "tools" / "make_demo_base.py", report=report)


def run_demo(argv: list[str], *, name: str, recipe: Path, builder: Path, report) -> int:
    """A demo's entry point (`make demo`, `make demo-tools`): the recipe with `argv`'s
    overrides; its base model built by `builder OUTPUT_DIR --overwrite` when model/ or
    prompts.jsonl is missing; `megatron-rl train`; then `report(output_dir, cfg)`."""
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.console import environment_summary, quiet_known_warnings, verbose_requested

    verbose, argv = verbose_requested(argv)
    quiet_known_warnings(verbose=verbose)
    print(environment_summary(), file=sys.stderr)
    try:
        cfg = load_config(recipe, argv)
    except ConfigError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    model, prompts = Path(cfg.model.hf_checkpoint), Path(cfg.data.prompts)
    base = model.parent  # the builder writes BASE/model and BASE/prompts.jsonl
    tool = builder.relative_to(ROOT)
    if not ((model / "config.json").is_file() and prompts.is_file()):
        if (model.name, prompts) != ("model", base / "prompts.jsonl"):
            print(f"{name}: error: {model} or {prompts} is missing, and they are not the "
                  f"model/ and prompts.jsonl of one {tool} output to build", file=sys.stderr)
            return 2
        print(f"building the base model into {base} ({tool}, once)", flush=True)
        build = subprocess.run([sys.executable, str(builder), str(base), "--overwrite"],
                               cwd=ROOT)
        if build.returncode != 0:
            print(f"{name}: error: building the base model failed (exit {build.returncode})",
                  file=sys.stderr)
            return 1
    from megatron_rl.train import main as train_main

    keep_previous_run(Path(cfg.output_dir))
    code = train_main([str(recipe), *argv])
    if code != 0:
        return code
    out = Path(cfg.output_dir)
    report(out, cfg)
    print(f"\n{name} done in {(time.perf_counter() - started) / 60:.1f} min; outputs in {out}/; "
          f"watch it with: tensorboard --logdir {out / 'tensorboard'}")
    return 0


def keep_previous_run(out: Path) -> None:
    """A second `make demo` must not mix its curve with the last one's (the scaling log appends
    and the report reads it whole): move an earlier run's output_dir aside, never delete it."""
    if not (out / "scaling.jsonl").exists():
        return
    aside = out.with_name(f"{out.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    out.rename(aside)
    print(f"moved the previous run in {out} to {aside}", flush=True)


def report(out: Path, cfg) -> None:
    """What the run learned, from its own outputs."""
    from megatron_rl.scaling.log import read_scaling_log

    series = read_scaling_log(out)["all"]
    samples = sorted((out / "validation_samples").glob("step_*.jsonl"))
    if samples:
        show_samples("before RL", samples[0])
        show_samples("after RL", samples[-1])
    first, last = series.pass_rate[0], series.pass_rate[-1]
    print(f"\nheld-out pass rate (mean@{cfg.eval.samples_per_prompt}, "
          f"{cfg.eval.num_heldout_prompts} prompts): step {series.step[0]} {first:.3f} -> "
          f"step {series.step[-1]} {last:.3f} ({last - first:+.3f})")
    show_interruptions(out, cfg)
    fit_and_predict(out, cfg, series)


def show_interruptions(out: Path, cfg, steps: int = 3) -> None:
    """How often the training rollouts hit the thinking budget, first and last steps."""
    from tensorboard.backend.event_processing.event_accumulator import (SCALARS,
                                                                        EventAccumulator)

    accumulator = EventAccumulator(str(out / "tensorboard"), size_guidance={SCALARS: 0})
    accumulator.Reload()
    if "rollout/interruption_rate" not in accumulator.Tags()[SCALARS]:
        return
    values = [e.value for e in sorted(accumulator.Scalars("rollout/interruption_rate"),
                                      key=lambda e: e.step)]
    head, tail = values[:steps], values[-steps:]
    print(f"forced interruption (thinking budget drawn in [{cfg.rollout.thinking_budget_min}, "
          f"{cfg.rollout.thinking_budget}] tokens): {sum(head) / len(head):.1%} of the training "
          f"completions in the first {len(head)} steps, {sum(tail) / len(tail):.1%} in the last "
          f"{len(tail)}")


def show_samples(title: str, path: Path) -> None:
    show_lines(title, [json.loads(line) for line in path.read_text().splitlines()])


def show_lines(title: str, lines: list[dict], *, label: str = "completion",
               render=None) -> None:
    """The first sample of each of the first NUM_SHOWN prompts of a validation samples file's
    `lines`, with its score; the text as `render` gives it (default: on one line)."""
    render = render or _one_line
    seen: list[dict] = []
    for line in lines:  # the first sample of the first prompts
        if all(s["prompt_id"] != line["prompt_id"] for s in seen):
            seen.append(line)
        if len(seen) == NUM_SHOWN:
            break
    print(f"\n--- {title} (step {lines[0]['step']}): {len(seen)} held-out prompts ---")
    for line in seen:
        verdict = "PASS" if line["passed"] else "fail"
        print(f"prompt: {_one_line(line['prompt'])}\n{label}: "
              f"{render(line['completion'])}\nscore: {line['reward']} ({verdict})\n")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " ..."


def fit_and_predict(out: Path, cfg, series) -> None:
    """`megatron-rl fit` on the run's curve with the first half of the compute held for the
    prediction: its tables, plots, and one line of predicted vs observed final pass rate."""
    from megatron_rl.scaling.cli import main as fit_main
    from megatron_rl.scaling.report import extrapolation_report
    from megatron_rl.scaling.sigmoid import SigmoidFitConfig, fit_point_mask

    warmup = cfg.eval.warmup_compute_gpu_hours
    config = SigmoidFitConfig(warmup_compute=warmup)
    half = series.compute_gpu_hours <= 0.5 * series.compute_gpu_hours[-1]
    usable = int(fit_point_mask(series.compute_gpu_hours[half], warmup).sum())
    if usable < config.min_points:
        print(f"no first-half fit: {usable} validation point(s) in the first half of the "
              f"compute past the warm-up, a fit needs {config.min_points}; run more steps or "
              "validate more often (eval.interval_steps)")
        return
    print()
    fit_main([str(out), "--out-dir", str(out), "--warmup-gpu-hours", repr(warmup),
              "--fit-fraction", "0.5"])
    report = extrapolation_report(series, config=config, fit_fraction=0.5, with_power_law=False)
    predicted, observed = report.held_out_predicted[-1], report.held_out_observed[-1]
    print(f"final pass rate predicted from the first half of the compute: {predicted:.3f}, "
          f"observed {observed:.3f} (error {predicted - observed:+.3f}); fitted asymptote "
          f"A = {report.sigmoid.a:.3f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
