"""The dataset layouts a prompt file may be in, told apart by their columns, and the reading of one
row of each into a PromptRecord (docs/data.md):

- "megatron_rl": our own JSON form, `id`, `task`, `prompt`, optional `answer` / `tests` /
  `metadata` (PromptRecord.to_json).
- "verl": verl's RL datasets, `data_source`, `prompt` (a list of chat messages), `ability`,
  `reward_model` ({"style", "ground_truth"}), `extra_info` ({"split", "index", ...}). The task
  comes from `data_source` by VERL_MATH_DATA_SOURCES (the sources verl itself grades as math),
  else from `ability` when it is "math"; the answer is `reward_model.ground_truth`; the id is
  "<data_source>/<extra_info.split>/<extra_info.index>" (row number without an index).
- "question_answer": plain question / answer sets such as GSM8K, `question`, `answer`, optional
  `id`, graded as "math". A GSM8K answer ends in "#### <number>": the number (commas dropped) is
  the reference; any other answer is taken whole. Without an `id` column, the id is
  "<file name>/<row number>".

Each reader raises ValueError whose text says what is wrong and how to fix it; the caller puts
where (file and line or row) in front.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megatron_rl.data.records import PromptRecord

LAYOUT_COLUMNS = {
    "megatron_rl": "id, task, prompt (+ answer / tests / metadata)",
    "verl": "data_source, prompt, reward_model.ground_truth (+ ability, extra_info)",
    "question_answer": "question, answer (+ id)",
}
# verl's data sources that its default reward grades as math
# (verl/utils/reward_score/__init__.py: gsm8k, math, math_dapo, prime_math).
VERL_MATH_DATA_SOURCES = (
    "openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500", "math_dapo", "numina_aops_forum", "numina_synthetic_math",
    "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads",
)
VERL_MATH_PREFIXES = ("aime",)  # aime2024, aime2025, ...: graded as math_dapo by verl
_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def detect_layout(row: Any) -> str:
    """The layout of a file whose first row is `row`, by its columns."""
    if not isinstance(row, Mapping):
        raise ValueError(f"a prompt must be a JSON object (a row of named columns), got "
                         f"{type(row).__name__}")
    if "data_source" in row:
        return "verl"
    if "task" in row or "prompt" in row:
        return "megatron_rl"
    if "question" in row:
        return "question_answer"
    accepted = "; ".join(f"{name}: {columns}" for name, columns in LAYOUT_COLUMNS.items())
    raise ValueError(f"the columns {sorted(row)[:10]} match no accepted layout ({accepted}); "
                     "rename the columns or convert the file (docs/data.md)")


def verl_task(data_source: str, ability: Any) -> str | None:
    """Our task tag for a verl row, or None when neither its data source nor its ability is one
    we grade."""
    if data_source in VERL_MATH_DATA_SOURCES or data_source.startswith(VERL_MATH_PREFIXES):
        return "math"
    return "math" if ability == "math" else None


def _verl_record(row: Mapping[str, Any], *, index: int, source: Path) -> PromptRecord:
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise ValueError("'data_source' must name the dataset (e.g. 'openai/gsm8k'), got "
                         f"{data_source!r}")
    task = verl_task(data_source, row.get("ability"))
    if task is None:
        raise ValueError(
            f"verl data_source {data_source!r} (ability {row.get('ability')!r}) is not one we "
            f"grade: the math sources are {', '.join(VERL_MATH_DATA_SOURCES)}, aime*, or any "
            "with ability 'math'; set ability to 'math' for a math set, or convert the rows to "
            "megatron_rl's layout with a 'task' (docs/data.md)")
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str) or not truth.strip():
        raise ValueError(f"no reward_model.ground_truth (got reward_model={reward_model!r:.80}); "
                         "a verl math row needs its reference answer there")
    extra = row.get("extra_info")
    extra = extra if isinstance(extra, Mapping) else {}
    number = extra.get("index", f"row{index}")
    split = extra.get("split")
    prompt_id = f"{data_source}/{split}/{number}" if split else f"{data_source}/{number}"
    prompt = row.get("prompt")
    if not isinstance(prompt, (str, list, tuple)) or not prompt:
        raise ValueError(f"'prompt' must be a list of chat messages (or a text), got "
                         f"{prompt!r:.80}")
    return PromptRecord.with_prompt(prompt if isinstance(prompt, str) else list(prompt),
                                    prompt_id=prompt_id, task=task, answer=truth.strip(),
                                    metadata={"data_source": data_source})


def reference_answer(answer: str) -> str:
    """The reference in a question/answer set's answer: GSM8K's "... #### 1,234" -> "1234"; any
    other answer whole (stripped)."""
    found = _GSM8K_ANSWER.search(answer)
    return found.group(1).replace(",", "") if found else answer.strip()


def _question_answer_record(row: Mapping[str, Any], *, index: int,
                            source: Path) -> PromptRecord:
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"'question' must be a non-empty text, got {question!r:.80}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not reference_answer(answer):
        raise ValueError(f"'answer' must be a non-empty text (GSM8K's '... #### 42' or the "
                         f"answer itself), got {answer!r:.80}")
    prompt_id = row.get("id")
    if prompt_id in (None, ""):
        prompt_id = f"{source.stem or source.name}/{index}"
    return PromptRecord(prompt_id=str(prompt_id), task="math", prompt=question,
                        answer=reference_answer(answer))


def _megatron_rl_record(row: Mapping[str, Any], *, index: int, source: Path) -> PromptRecord:
    return PromptRecord.from_json(row)


LAYOUT_READERS: dict[str, Callable[..., PromptRecord]] = {
    "megatron_rl": _megatron_rl_record,
    "verl": _verl_record,
    "question_answer": _question_answer_record,
}
