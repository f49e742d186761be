"""The tool-use demo's task and its supervised trajectories (docs/sft.md "Tool-use demo"):
reasoning-gym `products` ("Solve the following multiplication: 347 * 29. ...") under the task tag
"tool/rg/products" (the python tool environment, graded by the inner task's reward, reasoning-gym's
`products` scorer), and the whole trajectories the warm-up teaches, written by code from the
problem's own metadata, in exactly the token layout the multi-turn rollout produces:

    <think>347 * 29</think><tool>print(347 * 29)</tool>      the model's first turn (ends at the
                                                            stop text "</tool>")
    <output>10063\\n</output>                                 the observation: what the sandbox
                                                            prints (print adds "\\n"), in the
                                                            recipe's observation_template
    <answer>10063</answer>                                  the model's last turn (then EOS)

or, without the tool, a direct answer "<think>347 * 29</think><answer>10063</answer>" that a
1.2 M-parameter model cannot compute in its head: the warm-up mixes both, so the base model calls
the tool only part of the time and RL has a behaviour to raise that the reward clearly favours.

The tags are added tokens of the demo's tokenizer (TOOL_TAG_TOKENS, megatron_rl/data/tokenizer.py
splits text at them before BPE), so no merge crosses the boundaries at which the rollout joins
the model's tokens and the observation's: the SFT response tokenised whole equals the rollout's
concatenation of the pieces (tests/unit/test_tool_solutions.py). The examples keep the pieces
(SFTExample observations): `megatron-rl sft` tokenizes each on its own and trains on the model's
text only, the observation in the sequence with loss mask 0, as in RL.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

from megatron_rl.data.records import PromptRecord
from megatron_rl.data.sft_examples import SFTExample
from megatron_rl.data.tokenizer import TAG_TOKENS
from megatron_rl.data.worked_solutions import unique_reasoning_gym_prompts

DATASET = "products"
TOOL_TASK = "tool/rg/products"  # the tool environment's tag; the inner task is rg/products
TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"  # environment.tool_call_open / tool_call_close
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
OBSERVATION_TEMPLATE = OUTPUT_OPEN + "{content}" + OUTPUT_CLOSE  # environment.observation_template
# The demo tokenizer's added tokens: the thinking / answer tags and the tool-call and observation
# tags, each one token (the stop text "</tool>" must be one token: SGLang stops on token ids).
TOOL_TAG_TOKENS = (*TAG_TOKENS, TOOL_OPEN, TOOL_CLOSE, OUTPUT_OPEN, OUTPUT_CLOSE)
# The tag protocol is not spelled out: each tag in a prompt is a token of its own, and the demo's
# model reads back only within 48-token attention chunks (models/llama4/config.py "demo"): with
# the tags named (22 prompt tokens) the answer crossed into the second chunk and the warm-up model
# often failed to copy the tool's output into it. This text merges into a token or two, so prompt
# and whole trajectory (<= 10 + 38 tokens) fit one chunk.
TOOL_INSTRUCTION = "\n\nYou may run Python code with the tool."


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """A piece of a trajectory: written by the model (loss) or an observation (no loss)."""

    text: str
    observation: bool = False


def tool_prompts(*, num_prompts: int, seed: int, config: Mapping[str, Any],
                 exclude_prompts: Collection[str] = ()) -> list[PromptRecord]:
    """`num_prompts` distinct `products` problems (none in `exclude_prompts`) as tool-task
    records: the question with TOOL_INSTRUCTION, task TOOL_TASK, reasoning-gym's answer and
    metadata (what its scorer needs) kept. Deterministic in (seed, config)."""
    records = unique_reasoning_gym_prompts(DATASET, num_prompts=num_prompts, seed=seed,
                                           config=config, exclude_prompts=exclude_prompts,
                                           instruction=TOOL_INSTRUCTION)
    return [dataclasses.replace(r, task=TOOL_TASK, prompt_id=f"tool/{r.prompt_id}")
            for r in records]


def _operands(record: PromptRecord) -> tuple[str, int]:
    """The expression ("347 * 29") and its value, checked against the dataset's answer."""
    expression = record.metadata.get("expression")
    parts = expression.split(" * ") if isinstance(expression, str) else []
    if len(parts) < 2 or not all(p.lstrip("-").isdigit() for p in parts):
        raise ValueError(f"prompt {record.prompt_id!r}: products metadata 'expression' "
                         f"{expression!r} is not 'a * b [* c ...]' of integers")
    value = math.prod(int(p) for p in parts)
    if record.answer is not None and str(value) != record.answer.strip():
        raise ValueError(f"prompt {record.prompt_id!r}: {expression} = {value} differs from the "
                         f"dataset's answer {record.answer!r}")
    return expression, value


def tool_trajectory(record: PromptRecord, *, use_tool: bool) -> list[Segment]:
    """The trajectory the warm-up teaches for a products record, in the rollout's pieces."""
    expression, value = _operands(record)
    think = f"<think>{expression}</think>"
    answer = f"<answer>{value}</answer>"
    if not use_tool:
        return [Segment(text=think + answer)]
    stdout = f"{value}\n"  # what `print` writes; the sandbox returns it as the observation
    return [Segment(text=f"{think}{TOOL_OPEN}print({expression}){TOOL_CLOSE}"),
            Segment(text=OBSERVATION_TEMPLATE.format(content=stdout), observation=True),
            Segment(text=answer)]


def tool_solution_examples(*, num_examples: int, seed: int, config: Mapping[str, Any],
                           exclude_prompts: Collection[str] = (),
                           tool_fraction: float = 0.5) -> list[SFTExample]:
    """`num_examples` SFT examples (distinct prompts, none in `exclude_prompts`), the response a
    whole trajectory, its observation a piece of its own (in the sequence, not trained on).
    `tool_fraction` of them, spread evenly (example i calls the tool when floor((i + 1) * f)
    exceeds floor(i * f)), call the tool; the others answer directly."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    records = tool_prompts(num_prompts=num_examples, seed=seed, config=config,
                           exclude_prompts=exclude_prompts)
    examples = []
    for i, record in enumerate(records):
        use_tool = math.floor((i + 1) * tool_fraction) > math.floor(i * tool_fraction)
        pieces = [(s.text, s.observation) for s in tool_trajectory(record, use_tool=use_tool)]
        examples.append(SFTExample.from_pieces(record.prompt, pieces))
    return examples
