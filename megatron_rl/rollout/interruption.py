"""Forced interruption at generation time (ScaleRL length control, SCALERL.md section 5): one
completion as a small state machine over generation requests to the same server.

The rule: the thinking part is bounded by a budget B drawn uniformly in [thinking_budget_min,
thinking_budget]; everything after the end of the thinking (the model's own end-of-thinking
marker "</think>", or the interruption phrase, which ends with it) is the answer, bounded by
solution_budget. So a completion has at most B + solution_budget tokens, and a model that closes
its thinking early gets solution_budget tokens of answer, not the rest of B.

1. Generate up to B tokens, stopping at the end-of-thinking marker (SGLang `stop_token_ids` when
   the marker is one token, as in reasoning models' tokenizers).
2. Finished (stop) without closing the thinking: done.
3. Stopped at the marker (or cut by length after it): continue the answer with a second request
   for what is left of solution_budget. A server that did not stop at the marker (a marker of
   several tokens) may have written more answer than solution_budget inside the first request:
   the completion is cut at the limit (finish reason "length"), as if generation had stopped
   there; the tokens before it keep their log-probs, which later tokens do not change.
4. Cut by length inside the thinking part: append the interruption phrase (tokenized once, never
   re-tokenizing the output; not sampled: loss mask 0) and continue from prompt + output + phrase
   for the solution budget, which the phrase counts against. The phrase is preceded by a space
   unless the thinking already ends in whitespace (`InterruptionSettings.phrase_after`), so that
   "... = -3" never becomes "-3Okay, time is up.".

Continuations send the token ids the server produced, so nothing is re-tokenized, and carry the
same `extra_key` (the group's prefix-cache key: its admission version) so that the prefix cache
serves their prompt. With rollout.continuations_first they go before the fresh requests waiting at
the engine (SGLang priority scheduling): SGLang serves its queue first come first served, and a
saturated engine (thousands of requests in flight) would make a completion that has thought to
its budget wait behind every thinking request queued meanwhile before it writes its answer, so
its group, and the step that needs it, would wait for all of them.

A request that comes back aborted (`weight_sync.pause_mode: abort` ends running requests for a
weight update) is resubmitted from prompt + everything generated so far, for what is left of its
budget: its tokens keep the versions and log-probs of the policy that produced them, and the
resubmission waits inside SGLang until generation continues. A completion is never cut short by
an update. Aborts that make no progress `MAX_IDLE_ABORTS` times in a row are an error.
Without forced interruption a completion is one request of thinking_budget + solution_budget
tokens.

A turn (`generate_turn`) is this state machine after any prefix: a single-turn completion is one
turn after its prompt (`generate_completion`); a multi-turn trajectory (multi_turn.py) generates
each turn after the prompt and its history, with the environment's turn stop ids added to every
request of the turn and a cap, the trajectory's remaining token budget. A cap below
thinking_budget + solution_budget makes the turn one plain request of the capped number of tokens
(no budget drawn, no forced interruption: the trajectory's budget is the binding limit then, and
splitting what is left of it into a thinking and an answer part would invent budgets the config
does not state).

The generation call is injected (`GenerateOne`), so this runs over the SGLang client in
the rollout manager and over a scripted stand-in in unit tests.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Awaitable, Callable, Sequence

from megatron_rl.algorithms.length_control import sample_thinking_budget
from megatron_rl.rollout.samples import RolloutSample, Segment, assemble_sample, truncate_segments
from megatron_rl.rollout.types import GenerationResult, GeneratorError, SamplingParams

# (input token ids, max new tokens, *, stop_token_ids=extra stop tokens, continuation=True for
# a request that continues a completion) -> one completion of them. The stop token, when
# matched, is the completion's last token (finish reason "stop"); `continuation` is passed only
# when true.
GenerateOne = Callable[..., Awaitable[GenerationResult]]
# Consecutive aborted requests that returned no token before a completion is given up.
MAX_IDLE_ABORTS = 8
# SGLang priority of a continuation (rollout.continuations_first): the servers run with priority
# scheduling and default priority 0 (megatron_rl.rollout.sglang_server), higher values first.
CONTINUATION_PRIORITY = 1


def bind_generate(client, params: SamplingParams, *, extra_key: str | None,
                  continuation_priority: int | None = None) -> GenerateOne:
    """The GenerateOne of one sample: `client.generate_one` (AsyncSGLangClient) with the sample's
    sampling parameters (its own seed: SamplingParams.for_sample) and prefix-cache key. A
    continuation is sent with SGLang priority `continuation_priority`
    (InterruptionSettings.continuation_priority; None: no priority is sent)."""
    def generate_one(input_ids: Sequence[int], max_new_tokens: int, *,
                     stop_token_ids: Sequence[int] = (), continuation: bool = False):
        request = params if not stop_token_ids else dataclasses.replace(
            params, stop_token_ids=params.stop_token_ids + tuple(stop_token_ids))
        if continuation and continuation_priority is not None:
            return client.generate_one(input_ids, max_new_tokens, request, extra_key=extra_key,
                                       priority=continuation_priority)
        return client.generate_one(input_ids, max_new_tokens, request, extra_key=extra_key)
    return generate_one


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class InterruptionSettings:
    enabled: bool = True
    thinking_budget_min: int = 10240
    thinking_budget: int = 12288
    solution_budget: int = 2048
    phrase_ids: tuple[int, ...] = ()  # the interruption phrase, tokenized once
    think_end_ids: tuple[int, ...] = ()  # the end-of-thinking marker ("</think>"), tokenized
    # The phrase tokenized after a space, for a thinking that does not end in whitespace (the
    # tokenizer merges the space into the phrase's first word); () = always `phrase_ids`.
    spaced_phrase_ids: tuple[int, ...] = ()
    # token ids -> text (the policy tokenizer's decode): tells whether the thinking ends in
    # whitespace. None: the spaced phrase always (a double space at worst, never glued text).
    decode: Callable[[Sequence[int]], str] | None = dataclasses.field(default=None,
                                                                      compare=False)
    # SGLang priority of the requests that continue a completion (its answer after the thinking,
    # a request resubmitted after an abort): before the fresh requests waiting at the engine
    # (rollout.continuations_first; None: no priority, first come first served).
    continuation_priority: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.thinking_budget_min <= self.thinking_budget:
            raise ValueError(f"thinking budgets need 0 < thinking_budget_min "
                             f"({self.thinking_budget_min}) <= thinking_budget "
                             f"({self.thinking_budget})")
        if self.solution_budget < 1:
            raise ValueError(f"solution_budget must be >= 1, got {self.solution_budget}")
        if self.enabled and not (self.phrase_ids and self.think_end_ids):
            raise ValueError("forced interruption needs the tokenized interruption phrase and "
                             "end-of-thinking marker (phrase_ids, think_end_ids)")
        longest = max(len(self.phrase_ids), len(self.spaced_phrase_ids))
        if self.enabled and longest >= self.solution_budget:
            raise ValueError(f"the interruption phrase ({longest} tokens) leaves no "
                             f"room in solution_budget ({self.solution_budget}); raise "
                             "rollout.solution_budget or shorten rollout.interruption_phrase")

    @classmethod
    def from_rollout_config(cls, rollout, encode: Callable[[str], Sequence[int]], *,
                            decode: Callable[[Sequence[int]], str] | None = None,
                            think_end: str = "</think>") -> "InterruptionSettings":
        """From megatron_rl.config's RolloutConfig; `encode` is the policy tokenizer's text ->
        ids without special tokens (e.g. `lambda s: tok.encode(s, add_special_tokens=False)`),
        `decode` its ids -> text (to see whether a thinking ends in whitespace)."""
        priority = CONTINUATION_PRIORITY if rollout.continuations_first else None
        if not rollout.forced_interruption:
            return cls(enabled=False, thinking_budget_min=rollout.thinking_budget_min,
                       thinking_budget=rollout.thinking_budget,
                       solution_budget=rollout.solution_budget, continuation_priority=priority)
        phrase = rollout.interruption_phrase
        phrase_ids = tuple(encode(phrase))
        spaced = phrase_ids if phrase[:1].isspace() else tuple(encode(" " + phrase))
        return cls(enabled=True, thinking_budget_min=rollout.thinking_budget_min,
                   thinking_budget=rollout.thinking_budget,
                   solution_budget=rollout.solution_budget, phrase_ids=phrase_ids,
                   spaced_phrase_ids=spaced, think_end_ids=tuple(encode(think_end)),
                   decode=decode, continuation_priority=priority)

    def phrase_after(self, thought: Sequence[int]) -> tuple[int, ...]:
        """The phrase's tokens to append after `thought`: spaced unless the thought ends in
        whitespace (or no spaced form is known)."""
        if not self.spaced_phrase_ids:
            return self.phrase_ids
        if thought and self.decode is not None and self.decode([thought[-1]])[-1:].isspace():
            return self.phrase_ids
        return self.spaced_phrase_ids

    @property
    def max_response_tokens(self) -> int:
        return self.thinking_budget + self.solution_budget


def find_subsequence(tokens: Sequence[int], pattern: Sequence[int]) -> int | None:
    """Index of the first occurrence of `pattern` in `tokens`, or None."""
    n = len(pattern)
    if n == 0:
        return None
    first = pattern[0]
    for i in range(len(tokens) - n + 1):
        if tokens[i] == first and tuple(tokens[i:i + n]) == tuple(pattern):
            return i
    return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """One turn's generation: its segments (sampled requests, and the interruption phrase when
    it was forced), the finish reason of its last request, and the thinking budget drawn for it
    (None: no forced interruption in this turn)."""

    segments: tuple[Segment, ...]
    finish_reason: str
    thinking_budget: int | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.token_ids)

    @property
    def interrupted(self) -> bool:
        """The interruption phrase was appended."""
        return any(not s.sampled for s in self.segments)


def _sampled(result: GenerationResult) -> Segment:
    return Segment.from_generation(result)  # with the routed experts, when requested


async def _generate(generate_one: GenerateOne, prefix: tuple[int, ...], budget: int, *,
                    stop_token_ids: tuple[int, ...] = (),
                    continuation: bool = False) -> tuple[list[Segment], str]:
    """Up to `budget` tokens after `prefix` as sampled segments and the finish reason ("stop" or
    "length"), resubmitting aborted requests (see the module docstring). `continuation`: `prefix`
    holds generated tokens already; a resubmission always does."""
    segments: list[Segment] = []
    produced: tuple[int, ...] = ()
    idle_aborts = 0
    while True:
        result = await generate_one(prefix + produced, budget - len(produced),
                                    stop_token_ids=stop_token_ids,
                                    **({"continuation": True} if continuation or produced
                                       else {}))
        if result.token_ids or result.finish_reason != "abort":
            segments.append(_sampled(result))
            produced += tuple(result.token_ids)
        if result.finish_reason != "abort":
            return segments, result.finish_reason
        if len(produced) >= budget:
            return segments, "length"
        idle_aborts = 0 if result.token_ids else idle_aborts + 1
        if idle_aborts >= MAX_IDLE_ABORTS:
            raise GeneratorError(f"{MAX_IDLE_ABORTS} requests in a row were aborted before "
                                 "producing a token; is something other than the weight sync "
                                 "aborting requests on this generator?")


async def generate_completion(generate_one: GenerateOne, prompt_ids: Sequence[int], *,
                              settings: InterruptionSettings, rng: random.Random, group_id: int,
                              sample_index: int) -> RolloutSample:
    """One completion of `prompt_ids`, with forced interruption when `settings.enabled`."""
    prompt = tuple(int(t) for t in prompt_ids)
    turn = await generate_turn(generate_one, prompt, settings=settings, rng=rng)
    return assemble_sample(group_id=group_id, sample_index=sample_index, prompt_token_ids=prompt,
                           segments=turn.segments, finish_reason=turn.finish_reason,
                           thinking_budget=turn.thinking_budget)


async def generate_turn(generate_one: GenerateOne, prefix_ids: Sequence[int], *,
                        settings: InterruptionSettings, rng: random.Random,
                        stop_token_ids: Sequence[int] = (), max_tokens: int | None = None,
                        continuation: bool = False) -> Turn:
    """One turn after `prefix_ids` (a prompt, or a prompt and a trajectory's history), with
    forced interruption when `settings.enabled`. `stop_token_ids` end the turn besides the end of
    sequence (sent with every request of the turn); `max_tokens` caps its tokens (None:
    thinking_budget + solution_budget; below that, one plain request: module docstring);
    `continuation`: the prefix holds generated tokens already (its requests go as continuations,
    rollout.continuations_first)."""
    prefix = tuple(int(t) for t in prefix_ids)
    stops = tuple(int(t) for t in stop_token_ids)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"a turn needs room for at least one token, got max_tokens={max_tokens}")
    capped = max_tokens is not None and max_tokens < settings.max_response_tokens
    if not settings.enabled or capped:
        budget = settings.max_response_tokens if max_tokens is None else min(
            max_tokens, settings.max_response_tokens)
        segments, finish = await _generate(generate_one, prefix, budget, stop_token_ids=stops,
                                           continuation=continuation)
        return Turn(segments=tuple(segments), finish_reason=finish)
    budget = sample_thinking_budget(rng, settings.thinking_budget_min, settings.thinking_budget)

    def _turn(segments: Sequence[Segment], finish: str) -> Turn:
        return Turn(segments=tuple(segments), finish_reason=finish, thinking_budget=budget)

    marker = settings.think_end_ids
    segments, finish = await _generate(
        generate_one, prefix, budget,
        stop_token_ids=(marker if len(marker) == 1 else ()) + stops, continuation=continuation)
    thought = tuple(t for s in segments for t in s.token_ids)
    end = find_subsequence(thought, marker)
    if end is None:
        if finish != "length":  # finished without closing its thinking: nothing to answer
            return _turn(segments, finish)
        phrase = settings.phrase_after(thought)  # still thinking at the budget: force the answer
        segments.append(Segment(token_ids=phrase, sampled=False))
        remaining = settings.solution_budget - len(phrase)
    else:  # the model closed its thinking: what follows is the answer, in solution_budget
        answer_start = end + len(marker)
        answered = len(thought) - answer_start
        if answered > settings.solution_budget:  # the server did not stop at the marker
            return _turn(truncate_segments(segments, answer_start + settings.solution_budget),
                         "length")
        if answered == settings.solution_budget or (finish == "stop" and answered > 0):
            return _turn(segments, finish)  # the answer is complete or at its limit
        remaining = settings.solution_budget - answered
    so_far = prefix + tuple(t for s in segments for t in s.token_ids)
    answer, finish = await _generate(generate_one, so_far, remaining, stop_token_ids=stops,
                                     continuation=True)
    return _turn(segments + answer, finish)
