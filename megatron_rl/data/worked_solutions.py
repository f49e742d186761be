"""Worked solutions for the supervised cold start: for a reasoning-gym problem, the response a
policy should write, `<think>steps</think> <answer>result</answer>`, built by code from the
problem's own metadata (never from a model), for the datasets in `WORKED_SOLUTIONS`.

`worked_solution_examples` turns generated problems into SFT examples whose prompts are exactly
the RL prompts' text (megatron_rl.data.sources.reasoning_gym_prompts: question + instruction) and
leaves out every prompt in `exclude_prompts` (an RL run's prompt pool, so that none of its
held-out prompts is ever trained on). reasoning-gym seeds item i of a dataset with seed + i, so
two seeds overlap in problems: disjointness is decided on the prompt text, not on seeds.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from megatron_rl.data.records import PromptRecord
from megatron_rl.data.sft_examples import SFTExample
from megatron_rl.data.sources import (PROCEDURAL_INSTRUCTION, PROCEDURAL_TASK_PREFIX,
                                      reasoning_gym_prompts)


def _chain_sum_solution(record: PromptRecord, *, long: bool = False) -> str:
    """Restate the expression, then evaluate it left to right, one step per operator:
    "<think>8 - 5 + 2 : 8 - 5 = 3 , 3 + 2 = 5</think> <answer>5</answer>". The restatement copies
    the prompt's operands next to the steps, which then read them from nearby tokens (without it
    the demo's model is right less often). `long` restates the problem twice: "<think>8 - 5 + 2 :
    8 - 5 + 2 : 8 - 5 = 3 , 3 + 2 = 5</think> ...", six tokens longer with the demo's tokenizer
    and no more accurate; the demo's warm-up mixes both styles, and under its thinking budget the
    long one is what gets a completion cut off."""
    expression = record.metadata.get("expression")
    if not isinstance(expression, str):
        raise ValueError(f"prompt {record.prompt_id!r}: chain_sum metadata has no 'expression'")
    parts = expression.split()
    if len(parts) < 3 or len(parts) % 2 == 0 or any(op not in "+-" for op in parts[1::2]):
        raise ValueError(f"prompt {record.prompt_id!r}: {expression!r} is not 'a op b [op c ...]' "
                         "with op in + -")
    total = int(parts[0])
    steps = []
    for op, text in zip(parts[1::2], parts[2::2]):
        new_total = total + int(text) if op == "+" else total - int(text)
        steps.append(f"{total} {op} {text} = {new_total}")
        total = new_total
    if record.answer is not None and str(total) != record.answer.strip():
        raise ValueError(f"prompt {record.prompt_id!r}: worked result {total} differs from the "
                         f"dataset's answer {record.answer!r}")
    restated = f"{expression} : " * (2 if long else 1)
    return f"<think>{restated}{' , '.join(steps)}</think> <answer>{total}</answer>"


# reasoning-gym dataset -> worked-solution writer for its records, (record, long=...) -> text.
WORKED_SOLUTIONS: dict[str, Callable[..., str]] = {
    "chain_sum": _chain_sum_solution,
}


def worked_solution(record: PromptRecord, *, long: bool = False) -> str:
    """The worked response for a reasoning-gym record (task "rg/<dataset>"); `long`: the
    writer's long style."""
    dataset = record.task.removeprefix(PROCEDURAL_TASK_PREFIX)
    if not record.task.startswith(PROCEDURAL_TASK_PREFIX) or dataset not in WORKED_SOLUTIONS:
        raise ValueError(f"no worked solutions for task {record.task!r}; available: "
                         f"{', '.join(PROCEDURAL_TASK_PREFIX + d for d in WORKED_SOLUTIONS)}")
    return WORKED_SOLUTIONS[dataset](record, long=long)


def unique_reasoning_gym_prompts(dataset: str, *, num_prompts: int, seed: int,
                                 config: Mapping[str, Any] | None = None,
                                 exclude_prompts: Collection[str] = (),
                                 instruction: str = PROCEDURAL_INSTRUCTION) -> list[PromptRecord]:
    """The first `num_prompts` generated problems (in index order) whose prompt text (question +
    `instruction`) is new: not an earlier one's and not in `exclude_prompts`. Deterministic in
    (dataset, seed, config, instruction)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    excluded = set(exclude_prompts)
    kept: list[PromptRecord] = []
    num_generated = 0
    while len(kept) < num_prompts:
        if num_generated >= 20 * (num_prompts + len(excluded)):
            raise ValueError(
                f"only {len(kept)} distinct prompts of rg/{dataset} with config "
                f"{dict(config or {})} among {num_generated} generated (excluding "
                f"{len(excluded)}); the task has too few distinct problems for {num_prompts}: "
                "ask for fewer or widen the config")
        # Item i depends only on (seed, i): generate the next, doubling, range of indices.
        size = max(2 * num_generated, 2 * num_prompts, 64)
        try:
            records = reasoning_gym_prompts(dataset, num_prompts=size, seed=seed,
                                            config=config, instruction=instruction)[num_generated:]
        except (TypeError, AssertionError) as err:  # reasoning-gym's own config checks
            raise ValueError(f"rg/{dataset} refuses the config {dict(config or {})}: {err}; "
                             "use the fields of its config class (reasoning_gym."
                             f"create_dataset('{dataset}', ...))") from None
        num_generated = size
        for record in records:
            if record.prompt not in excluded:
                excluded.add(record.prompt)
                kept.append(record)
                if len(kept) == num_prompts:
                    break
    return kept


def worked_solution_examples(dataset: str, *, num_examples: int, seed: int,
                             config: Mapping[str, Any] | None = None,
                             exclude_prompts: Collection[str] = (),
                             long_fraction: float = 0.0) -> list[SFTExample]:
    """`num_examples` SFT examples (distinct prompts, none in `exclude_prompts`) of a
    reasoning-gym dataset with worked solutions; deterministic in (dataset, seed, config).
    `long_fraction` of them, spread evenly (example i is long when floor((i + 1) * f) exceeds
    floor(i * f)), are written in the writer's long style."""
    if dataset not in WORKED_SOLUTIONS:
        raise ValueError(f"no worked solutions for reasoning-gym dataset {dataset!r}; "
                         f"available: {', '.join(WORKED_SOLUTIONS)}")
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    records = unique_reasoning_gym_prompts(dataset, num_prompts=num_examples, seed=seed,
                                           config=config, exclude_prompts=exclude_prompts)
    long = [math.floor((i + 1) * long_fraction) > math.floor(i * long_fraction)
            for i in range(len(records))]
    return [SFTExample(prompt=r.prompt, response=worked_solution(r, long=is_long))
            for r, is_long in zip(records, long)]
