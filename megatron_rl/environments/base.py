"""The environment interface (DESIGN.md "Rewards are environments"; docs/environments.md): what a
trajectory is generated against. A verifier is the simplest environment (one turn, a score); a
tool environment runs the model's calls (in the code sandbox) and answers with their output, for
as many turns as the rollout allows.

The rollout (megatron_rl/rollout/multi_turn.py) owns the tokens; an environment sees and writes
text:
- `initial_messages(record)`: the conversation the policy is prompted with (tokenised once, at
  data load, with the tokenizer's chat template where it has one);
- `start(record)` -> an `EnvironmentSession`, one per trajectory;
- `session.step(turn_text, final=...)`: the model's turn as decoded text -> a `StepResult`: the
  observation messages to show it next (rendered to token ids by a `TurnFormat`, appended with
  loss mask 0), or done with the trajectory's reward. `final=True` tells the environment that
  the rollout will give it no further turn (the turn limit or the token budget is reached, or the
  turn was cut by length): it must then answer done, with its verdict on what it has;
- `session.close()`: always called, also when the trajectory is cancelled.

Failures, as with verifiers (rewards/types.py): a tool that fails or times out is an observation
the model reads (counted in `StepResult.tool_errors`), never an exception. An environment whose
own infrastructure fails (the sandbox server unreachable, a grader down) ends the trajectory with
`done=True` and a reward result whose reason is a verifier failure (`Reason.SANDBOX_ERROR` /
`Reason.VERIFIER_ERROR`, reward None): the group is then dropped as a group with a failed verifier
is today. An exception out of `step` is confined to its trajectory the same way
(`Reason.VERIFIER_ERROR`).
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence

from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.types import RewardResult

# One chat message as the environment writes it: {"role": "tool" | "user" | ..., "content": ...}.
Message = Mapping[str, str]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What an environment answers to one model turn."""

    done: bool
    observation: tuple[Message, ...] = ()  # shown to the model next; () when done
    reward: RewardResult | None = None  # the trajectory's verdict; required when done
    tool_calls: int = 0  # calls the turn made
    tool_errors: int = 0  # of those, failed / timed out / over a limit (an observation)
    tool_seconds: float = 0.0  # wall time they ran (not waiting to run): perf/tool_run_seconds

    def __post_init__(self) -> None:
        if self.done and self.reward is None:
            raise ValueError("a StepResult that ends the trajectory (done=True) needs its reward "
                             "(a RewardResult; a verifier failure has reason sandbox_error or "
                             "verifier_error)")
        if not self.done and self.reward is not None:
            raise ValueError("a StepResult with a reward must end the trajectory (done=True)")
        if not self.done and not self.observation:
            raise ValueError("a StepResult that does not end the trajectory needs an observation "
                             "(the messages the model reads next)")
        if not 0 <= self.tool_errors <= self.tool_calls:
            raise ValueError(f"tool_errors ({self.tool_errors}) must be within 0..tool_calls "
                             f"({self.tool_calls})")


class EnvironmentSession(abc.ABC):
    """One trajectory's state in its environment."""

    @abc.abstractmethod
    async def step(self, turn: str, *, final: bool = False) -> StepResult:
        """The model's turn (its decoded text, the turn's stop text included) -> what follows.
        With `final` the result must be done (the rollout gives no further turn)."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Release what the trajectory held (always called, also on cancellation)."""


class Environment(abc.ABC):
    """A task's environment. Register one per task tag (or tag family, "prefix/") in an
    `EnvironmentRegistry`, as verifiers are registered in a `RewardRegistry`."""

    # False: one turn scored by a verifier, generated and scored exactly as before environments
    # existed (the rollout batches the scoring of a group); True: the multi-turn loop.
    multi_turn: bool = True
    # Texts that end a model turn besides the end of sequence (e.g. "</tool>"): each must be one
    # token of the policy tokenizer (sent to SGLang as stop token ids; checked at start).
    stop_texts: tuple[str, ...] = ()

    def initial_messages(self, record: PromptRecord) -> list[dict[str, str]]:
        """The conversation the policy is prompted with (default: the record's own)."""
        return record.conversation

    @abc.abstractmethod
    async def start(self, record: PromptRecord) -> EnvironmentSession:
        """A new trajectory of `record`."""


def check_messages(messages: Sequence[Message], what: str) -> None:
    """ValueError naming the message that is not {"role": str, "content": str}."""
    for index, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{what}: message {index} must be {{'role': str, 'content': str}}, "
                             f"got {message!r:.120}")
