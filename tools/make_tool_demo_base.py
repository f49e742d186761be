#!/usr/bin/env python
"""Build the tool-use demo's base model: the demo's tiny Llama-4 MoE (models/llama4 size "demo")
warmed up to multiply 2- and 3-digit numbers by calling a Python tool part of the time, the
starting point of `make demo-tools` (examples/tool_demo/run.py, examples/configs/tool_demo.yaml).

Usage: python tools/make_tool_demo_base.py OUTPUT_DIR [--evaluate N] [--overwrite] [--tiny]

Steps, each deterministic (a rerun on the same machine writes identical files):
1. The task: reasoning-gym `products` of 2 terms with 2-3 digits ("Solve the following
   multiplication: 347 * 29. ..."), too hard for a 1.2 M-parameter model in its head, trivial
   with the tool; records tagged "tool/rg/products" (megatron_rl/data/tool_solutions.py). The RL
   pool (OUTPUT_DIR/prompts.jsonl) and the SFT problems (OUTPUT_DIR/sft_data.jsonl) come from
   different reasoning-gym seeds, and every pool prompt is excluded from the SFT data by text.
2. A tokenizer trained here on that text, the thinking, answer, tool and output tags single
   tokens (the stop text "</tool>" included).
3. Random initialisation from a fixed seed, then the supervised warm-up (`megatron-rl sft`) on
   whole trajectories, "<think>347 * 29</think><tool>print(347 * 29)</tool><output>10063\\n
   </output><answer>10063</answer>", for `tool_fraction` of the problems and direct answers
   "<think>347 * 29</think><answer>10063</answer>" for the rest; the observation is a piece of
   its own (sft_data.jsonl: {"observation": ...}), in the sequence but not trained on, as at RL
   time, where the model's turn stops at "</tool>" and the environment appends it.
4. OUTPUT_DIR/model: the export in bf16, in the layout SGLang serves Llama-4 from.

`--evaluate N` then runs the tool loop itself on N held-out prompts (split_heldout of the pool at
--eval-seed, as a run with eval.num_heldout_prompts=N and seed=--eval-seed holds them out),
--samples times each at temperature 1 with transformers' generate: generate until "</tool>" or
EOS; on a call, run its code in the real sandbox (megatron_rl.rewards.sandbox, isolation "auto")
and append "<output>STDOUT</output>", then generate the next turn (at most --max-turns turns);
the model's turns joined (observations excluded) are graded by reasoning-gym's `products` scorer.
It reports the pass rate, the tool-use rate, the pass rates with and without the tool, and the
token lengths the recipe's budgets are sized from. OUTPUT_DIR/build.json records the settings,
the times and the weights' sha256.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.make_demo_base import empty_output, warm_up_and_export  # noqa: E402

TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BuildSettings:
    num_rl_prompts: int = 512  # the RL run's pool, training + held out
    rl_prompt_seed: int = 1234
    num_sft_examples: int = 3000
    sft_data_seed: int = 1_000_000  # reasoning-gym seeds item i with seed + i: far from the pool's
    init_seed: int = 0
    # Fraction of the warm-up trajectories that call the tool (the others guess directly).
    tool_fraction: float = 0.5
    # The warm-up. Measured on 64 held-out prompts x 4 samples at T=1 (docs/sft.md "Tool-use
    # demo"): the tool in 55 % of the trajectories, pass rate 0.74 with it and 0.0 without.
    num_steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    lr_warmup_steps: int = 10
    adam_beta2: float = 0.95
    seed: int = 1234

    @classmethod
    def tiny(cls) -> BuildSettings:
        """A small build for tests: a 64-prompt pool, 200 warm-up steps (of the default 300) and
        three quarters of the trajectories with the tool, so that most of an e2e run's
        trajectories are multi-turn and groups have mixed rewards. Measured
        (--evaluate 16 --samples 4): the tool in 78 % of the trajectories, pass rate 0.64 with
        it, 0.0 without; 27 s of build at load average ~1."""
        return cls(num_rl_prompts=64, num_steps=200, tool_fraction=0.75)


def build(output_dir: str | Path, settings: BuildSettings = BuildSettings(), *,
          overwrite: bool = False, progress: bool = True) -> dict:
    """Write the base model and its data into `output_dir`; returns what build.json records."""
    from megatron_rl.data import save_prompts
    from megatron_rl.data.sft_examples import save_sft_examples
    from megatron_rl.data.tool_solutions import (TOOL_TAG_TOKENS, TOOL_TASK, tool_prompts,
                                                 tool_solution_examples)

    started = time.perf_counter()
    output = empty_output(output_dir, overwrite=overwrite)
    pool = tool_prompts(num_prompts=settings.num_rl_prompts, seed=settings.rl_prompt_seed,
                        config=TASK_CONFIG)
    save_prompts(pool, output / "prompts.jsonl")
    examples = tool_solution_examples(
        num_examples=settings.num_sft_examples, seed=settings.sft_data_seed, config=TASK_CONFIG,
        exclude_prompts={r.prompt for r in pool}, tool_fraction=settings.tool_fraction)
    save_sft_examples(examples, output / "sft_data.jsonl")
    return warm_up_and_export(output, examples, settings, started=started, progress=progress,
                              task={"task": TOOL_TASK, "config": TASK_CONFIG},
                              added_tokens=TOOL_TAG_TOKENS)


# ----------------------------------------------------------------------------- evaluation


def evaluate(output_dir: str | Path, *, num_prompts: int, num_samples: int, eval_seed: int,
             max_turns: int = 3, max_turn_tokens: int = 48, sample_seed: int = 0) -> dict:
    """The held-out tool loop at temperature 1 (see the module docstring): pass rate, tool-use
    rate, pass rates with and without the tool, token lengths."""
    import dataclasses as dc
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data import load_prompts, split_heldout
    from megatron_rl.data.sources import PROCEDURAL_TASK_PREFIX
    from megatron_rl.data.tokenizer import prompt_token_ids
    from megatron_rl.data.tool_solutions import (DATASET, OBSERVATION_TEMPLATE, TOOL_CLOSE,
                                                 TOOL_OPEN)
    from megatron_rl.rewards.procedural import ProceduralReward
    from megatron_rl.rewards.sandbox import Sandbox, SandboxConfig

    output = Path(output_dir)
    _, heldout = split_heldout(load_prompts(output / "prompts.jsonl"), num_heldout=num_prompts,
                               seed=eval_seed)
    # The same bf16 weights as OUTPUT_DIR/model, in the text-only layout transformers loads.
    model_dir = output / "sft" / "hf"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos, tool_close = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(TOOL_CLOSE)
    reward = ProceduralReward()
    torch.manual_seed(sample_seed)
    trajectories = []
    with Sandbox(SandboxConfig(isolation="auto", num_workers=1)) as sandbox:
        for record in heldout:
            graded = dc.replace(record, task=PROCEDURAL_TASK_PREFIX + DATASET)  # the inner task
            prompt = prompt_token_ids(tokenizer, record.prompt)
            for _ in range(num_samples):
                ids, turns, calls, errors = list(prompt), [], 0, 0
                for turn in range(max_turns):
                    with torch.no_grad():
                        out = model.generate(
                            torch.tensor([ids]), do_sample=True, temperature=1.0, top_k=0,
                            top_p=1.0, max_new_tokens=max_turn_tokens, pad_token_id=eos,
                            eos_token_id=[eos, tool_close])
                    new = out[0, len(ids):].tolist()
                    ids += new
                    text = tokenizer.decode([t for t in new if t != eos])
                    turns.append(text)
                    if not new or new[-1] != tool_close or turn == max_turns - 1:
                        break
                    code = text[text.rfind(TOOL_OPEN) + len(TOOL_OPEN):-len(TOOL_CLOSE)] \
                        if TOOL_OPEN in text else ""
                    result = sandbox.run(code)
                    calls += 1
                    errors += not result.ok
                    # stdout, and stderr when the call failed (a traceback is what a model
                    # would need to read)
                    shown = result.stdout if result.ok else result.stdout + result.stderr[-200:]
                    observation = OBSERVATION_TEMPLATE.format(content=shown)
                    ids += tokenizer.encode(observation, add_special_tokens=False)
                    turns.append(observation)
                model_text = "".join(t for i, t in enumerate(turns) if i % 2 == 0)
                verdict = reward(model_text, graded)
                trajectories.append({
                    "prompt_id": record.prompt_id, "passed": verdict.passed,
                    "reason": verdict.reason.value, "tool_calls": calls, "tool_errors": errors,
                    "prompt_tokens": len(prompt), "trajectory_tokens": len(ids) - len(prompt),
                    "text": "".join(turns)})

    def rate(rows: list[dict]) -> float | None:
        return sum(r["passed"] for r in rows) / len(rows) if rows else None

    with_tool = [t for t in trajectories if t["tool_calls"]]
    without = [t for t in trajectories if not t["tool_calls"]]
    lengths = sorted(t["trajectory_tokens"] for t in trajectories)
    return {
        "num_prompts": len(heldout), "samples_per_prompt": num_samples,
        "pass_rate": rate(trajectories),
        "tool_use_rate": len(with_tool) / len(trajectories),
        "pass_rate_with_tool": rate(with_tool),
        "pass_rate_without_tool": rate(without),
        "tool_error_rate": (sum(t["tool_errors"] for t in with_tool)
                            / max(1, sum(t["tool_calls"] for t in with_tool))),
        "prompt_tokens_max": max(t["prompt_tokens"] for t in trajectories),
        "trajectory_tokens_mean": statistics.fmean(lengths),
        "trajectory_tokens_max": lengths[-1],
        "examples": [{k: t[k] for k in ("text", "reason")} for t in trajectories[:6]],
        "failed_with_tool": [{k: t[k] for k in ("text", "reason")}
                             for t in with_tool if not t["passed"]][:6],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--tiny", action="store_true",
                        help="BuildSettings.tiny(): the small build the tests use")
    defaults = BuildSettings()
    for field in dataclasses.fields(BuildSettings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=None, help=f"(default: {getattr(defaults, field.name)})")
    parser.add_argument("--evaluate", type=int, default=0, metavar="N",
                        help="afterwards, the tool loop on N held-out prompts (0: skip)")
    parser.add_argument("--samples", type=int, default=4, help="samples per evaluated prompt")
    parser.add_argument("--max-turns", type=int, default=3, help="turns per evaluated trajectory")
    parser.add_argument("--eval-seed", type=int, default=1234,
                        help="the RL run's seed, which picks its held-out prompts")
    parser.add_argument("--skip-build", action="store_true",
                        help="only evaluate an existing OUTPUT_DIR")
    args = parser.parse_args(argv)
    from megatron_rl.console import is_terminal, quiet_known_warnings

    quiet_known_warnings()
    if not args.progress or not is_terminal(sys.stderr):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if not args.skip_build:
        base = BuildSettings.tiny() if args.tiny else BuildSettings()
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(BuildSettings)
                 if getattr(args, f.name) is not None}
        record = build(args.output_dir, dataclasses.replace(base, **given),
                       overwrite=args.overwrite, progress=args.progress)
        print(f"built {args.output_dir}/model in {record['seconds']} s (SFT loss "
              f"{record['sft_loss']['first']:.3f} -> {record['sft_loss']['last']:.3f}); "
              f"prompts: {args.output_dir}/prompts.jsonl")
    if args.evaluate:
        report = evaluate(args.output_dir, num_prompts=args.evaluate, num_samples=args.samples,
                          eval_seed=args.eval_seed, max_turns=args.max_turns)
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
