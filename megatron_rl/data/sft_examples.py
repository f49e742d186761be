"""Supervised (cold-start) training examples: a prompt and the response the policy should learn to
write after it, as JSON Lines objects {"prompt": ..., "response": ...}. The prompt is the text the
RL run's generators are given (the same tokenization applies); only the response carries loss.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from megatron_rl.data.loading import iter_jsonl


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SFTExample:
    prompt: str
    response: str

    def __post_init__(self) -> None:
        for name in ("prompt", "response"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"SFTExample.{name} must be a non-empty string, got {value!r}")

    def to_json(self) -> dict[str, str]:
        return {"prompt": self.prompt, "response": self.response}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, where: str = "") -> "SFTExample":
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}an SFT example must be a JSON object, got "
                             f"{type(obj).__name__}")
        missing = [key for key in ("prompt", "response")
                   if not isinstance(obj.get(key), str) or not obj.get(key)]
        if missing:
            raise ValueError(f"{where}missing or empty field(s) {missing}: every SFT example "
                             "needs a non-empty 'prompt' and 'response' string")
        return cls(prompt=obj["prompt"], response=obj["response"])


def load_sft_examples(path: str | os.PathLike) -> list[SFTExample]:
    """All examples of a .jsonl file, in file order (blank lines skipped)."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise ValueError(f"SFT data {str(path)!r} must be a .jsonl file of "
                         '{"prompt": ..., "response": ...} objects')
    if not path.is_file():
        raise ValueError(f"SFT data file {str(path)!r} does not exist")
    examples = [SFTExample.from_json(obj, where=where) for obj, where in iter_jsonl(path)]
    if not examples:
        raise ValueError(f"SFT data file {str(path)!r} has no examples")
    return examples


def save_sft_examples(examples: Iterable[SFTExample], path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(e.to_json(), ensure_ascii=False) + "\n" for e in examples)
