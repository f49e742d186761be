#!/usr/bin/env python
"""Build the demo's base model: a tiny Llama-4 MoE (models/llama4 size "demo") that sometimes
solves short reasoning-gym chain sums, the starting point of `make demo`'s RL run.

Usage: python tools/make_demo_base.py OUTPUT_DIR [--evaluate N] [--overwrite]

Steps, each deterministic (a rerun on the same machine writes identical files):
1. The task: reasoning-gym `chain_sum` with 3 one-digit terms ("4 + 9 - 3 ="), graded by its
   own scorer. The RL run's prompt pool (OUTPUT_DIR/prompts.jsonl: distinct problems; the run
   holds out part of it for validation) and the SFT problems (OUTPUT_DIR/sft_data.jsonl, worked
   solutions "<think>4 + 9 - 3 : 4 + 9 = 13 , 13 - 3 = 10</think> <answer>10</answer>") come
   from different reasoning-gym seeds, and every pool prompt is excluded from the SFT data by
   text, so no held-out prompt is ever trained on.
2. A tokenizer trained here on that text (megatron_rl/data/tokenizer.py: digits one token each).
3. Random initialisation from a fixed seed (OUTPUT_DIR/init, HF, fp32).
4. The supervised warm-up with the project's trainer (`megatron-rl sft`, OUTPUT_DIR/sft: Megatron
   checkpoint, HF export, TensorBoard), short enough that the model is right only part of the
   time at temperature 1, leaving RL something to improve.
5. OUTPUT_DIR/model: the export in bf16, in the layout SGLang serves Llama-4 from (the
   generators' `model.hf_checkpoint`; the trainer converts it with the same converter).

`--evaluate N` then samples N held-out prompts (split_heldout of the pool at --eval-seed, as a run
with eval.num_heldout_prompts=N and seed=--eval-seed holds them out) --samples times each at
temperature 1 with transformers' generate, scores them with reasoning-gym's scorer, and reports
the pass rate and the length of the thinking parts in tokens. OUTPUT_DIR/build.json records the
settings, the times and the weights' sha256.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATASET = "chain_sum"
TASK_CONFIG = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}
MODEL_FAMILY, MODEL_SIZE = "llama4", "demo"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BuildSettings:
    num_rl_prompts: int = 512  # the RL run's pool, training + held out
    rl_prompt_seed: int = 1234
    num_sft_examples: int = 3000  # of the 4,000 distinct problems, minus the pool
    sft_data_seed: int = 1_000_000  # reasoning-gym seeds item i with seed + i: far from the pool's
    init_seed: int = 0
    # Half the worked solutions restate the problem twice (six tokens longer, no more accurate):
    # under the demo's thinking budget the long style is often cut off, the short one rarely, so
    # RL has a behaviour to learn that the reward clearly favours (docs/sft.md).
    long_fraction: float = 0.5
    # The warm-up. Measured held-out pass rate at T=1 (128 prompts x 4 samples, transformers):
    # 0.52 (greedy 0.65), which leaves RL room (docs/sft.md).
    num_steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    lr_warmup_steps: int = 10
    adam_beta2: float = 0.95
    seed: int = 1234


def build(output_dir: str | Path, settings: BuildSettings = BuildSettings(), *,
          overwrite: bool = False, progress: bool = True) -> dict:
    """Write the base model and its data into `output_dir`; returns what build.json records."""
    from megatron_rl.data import save_prompts
    from megatron_rl.data.sft_examples import save_sft_examples
    from megatron_rl.data.worked_solutions import (unique_reasoning_gym_prompts,
                                                   worked_solution_examples)

    started = time.perf_counter()
    output = empty_output(output_dir, overwrite=overwrite)
    pool = unique_reasoning_gym_prompts(DATASET, num_prompts=settings.num_rl_prompts,
                                        seed=settings.rl_prompt_seed, config=TASK_CONFIG)
    save_prompts(pool, output / "prompts.jsonl")
    examples = worked_solution_examples(
        DATASET, num_examples=settings.num_sft_examples, seed=settings.sft_data_seed,
        config=TASK_CONFIG, exclude_prompts={r.prompt for r in pool},
        long_fraction=settings.long_fraction)
    save_sft_examples(examples, output / "sft_data.jsonl")
    return warm_up_and_export(output, examples, settings, started=started, progress=progress,
                              task={"dataset": DATASET, "config": TASK_CONFIG})


def empty_output(output_dir: str | Path, *, overwrite: bool) -> Path:
    """`output_dir`, created empty (a non-empty one is refused unless `overwrite`)."""
    output = Path(output_dir)
    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise SystemExit(f"{output} is not empty; pass --overwrite to rebuild it")
        shutil.rmtree(output)
    output.mkdir(parents=True)
    return output


def warm_up_and_export(output: Path, examples, settings, *, started: float, progress: bool,
                       task: dict, added_tokens=None) -> dict:
    """Steps 2-5 on the SFT `examples` already in output/sft_data.jsonl (the pool in
    output/prompts.jsonl): the tokenizer (with `added_tokens`, default the thinking / answer
    tags) and random init, the warm-up, the SGLang layout, build.json (recording `task`); returns
    what build.json records. Shared with tools/make_tool_demo_base.py."""
    from megatron_rl.sft import SFTSettings, run_sft
    from models.llama4.convert import write_sglang_layout

    tokenizer_texts = [text for e in examples for text in (e.prompt, e.response)]
    init_dir = _random_init(output / "init", tokenizer_texts, seed=settings.init_seed,
                            added_tokens=added_tokens)
    result = run_sft(SFTSettings(
        hf_checkpoint=str(init_dir), data=str(output / "sft_data.jsonl"),
        output_dir=str(output / "sft"), exclude_prompts=str(output / "prompts.jsonl"),
        num_steps=settings.num_steps, batch_size=settings.batch_size, lr=settings.lr,
        lr_warmup_steps=settings.lr_warmup_steps, lr_schedule="cosine",
        adam_beta2=settings.adam_beta2, seed=settings.seed,
        hf_dtype="bfloat16", progress_bar=progress))
    model_dir = write_sglang_layout(result.hf_checkpoint, output / "model")
    record = {
        "task": task,
        "model": {"family": MODEL_FAMILY, "size": MODEL_SIZE},
        "settings": dataclasses.asdict(settings),
        "sft_loss": {"first": result.losses[0], "last": result.losses[-1]},
        "seconds": round(time.perf_counter() - started, 1),
        "sha256": {p.name: _sha256(p) for p in sorted(model_dir.iterdir()) if p.is_file()},
    }
    (output / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _random_init(directory: Path, tokenizer_texts: list[str], *, seed: int,
                 added_tokens: tuple[str, ...] | None = None) -> Path:
    """The demo size with random weights (fp32) and a tokenizer trained on the task's text
    (`added_tokens`: its single-token tags; None: the tokenizer's default, the thinking and
    answer tags)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.config import INTERRUPTION_PHRASE
    from megatron_rl.data.tokenizer import train_tokenizer
    from models import get_model_family

    config_dict = dict(get_model_family(MODEL_FAMILY).hf_config(MODEL_SIZE))
    # The forced-interruption phrase as often as a fifth of the texts: compact like the prompts.
    phrase = [INTERRUPTION_PHRASE] * (len(tokenizer_texts) // 5)
    extra = {} if added_tokens is None else {"added_tokens": added_tokens}
    tokenizer = train_tokenizer([*tokenizer_texts, *phrase], vocab_size=config_dict["vocab_size"],
                                **extra)
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    mismatched = {k: (v, config_dict.get(k)) for k, v in ids.items() if config_dict.get(k) != v}
    if mismatched:
        raise RuntimeError(f"tokenizer and model config disagree on special ids: {mismatched}")
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- evaluation


def evaluate(output_dir: str | Path, *, num_prompts: int, num_samples: int, eval_seed: int,
             max_new_tokens: int = 64, sample_seed: int = 0) -> dict:
    """Held-out pass rate at temperature 1 (transformers' generate, reasoning-gym's scorer) and
    thinking lengths in tokens (up to and including </think>; the whole completion when it never
    closes its thinking)."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data import load_prompts, split_heldout
    from megatron_rl.rewards.procedural import ProceduralReward
    from megatron_rl.data.tokenizer import prompt_token_ids

    output = Path(output_dir)
    _, heldout = split_heldout(load_prompts(output / "prompts.jsonl"), num_heldout=num_prompts,
                               seed=eval_seed)
    # The same bf16 weights as OUTPUT_DIR/model, in the text-only layout transformers loads.
    model_dir = output / "sft" / "hf"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    reward = ProceduralReward()
    torch.manual_seed(sample_seed)
    passed, think_lengths, examples = [], [], []
    for record in heldout:
        prompt = torch.tensor([prompt_token_ids(tokenizer, record.prompt)])
        with torch.no_grad():
            generated = model.generate(
                prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                num_return_sequences=num_samples, max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for row in generated[:, prompt.shape[1]:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id)]
            text = tokenizer.decode(row)
            result = reward(text, record)
            passed.append(result.passed)
            think_lengths.append(row.index(think_end) + 1 if think_end in row else len(row))
            if len(examples) < 6:
                examples.append({"prompt": record.prompt.split("\n")[0], "completion": text,
                                 "reason": result.reason.value})
    ordered = sorted(think_lengths)
    return {
        "num_prompts": len(heldout), "samples_per_prompt": num_samples,
        "pass_rate": sum(passed) / len(passed),
        "think_tokens_mean": statistics.fmean(think_lengths),
        "think_tokens_p90": ordered[int(0.9 * (len(ordered) - 1))],
        "think_tokens_max": ordered[-1],
        "fraction_over": {str(b): sum(t > b for t in think_lengths) / len(think_lengths)
                          for b in (12, 16, 24, 32)},
        "examples": examples,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    defaults = BuildSettings()
    for field in dataclasses.fields(BuildSettings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=getattr(defaults, field.name),
                            help=f"(default: {getattr(defaults, field.name)})")
    parser.add_argument("--evaluate", type=int, default=0, metavar="N",
                        help="afterwards, the pass rate on N held-out prompts (0: skip)")
    parser.add_argument("--samples", type=int, default=4, help="samples per evaluated prompt")
    parser.add_argument("--eval-seed", type=int, default=1234,
                        help="the RL run's seed, which picks its held-out prompts")
    parser.add_argument("--skip-build", action="store_true",
                        help="only evaluate an existing OUTPUT_DIR")
    args = parser.parse_args(argv)
    from megatron_rl.console import is_terminal, quiet_known_warnings

    quiet_known_warnings()
    # transformers' own bars too (save_pretrained's "Writing model shards"): off with
    # --no-progress, and in a log, where a bar's carriage returns pile up on one line (ours
    # print plain lines there: megatron_rl.console.progress)
    if not args.progress or not is_terminal(sys.stderr):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if not args.skip_build:
        settings = BuildSettings(**{f.name: getattr(args, f.name)
                                    for f in dataclasses.fields(BuildSettings)})
        record = build(args.output_dir, settings, overwrite=args.overwrite,
                       progress=args.progress)
        print(f"built {args.output_dir}/model in {record['seconds']} s (SFT loss "
              f"{record['sft_loss']['first']:.3f} -> {record['sft_loss']['last']:.3f}); "
              f"prompts: {args.output_dir}/prompts.jsonl")
    if args.evaluate:
        report = evaluate(args.output_dir, num_prompts=args.evaluate, num_samples=args.samples,
                          eval_seed=args.eval_seed)
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
