"""Observation messages as token ids, appended after the model's turn so that the next turn starts
where the served model expects, without re-tokenising anything the model wrote (its tokens stay as
it sampled them: trainer and generator see the same sequence, and the history stays a prefix for
SGLang's prefix cache).

- `ChatTemplateTurns`: tokenizers with a chat template. The observation's ids are a delta: a fixed
  conversation ending with an assistant message is rendered, then rendered again with the
  observation appended and the generation prompt; the second must extend the first (checked), and
  what it adds is the observation. The template's closure of an assistant message (what follows
  its content, e.g. "<|im_end|>\\n") is prepended when the model's turn stopped at a stop text
  (e.g. "</tool>") rather than at the template's end-of-turn token.
- `PlainTurns`: tokenizers without one (the demo's): each message through a text template, e.g.
  "<output>{content}</output>", no closure.

`stop_token_ids` turns an environment's stop texts into the single token ids SGLang stops on
(sglang/srt/sampling/sampling_params.py: SamplingParams.stop_token_ids).
"""
from __future__ import annotations

import abc
from collections.abc import Sequence

from megatron_rl.environments.base import Message, check_messages

# The fixed conversation the deltas are taken after; distinctive content, so that it is found in
# the rendering even where a template adds text around an assistant message (e.g. a think block).
_PROBE_USER = {"role": "user", "content": "PROBE-QUESTION"}
_PROBE_ANSWER = "PROBE-ANSWER"


class TurnFormat(abc.ABC):
    """How observation messages become the tokens that follow a model turn."""

    @abc.abstractmethod
    def observation_ids(self, messages: Sequence[Message], *,
                        turn_closed: bool) -> tuple[int, ...]:
        """The ids to append after the model's turn, through the next generation prompt.
        `turn_closed`: the turn ended with the template's end-of-turn token (the first token of
        its closure, e.g. <|im_end|>), so that token is already in the sequence; False when it
        stopped at a stop text (e.g. "</tool>") and the whole closure must be added."""


class ChatTemplateTurns(TurnFormat):
    """Observations rendered by the tokenizer's chat template, as a delta (module docstring)."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatTemplateTurns needs a tokenizer with a chat template; use "
                             "PlainTurns (turn_format_for picks it) for one without")
        self._tokenizer = tokenizer
        self._history = [_PROBE_USER, {"role": "assistant", "content": _PROBE_ANSWER}]
        self._history_text = self._render(self._history, add_generation_prompt=False)
        end = self._history_text.rfind(_PROBE_ANSWER)
        if end < 0:
            raise ValueError(f"the chat template of {self._name} does not render an assistant "
                             "message's content; it cannot carry multi-turn trajectories")
        self._closure_text = self._history_text[end + len(_PROBE_ANSWER):]
        self.closure_ids: tuple[int, ...] = self._encode(self._closure_text)

    @property
    def _name(self) -> str:
        return repr(getattr(self._tokenizer, "name_or_path", "") or "the tokenizer")

    def _render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja raises its own types (TemplateError)
            roles = ", ".join(m["role"] for m in messages)
            raise ValueError(f"the chat template of {self._name} cannot render a conversation "
                             f"({roles}): {type(exc).__name__}: {exc}. Use observation roles "
                             "it accepts (ToolSettings.role, e.g. 'user')") from exc

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))

    def observation_ids(self, messages: Sequence[Message], *,
                        turn_closed: bool) -> tuple[int, ...]:
        check_messages(messages, "observation")
        if not messages:
            raise ValueError("observation_ids needs at least one message")
        text = self._render([*self._history, *messages], add_generation_prompt=True)
        if not text.startswith(self._history_text):
            roles = ", ".join(m["role"] for m in messages)
            raise ValueError(
                f"the chat template of {self._name} renders the conversation differently once "
                f"observation messages ({roles}) follow the assistant's turn (the history is not "
                "a prefix of the longer rendering), so the trajectory's tokens cannot be carried "
                "across turns; use a template that renders past turns as they are, or another "
                "observation role (ToolSettings.role)")
        # One encoding of closure + observation: the tokens the whole conversation would give.
        ids = self._encode(self._closure_text + text[len(self._history_text):])
        if not turn_closed or not self.closure_ids:
            return ids
        if ids[:1] != self.closure_ids[:1]:  # cannot happen with special-token closures
            raise ValueError(f"the chat template of {self._name}: its closure's first token "
                             f"{self.closure_ids[0]} does not start the observation's encoding")
        return ids[1:]


class PlainTurns(TurnFormat):
    """Each message as `template.format(role=..., content=...)`, encoded without special
    tokens and concatenated; there is no closure to add."""

    def __init__(self, tokenizer, template: str = "{content}") -> None:
        try:
            template.format(role="", content="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"plain turn template {template!r} must be a str.format template "
                             f"using only {{content}} and {{role}} ({type(exc).__name__}: "
                             f"{exc})") from None
        if "{content}" not in template:
            raise ValueError(f"plain turn template {template!r} must contain {{content}}, "
                             "e.g. '<output>{content}</output>'")
        self._tokenizer, self.template = tokenizer, template

    def observation_ids(self, messages: Sequence[Message], *,
                        turn_closed: bool) -> tuple[int, ...]:
        check_messages(messages, "observation")
        if not messages:
            raise ValueError("observation_ids needs at least one message")
        return tuple(token for m in messages for token in self._tokenizer.encode(
            self.template.format(role=m["role"], content=m["content"]), add_special_tokens=False))


def turn_format_for(tokenizer, plain_template: str = "{content}") -> TurnFormat:
    """ChatTemplateTurns when the tokenizer has a chat template, else PlainTurns."""
    if getattr(tokenizer, "chat_template", None):
        return ChatTemplateTurns(tokenizer)
    return PlainTurns(tokenizer, plain_template)


def stop_token_ids(tokenizer, stop_texts: Sequence[str]) -> tuple[int, ...]:
    """The token id of each stop text; ValueError when one is not exactly one token."""
    ids = []
    for text in stop_texts:
        encoded = list(tokenizer.encode(text, add_special_tokens=False))
        if len(encoded) != 1:
            raise ValueError(
                f"stop text {text!r} is {len(encoded)} tokens {encoded} of the policy tokenizer, "
                "but a turn can only stop on one token: add it to the tokenizer as a token "
                "(tokenizer.add_tokens, as megatron_rl/data/tokenizer.py does for its tags, "
                "resizing the model's embeddings) or choose a stop text that is one token")
        ids.append(encoded[0])
    return tuple(ids)
