"""Supervised (cold-start) training examples: a prompt and the response the policy should learn to
write after it, as JSON Lines objects {"prompt": ..., "response": ...}. The prompt is the text the
RL run's generators are given (the same tokenization applies); only the response carries loss.

A multi-turn response (a tool-use trajectory) also holds text the model does not write: the
environment's observations, e.g. a tool's output. As in RL, where they carry loss mask 0, they are
in the sequence but not trained on: the response is then a list of pieces, each a string (the
model's text) or {"observation": string} (inserted text),

    {"prompt": "347 * 29?", "response": ["<tool>print(347 * 29)</tool>",
                                          {"observation": "<output>10063\n</output>"},
                                          "<answer>10063</answer>"]}

and each piece is tokenized on its own (megatron_rl/sft.py), as the rollout tokenizes an
observation apart from the turns around it. `SFTExample.response` is the whole text either way;
`observations` holds the observation pieces' character spans in it.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.data.loading import iter_jsonl

_PIECES = ('a piece is a string (the model\'s text, trained on) or {"observation": string} '
           "(inserted text, not trained on)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SFTExample:
    prompt: str
    response: str
    # (start, end) character spans of `response` that are observations (no loss), in order.
    observations: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("prompt", "response"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"SFTExample.{name} must be a non-empty string, got {value!r}")
        end = 0
        for start, stop in self.observations:
            if not end <= start < stop <= len(self.response):
                raise ValueError(f"SFTExample.observations: {self.observations} must be "
                                 f"non-empty, ordered, non-overlapping spans within the "
                                 f"response ({len(self.response)} characters)")
            end = stop
        if sum(stop - start for start, stop in self.observations) == len(self.response):
            raise ValueError("SFTExample: the response is all observation; the model's own "
                             "text is what SFT trains on")

    @classmethod
    def from_pieces(cls, prompt: str, pieces: Sequence[tuple[str, bool]]) -> "SFTExample":
        """From (text, is_observation) pieces, in order (empty texts dropped)."""
        response, spans = "", []
        for text, observation in pieces:
            if observation and text:
                spans.append((len(response), len(response) + len(text)))
            response += text
        return cls(prompt=prompt, response=response, observations=tuple(spans))

    def pieces(self) -> list[tuple[str, bool]]:
        """The response as (text, is_observation) pieces, in order."""
        pieces, end = [], 0
        for start, stop in self.observations:
            if start > end:
                pieces.append((self.response[end:start], False))
            pieces.append((self.response[start:stop], True))
            end = stop
        if end < len(self.response):
            pieces.append((self.response[end:], False))
        return pieces

    def to_json(self) -> dict[str, Any]:
        if not self.observations:
            return {"prompt": self.prompt, "response": self.response}
        return {"prompt": self.prompt,
                "response": [{"observation": text} if observation else text
                             for text, observation in self.pieces()]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, where: str = "") -> "SFTExample":
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}an SFT example must be a JSON object, got "
                             f"{type(obj).__name__}")
        response = obj.get("response")
        prompt = obj.get("prompt")
        missing = [key for key, ok in (("prompt", isinstance(prompt, str) and prompt),
                                       ("response", isinstance(response, str | list) and response))
                   if not ok]
        if missing:
            raise ValueError(f"{where}missing or empty field(s) {missing}: every SFT example "
                             "needs a non-empty 'prompt' string and a 'response': a non-empty "
                             "string, or a list of pieces (" + _PIECES + ")")
        if isinstance(response, str):
            return cls(prompt=prompt, response=response)
        pieces = []
        for index, piece in enumerate(response):
            if isinstance(piece, str):
                pieces.append((piece, False))
            elif isinstance(piece, Mapping) and set(piece) == {"observation"} and \
                    isinstance(piece["observation"], str):
                pieces.append((piece["observation"], True))
            else:
                raise ValueError(f"{where}response piece {index} is {json.dumps(piece)[:80]}; "
                                 + _PIECES)
        try:
            return cls.from_pieces(prompt, pieces)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None


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
