"""Multi-turn rollouts (issue 41; docs/environments.md "Multi-turn rollouts: masks, versions,
budgets"): one trajectory of a prompt against its environment (environments/base.py), as one
RolloutSample the trainer reads as one sequence.

The rules:
- Tokens: turn k is generated after prompt + every token so far (turns and observations), the
  token ids carried, never re-tokenised text, so that trainer and generator see the same
  sequence. Each turn is `interruption.generate_turn`: forced interruption applies to the
  thinking inside a turn, a request aborted by a weight update is resubmitted from everything so
  far, and every request carries the sample's `extra_key` (the group's prefix-cache key: the
  history is a prefix of the next turn's input, which the prefix cache serves). Turns after the
  first are sent as continuations (rollout.continuations_first): the trajectory holds tokens
  already.
- A turn ends at the end of sequence, at one of the environment's `turn_stop_ids` (added to
  every request of the turn), or at its cap. Its decoded text (stop text included) goes to
  `session.step`; an observation comes back as messages, rendered by the `TurnFormat` to token
  ids (`turn_closed`: the turn ended with one of `end_of_turn_ids`, so the format need not close
  it) and appended as an inserted segment: loss mask 0, behaviour log-prob 0.0, version
  NOT_SAMPLED. Every sampled token keeps the policy version that produced it, across turns and
  in-flight weight updates.
- Budgets: `max_trajectory_tokens` bounds the completion side (model and observation tokens);
  each turn is capped by what is left of it and by thinking_budget + solution_budget (a turn
  capped below that is one plain request: interruption.py). The last turn is the one at
  `max_turns`, the one that leaves no token of the budget, or one cut by length: it is stepped
  with `final=True` and the environment answers with its verdict. An observation that leaves no
  room for one more model token is not appended: the trajectory is truncated before it and the
  verdict asked with `session.step("", final=True)` (no further turn).
- Failures: a tool failure is an observation (the environment's business). An exception out of
  `environment.start` or `session.step`, or a final step that is not done, ends the trajectory
  with a verifier failure (Reason.VERIFIER_ERROR, reward None: the group is dropped downstream
  as with a failed verifier), never a crash of the rollouts. So does an environment that does not
  answer: `start`, each `step` and `close` are awaited at most `step_timeout_s`
  (environment.step_timeout_s), then cancelled, so that a hung environment (a tool service that
  stopped answering) costs its group, not the run: the step waits on every group it admitted.
  The wait includes the environment's own queue (a tool call waiting for a sandbox worker).
  Only an environment that yields to the event loop can be timed out (one that blocks it, e.g.
  `time.sleep` in `step`, stops every rollout of the process: run blocking work in a thread).
  Generator failures (GeneratorDeadError) and cancellation propagate, as for single-turn samples
  (the manager re-queues the group). `session.close()` is always called.
- The sample: `finish_reason` of the last turn, `interrupted` if any turn was forcibly
  interrupted, `thinking_budget` the first turn's drawn budget, and `trajectory` its
  `TrajectoryStats` (turns, tool calls, prefill vs decode tokens per request: prefill = input -
  cached, the request's input being the prompt and the sample's tokens before its segment).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from megatron_rl.rollout.interruption import (GenerateOne, InterruptionSettings,
                                               generate_completion, generate_turn)
from megatron_rl.rollout.samples import RolloutSample, Segment, assemble_sample
from megatron_rl.rewards.types import Reason, RewardResult

logger = logging.getLogger(__name__)


class TurnFormat(Protocol):
    """What the rollout needs of megatron_rl.environments' TurnFormat."""

    def observation_ids(self, messages, *, turn_closed: bool) -> tuple[int, ...]: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrajectoryStats:
    """What one trajectory cost and did (the run's metrics sum them per step)."""

    turns: int
    tool_calls: int
    tool_errors: int
    tool_seconds: float  # in session.step
    generation_seconds: float  # waiting for the turns' requests
    decode_tokens: int  # sampled (model) tokens
    observation_tokens: int  # inserted by the environment (loss mask 0)
    prefill_tokens: int  # sum over requests of input - cached (input when cached unknown)
    cached_tokens: int  # sum over requests of the prefix-cache hits reported
    requests: int  # generation requests that returned tokens or finished
    # The tools' own run time (StepResult.tool_seconds): tool_seconds less it is the time in
    # session.step spent otherwise, e.g. waiting for a sandbox worker, or grading.
    tool_run_seconds: float = 0.0

    def __setstate__(self, state) -> None:
        """Unpickle, also a checkpoint's stats written before tool_run_seconds (one value
        fewer: the later fields take their defaults)."""
        fields = dataclasses.fields(self)
        for field, value in zip(fields, state):
            object.__setattr__(self, field.name, value)
        for field in fields[len(state):]:
            object.__setattr__(self, field.name, field.default)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MultiTurnSettings:
    """An environment's turn limits and stop tokens."""

    max_turns: int
    max_trajectory_tokens: int  # completion side: model + observation tokens
    turn_stop_ids: tuple[int, ...] = ()  # end a model turn (Environment.stop_texts)
    end_of_turn_ids: tuple[int, ...] = ()  # EOS ids: a turn ending with one is closed
    # Longest wait for the environment's start, one step or close (environment.step_timeout_s).
    step_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_trajectory_tokens < 1:
            raise ValueError(f"max_trajectory_tokens must be >= 1, got "
                             f"{self.max_trajectory_tokens}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")


def _failure(detail: str) -> RewardResult:
    return RewardResult(reward=None, reason=Reason.VERIFIER_ERROR, pass_fraction=0.0,
                        detail=detail[:2000])


class _NoAnswer(Exception):
    """The environment did not answer within its step_timeout_s (`_within`)."""


async def _within(awaitable, timeout_s: float, what: str):
    """`awaitable`'s result; _NoAnswer naming `what` when `timeout_s` passes first (it is then
    cancelled). Its own exceptions propagate as they are (a TimeoutError of its own is not a
    missed answer), and a cancellation of the caller cancels it."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        # What it raises while being cancelled is not waited for: retrieve it, unlogged.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise _NoAnswer(f"{what} did not answer within {timeout_s:g} s "
                        "(environment.step_timeout_s); it was cancelled")
    return task.result()


async def generate_trajectory(generate_one: GenerateOne, prompt_ids: Sequence[int], *, session,
                              turn_format: TurnFormat, settings: MultiTurnSettings,
                              interruption: InterruptionSettings, rng: random.Random,
                              group_id: int, sample_index: int,
                              decode: Callable[[Sequence[int]], str]
                              ) -> tuple[RolloutSample, RewardResult]:
    """One trajectory of `prompt_ids` in `session` (an EnvironmentSession), by the module
    docstring's rules; the session is closed whatever happens."""
    try:
        sample, result = await _trajectory(
            generate_one, tuple(int(t) for t in prompt_ids), session=session,
            turn_format=turn_format, settings=settings, interruption=interruption, rng=rng,
            group_id=group_id, sample_index=sample_index, decode=decode)
    except BaseException:
        # What is propagating (a dead generator, a cancel) wins.
        await _close(session, settings.step_timeout_s, quiet=True)
        raise
    closed = await _close(session, settings.step_timeout_s, quiet=False)
    return sample, result if closed is None else _failure(closed)


async def _close(session, timeout_s: float, *, quiet: bool) -> str | None:
    """session.close(); its failure as a text (None: closed)."""
    try:
        await _within(session.close(), timeout_s, "session.close()")
    except _NoAnswer as exc:
        failure = str(exc)
    except Exception as exc:  # noqa: BLE001 - the environment's failure, confined to its sample
        failure = f"session.close() raised {type(exc).__name__}: {exc}"
    else:
        return None
    if quiet:
        logger.warning("closing an environment session failed: %s", failure)
    return failure


async def _trajectory(generate_one: GenerateOne, prompt: tuple[int, ...], *, session,
                      turn_format: TurnFormat, settings: MultiTurnSettings,
                      interruption: InterruptionSettings, rng: random.Random, group_id: int,
                      sample_index: int, decode: Callable[[Sequence[int]], str]
                      ) -> tuple[RolloutSample, RewardResult]:
    segments: list[Segment] = []
    history: tuple[int, ...] = ()  # completion tokens so far: turns and observations
    turns = tool_calls = tool_errors = observation_tokens = 0
    tool_seconds = tool_run_seconds = generation_seconds = 0.0
    interrupted, budgets, finish = False, [], "stop"

    async def step(text: str, final: bool):
        nonlocal tool_calls, tool_errors, tool_seconds, tool_run_seconds
        started = time.perf_counter()
        try:
            answer = await _within(session.step(text, final=final), settings.step_timeout_s,
                                   f"the environment's step (turn {turns})")
        except _NoAnswer as exc:
            return None, _failure(str(exc))
        except Exception as exc:  # noqa: BLE001 - an environment failure: this sample's verdict
            return None, _failure(f"environment step raised {type(exc).__name__}: {exc}")
        finally:
            tool_seconds += time.perf_counter() - started
        tool_calls += answer.tool_calls
        tool_errors += answer.tool_errors
        tool_run_seconds += answer.tool_seconds
        if final and not answer.done:
            return None, _failure("the environment did not end the trajectory on its final step "
                                  "(step(..., final=True) must answer done with a reward)")
        return answer, (answer.reward if answer.done else None)

    while True:
        remaining = settings.max_trajectory_tokens - len(history)
        started = time.perf_counter()
        turn = await generate_turn(generate_one, prompt + history, settings=interruption,
                                   rng=rng, stop_token_ids=settings.turn_stop_ids,
                                   max_tokens=remaining, continuation=turns > 0)
        generation_seconds += time.perf_counter() - started
        turns += 1
        segments += turn.segments
        tokens = turn.token_ids
        history += tokens
        finish = turn.finish_reason
        interrupted |= turn.interrupted
        budgets.append(turn.thinking_budget)
        remaining -= len(tokens)
        final = turns >= settings.max_turns or remaining <= 0 or finish == "length"
        answer, result = await step(decode(tokens), final)
        if result is not None:
            break
        closed = bool(tokens) and tokens[-1] in settings.end_of_turn_ids
        observation = tuple(int(t) for t in turn_format.observation_ids(answer.observation,
                                                                        turn_closed=closed))
        if len(observation) >= remaining:  # no room for a model token after it: truncate here
            _, result = await step("", True)
            break
        segments.append(Segment(token_ids=observation, sampled=False))
        history += observation
        observation_tokens += len(observation)

    prefill = cached = requests = 0
    offset = 0
    for segment in segments:
        if segment.sampled:
            requests += 1
            hit = segment.cached_tokens or 0
            cached += hit
            prefill += len(prompt) + offset - hit  # the request's input was everything before
        offset += len(segment.token_ids)
    stats = TrajectoryStats(
        turns=turns, tool_calls=tool_calls, tool_errors=tool_errors, tool_seconds=tool_seconds,
        tool_run_seconds=tool_run_seconds,
        generation_seconds=generation_seconds,
        decode_tokens=sum(len(s.token_ids) for s in segments if s.sampled),
        observation_tokens=observation_tokens, prefill_tokens=prefill, cached_tokens=cached,
        requests=requests)
    sample = assemble_sample(
        group_id=group_id, sample_index=sample_index, prompt_token_ids=prompt, segments=segments,
        finish_reason=finish, thinking_budget=next((b for b in budgets if b is not None), None),
        interrupted=interrupted, trajectory=stats)
    return sample, result


class MultiTurnRollout:
    """The multi-turn side of a run (run_setup builds it; the rollout manager and validation use
    it): which records are multi-turn, and their trajectories.

    `environments(record)` -> the record's Environment (EnvironmentRegistry.for_task);
    `turn_format` renders observations; `settings_for(environment)` -> its MultiTurnSettings
    (stop ids per environment); `decode` is the policy tokenizer's ids -> text (special tokens
    kept: a turn's stop text reaches the environment)."""

    def __init__(self, *, environments: Callable, turn_format: TurnFormat,
                 settings_for: Callable, decode: Callable[[Sequence[int]], str]):
        self.environments = environments
        self.turn_format = turn_format
        self.settings_for = settings_for
        self.decode = decode

    def is_multi_turn(self, record) -> bool:
        return bool(self.environments(record).multi_turn)

    async def run(self, generate_one: GenerateOne, prompt_ids: Sequence[int], record, *,
                  interruption: InterruptionSettings, rng: random.Random, group_id: int,
                  sample_index: int) -> tuple[RolloutSample, RewardResult]:
        """One trajectory of `record` (tokenized as `prompt_ids`) and its environment's verdict.
        An environment that fails to start gives an empty sample with a verifier failure."""
        environment = self.environments(record)
        settings = self.settings_for(environment)
        try:
            session = await _within(environment.start(record), settings.step_timeout_s,
                                    "the environment's start")
        except Exception as exc:  # noqa: BLE001 - an environment failure: this sample's verdict
            empty = assemble_sample(group_id=group_id, sample_index=sample_index,
                                    prompt_token_ids=prompt_ids, segments=(),
                                    finish_reason="abort")
            return empty, _failure(str(exc) if isinstance(exc, _NoAnswer) else
                                   f"environment start raised {type(exc).__name__}: {exc}")
        return await generate_trajectory(
            generate_one, prompt_ids, session=session, turn_format=self.turn_format,
            settings=settings, interruption=interruption, rng=rng, group_id=group_id,
            sample_index=sample_index, decode=self.decode)


async def generate_sample(generate_one: GenerateOne, prompt_ids: Sequence[int], record, *,
                          multi_turn: MultiTurnRollout | None,
                          interruption: InterruptionSettings, rng: random.Random, group_id: int,
                          sample_index: int) -> tuple[RolloutSample, RewardResult | None]:
    """One sample of `record`, as training and validation generate it: a trajectory and its
    environment's verdict when `multi_turn` says the record is multi-turn; else a completion
    (interruption.generate_completion) and None, its verifier scoring it afterwards (the rollout
    manager scores a group in one batch)."""
    if multi_turn is not None and multi_turn.is_multi_turn(record):
        return await multi_turn.run(generate_one, prompt_ids, record, interruption=interruption,
                                    rng=rng, group_id=group_id, sample_index=sample_index)
    return await generate_completion(generate_one, prompt_ids, settings=interruption, rng=rng,
                                     group_id=group_id, sample_index=sample_index), None
