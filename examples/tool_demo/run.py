"""`make demo-tools`: a tiny Llama-4 MoE learns to use a Python tool by RL under `megatron-rl train`
on the real stack (one SGLang CPU generator, one Megatron trainer rank, Ray, the Pipeline-RL loop
with in-flight weight updates, multi-turn rollouts whose tool calls run in the code sandbox,
reasoning-gym's `products` scorer).

1. The base model: if `model.hf_checkpoint` (runs/tool_demo_base/model) or the prompt pool
   (runs/tool_demo_base/prompts.jsonl) is missing, tools/make_tool_demo_base.py builds both: a
   tokenizer trained here, a random tiny Llama-4, a short supervised warm-up on whole tool-use
   trajectories and direct guesses (docs/sft.md "Tool-use demo").
2. The run: `megatron-rl train examples/configs/tool_demo.yaml` (with any overrides given here).
3. What it learned, from the run's own validation samples (the whole trajectories: the model's
   turns and the tool's <output> observations): held-out trajectories before and after, the
   held-out pass rate, the tool-use rate, and the pass rates with and without the tool.

    python -m examples.tool_demo.run [section.field=value ...]

Outputs under output_dir (runs/tool_demo): scaling.jsonl, tensorboard/, validation_samples/,
checkpoints/, config.yaml, the generator log.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "configs" / "tool_demo.yaml"
BUILDER = ROOT / "tools" / "make_tool_demo_base.py"


def main(argv: list[str]) -> int:
    from examples.demo.run import run_demo

    return run_demo(argv, name="demo-tools", recipe=RECIPE, builder=BUILDER, report=report)


def report(out: Path, cfg) -> None:
    """What the run learned, from its validation samples (first and last validation)."""
    samples = sorted((out / "validation_samples").glob("step_*.jsonl"),
                     key=lambda p: int(p.stem.removeprefix("step_")))
    if not samples:
        print("no validation samples: set eval.interval_steps > 0 to see what the run learned")
        return
    first, last = (_read(samples[0]), _read(samples[-1]))
    show_samples("before RL", first)
    show_samples("after RL", last)
    print(f"\nheld-out trajectories ({cfg.eval.num_heldout_prompts} prompts x "
          f"{cfg.eval.samples_per_prompt} samples):")
    for title, lines in (("before", first), ("after", last)):
        stats = tool_stats(lines)
        print(f"  {title} RL (step {lines[0]['step']}): pass rate {stats['pass_rate']:.3f}, "
              f"tool-use rate {stats['tool_use_rate']:.3f}, pass rate with the tool "
              f"{_rate(stats['pass_rate_with_tool'])}, without "
              f"{_rate(stats['pass_rate_without_tool'])}")


def tool_stats(lines: list[dict]) -> dict:
    """Pass rate, tool-use rate (trajectories with a call: the model's turn ended at the call's
    closing tag) and pass rates with and without the tool."""
    from megatron_rl.data.tool_solutions import TOOL_CLOSE

    with_tool = [line for line in lines if TOOL_CLOSE in line["completion"]]
    without = [line for line in lines if TOOL_CLOSE not in line["completion"]]

    def rate(rows: list[dict]) -> float | None:
        return sum(bool(r["passed"]) for r in rows) / len(rows) if rows else None

    return {"pass_rate": rate(lines), "tool_use_rate": len(with_tool) / len(lines),
            "pass_rate_with_tool": rate(with_tool), "pass_rate_without_tool": rate(without)}


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def show_samples(title: str, lines: list[dict]) -> None:
    from examples.demo.run import show_lines

    show_lines(title, lines, label="trajectory", render=repr)  # whole, tags and all


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
