"""Forced interruption's bookkeeping (megatron_rl/rollout/interruption.py, samples.py): which
requests are made, with what input and budget, and how the segments become one sample (offsets,
loss masks, behaviour log-probs, per-token versions). The generation call is a scripted stand-in
(scheduling logic only); the live-server path is tested in tests/integration."""
import asyncio
import random

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.rollout.interruption import (InterruptionSettings, find_subsequence,
                                              generate_completion)
from megatron_rl.rollout.samples import NOT_SAMPLED, Segment, assemble_sample
from megatron_rl.rollout.types import GenerationResult

pytestmark = pytest.mark.unit

PHRASE, THINK_END = (90, 91, 92), (7, 8)
SETTINGS = InterruptionSettings(thinking_budget_min=5, thinking_budget=5, solution_budget=6,
                                phrase_ids=PHRASE, think_end_ids=THINK_END)


class Script:
    """Answers each request with the next scripted (tokens, finish, version) and records it (and
    the extra stop tokens of each request in `stops`)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests = []
        self.stops = []
        self.continuations = []  # per request: flagged as a continuation of the completion

    async def __call__(self, input_ids, max_new_tokens, *, stop_token_ids=(),
                       continuation=False):
        self.requests.append((tuple(input_ids), max_new_tokens))
        self.stops.append(tuple(stop_token_ids))
        self.continuations.append(continuation)
        tokens, finish, version = self.answers.pop(0)
        assert len(tokens) <= max_new_tokens
        return GenerationResult(prompt_index=0, sample_index=0, prompt_token_ids=tuple(input_ids),
                                token_ids=tuple(tokens),
                                logprobs=tuple(-0.1 * (i + 1) for i in range(len(tokens))),
                                versions=(version,) * len(tokens), finish_reason=finish)


def _run(script, settings=SETTINGS, seed=0):
    return asyncio.run(generate_completion(script, (1, 2), settings=settings,
                                           rng=random.Random(seed), group_id=3, sample_index=1))


def test_interrupted_inside_the_thinking_part():
    script = Script(((10, 11, 12, 13, 14), "length", 4), ((20, 21), "stop", 5))
    sample = _run(script)
    # The second request continues from prompt + output + phrase, with what the phrase leaves
    # of the solution budget (6 - 3).
    assert script.requests == [((1, 2), 5), ((1, 2, 10, 11, 12, 13, 14, 90, 91, 92), 3)]
    assert script.continuations == [False, True]  # the answer goes before fresh requests
    assert sample.token_ids == (10, 11, 12, 13, 14, 90, 91, 92, 20, 21)
    assert sample.loss_mask == (1, 1, 1, 1, 1, 0, 0, 0, 1, 1)
    assert sample.versions == (4,) * 5 + (NOT_SAMPLED,) * 3 + (5, 5)
    assert sample.logprobs[5:8] == (0.0, 0.0, 0.0) and sample.logprobs[8] == pytest.approx(-0.1)
    assert sample.segment_offsets == (0, 5, 8)
    assert sample.interrupted and sample.finish_reason == "stop" and not sample.truncated
    assert (sample.oldest_version, sample.newest_version) == (4, 5)
    assert sample.num_loss_tokens == 7 and sample.thinking_budget == 5
    assert (sample.group_id, sample.sample_index, sample.prompt_token_ids) == (3, 1, (1, 2))


def test_thinking_ended_before_the_budget_continues_without_the_phrase():
    # "</think>" (7, 8) at positions 1-2: the answer used 2 of its 6 tokens in the first request.
    script = Script(((10, 7, 8, 30, 31), "length", 0), ((32, 33, 34), "stop", 0))
    sample = _run(script)
    assert script.requests[1] == ((1, 2, 10, 7, 8, 30, 31), 4)
    assert not sample.interrupted and sample.loss_mask == (1,) * 8
    assert sample.segment_offsets == (0, 5)


def test_a_finished_first_request_is_the_whole_completion():
    script = Script(((10, 7, 8, 30), "stop", 2))
    sample = _run(script)
    assert len(script.requests) == 1 and sample.finish_reason == "stop"
    assert sample.token_ids == (10, 7, 8, 30) and sample.thinking_budget == 5


def test_no_room_left_is_a_truncation_at_the_solution_budget():
    """A marker of two tokens cannot be a server-side stop: the first request wrote 3 answer
    tokens after "</think>" where solution_budget allows 2. The answer is cut at 2 (finish
    "length"), not left bounded by the thinking budget."""
    settings = InterruptionSettings(thinking_budget_min=5, thinking_budget=5, solution_budget=2,
                                    phrase_ids=(90,), think_end_ids=THINK_END)
    script = Script(((7, 8, 30, 31, 32), "length", 0))
    sample = _run(script, settings)
    assert len(script.requests) == 1 and script.stops == [()]
    assert sample.token_ids == (7, 8, 30, 31) and sample.logprobs == pytest.approx(
        (-0.1, -0.2, -0.3, -0.4))
    assert sample.truncated and not sample.interrupted


def test_an_answer_after_an_early_think_end_gets_the_solution_budget_not_the_thinking_budget():
    """The rule (docs/pipeline.md, Forced interruption): thinking <= the drawn budget B, answer
    (after the end-of-thinking marker) <= solution_budget. With a one-token marker the thinking
    request stops there (SGLang stop_token_ids) and the answer is a request of solution_budget
    tokens; a model that closes its thinking at token 2 of B = 50 gets 6 answer tokens, not 48."""
    settings = InterruptionSettings(thinking_budget_min=50, thinking_budget=50, solution_budget=6,
                                    phrase_ids=PHRASE, think_end_ids=(7,))
    script = Script(((10, 7), "stop", 0), ((30, 31, 32, 33, 34, 35), "length", 0))
    sample = _run(script, settings)
    assert script.requests == [((1, 2), 50), ((1, 2, 10, 7), 6)]
    assert script.stops == [(7,), ()]  # only the thinking request stops at the marker
    assert sample.token_ids == (10, 7, 30, 31, 32, 33, 34, 35) and sample.truncated
    assert not sample.interrupted and sample.loss_mask == (1,) * 8
    # A server that ignored the stop (SGLang does with ignore_eos) wrote 40 answer tokens in
    # the thinking request: the completion is cut at 6 of them.
    ignored = Script(((10, 7) + (30,) * 40, "length", 0))
    cut = _run(ignored, settings)
    assert len(ignored.requests) == 1 and cut.token_ids == (10, 7) + (30,) * 6
    assert cut.finish_reason == "length"
    # An answer that finishes within the budget, in the thinking request or after it: as is.
    assert _run(Script(((10, 7, 30), "stop", 0)), settings).token_ids == (10, 7, 30)
    finished = _run(Script(((10, 7), "stop", 0), ((30, 31), "stop", 0)), settings)
    assert finished.token_ids == (10, 7, 30, 31) and finished.finish_reason == "stop"


def test_a_cut_request_keeps_the_routed_experts_of_the_positions_it_keeps():
    from megatron_rl.rollout.samples import truncate_segments

    rows = torch.arange(6, dtype=torch.uint8).reshape(6, 1)  # prompt 2 + output 5 - 1 positions
    segment = Segment(token_ids=(7, 8, 30, 31, 32), logprobs=(-1.0,) * 5, versions=(0,) * 5,
                      routed_experts=rows)
    [cut] = truncate_segments([segment, Segment(token_ids=(90,), sampled=False)], 3)
    assert cut.token_ids == (7, 8, 30) and cut.routed_experts.tolist() == [[0], [1], [2], [3]]
    sample = assemble_sample(group_id=0, sample_index=0, prompt_token_ids=(1, 2),
                             segments=[cut], finish_reason="length")
    assert sample.routed_experts.shape == (4, 1)  # prompt + completion - 1


def test_the_interruption_phrase_is_spaced_from_a_thinking_that_does_not_end_in_whitespace():
    """"... = -3" + "Okay, time is up." must not read "-3Okay, time is up.": the phrase is
    appended after a space unless the thinking ends in whitespace (byte-level tokenizer: one
    token per byte, so the bytes are the text)."""
    rollout = load_config(None, ["rollout.thinking_budget=4", "rollout.thinking_budget_min=4",
                                 "rollout.solution_budget=200"]).rollout
    encode = lambda text: list(text.encode())  # noqa: E731
    decode = lambda ids: bytes(ids).decode(errors="replace")  # noqa: E731
    settings = InterruptionSettings.from_rollout_config(rollout, encode, decode=decode)
    phrase = rollout.interruption_phrase

    def completion(thinking: str, settings=settings) -> str:
        thought = tuple(thinking.encode())
        script = Script((thought, "length", 0), ((ord("7"),), "stop", 0))
        return decode(_run(script, settings).token_ids)

    assert completion("= -3") == f"= -3 {phrase}7"
    assert completion("-3.\n") == f"-3.\n{phrase}7"  # already separated: no extra space
    blind = InterruptionSettings.from_rollout_config(rollout, encode)  # no decode: spaced
    assert completion("-3.\n", blind) == f"-3.\n {phrase}7"
    with pytest.raises(ValueError, match=r"phrase \(\d+ tokens\) leaves no room"):
        InterruptionSettings.from_rollout_config(load_config(None, [
            f"rollout.solution_budget={len(phrase.encode()) + 1}"]).rollout, encode)


def test_without_forced_interruption_one_request_of_the_whole_budget():
    settings = InterruptionSettings(enabled=False, thinking_budget_min=5, thinking_budget=5,
                                    solution_budget=6)
    script = Script(((10,) * 11, "length", 0))
    sample = _run(script, settings)
    assert script.requests == [((1, 2), 11)] and sample.truncated
    assert sample.thinking_budget is None


def test_budgets_are_drawn_in_range_and_reproducibly():
    settings = InterruptionSettings(thinking_budget_min=3, thinking_budget=9, solution_budget=6,
                                    phrase_ids=PHRASE, think_end_ids=THINK_END)
    budgets = []
    for seed in range(40):
        script = Script(((10,), "stop", 0))
        budgets.append(_run(script, settings, seed).thinking_budget)
        assert script.requests[0][1] == budgets[-1]
    assert set(budgets) <= set(range(3, 10)) and len(set(budgets)) > 3
    assert budgets[:5] == [_run(Script(((10,), "stop", 0)), settings, s).thinking_budget
                           for s in range(5)]


def test_settings_from_the_run_config_and_their_errors():
    rollout = load_config(None, ["rollout.thinking_budget=96", "rollout.thinking_budget_min=64",
                                 "rollout.solution_budget=100"]).rollout
    encode = lambda text: list(text.encode())  # noqa: E731 (a byte-level tokenizer)
    settings = InterruptionSettings.from_rollout_config(rollout, encode)
    assert settings.phrase_ids == tuple(rollout.interruption_phrase.encode())
    assert settings.think_end_ids == tuple(b"</think>")
    assert (settings.thinking_budget_min, settings.thinking_budget, settings.solution_budget) \
        == (64, 96, 100)
    with pytest.raises(ValueError, match="leaves no room in solution_budget"):
        InterruptionSettings.from_rollout_config(
            load_config(None, ["rollout.solution_budget=10"]).rollout, encode)
    off = InterruptionSettings.from_rollout_config(
        load_config(None, ["rollout.forced_interruption=false"]).rollout, encode)
    assert not off.enabled and off.phrase_ids == ()
    assert settings.continuation_priority == off.continuation_priority == 1
    fcfs = InterruptionSettings.from_rollout_config(
        load_config(None, ["rollout.continuations_first=false"]).rollout, encode)
    assert fcfs.continuation_priority is None


def test_a_continuation_is_sent_with_its_priority_and_a_fresh_request_without():
    """bind_generate -> AsyncSGLangClient.generate_one: the priority goes to SGLang only on a
    continuation, and only when rollout.continuations_first set one."""
    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.interruption import bind_generate

    class Client:
        def __init__(self):
            self.calls = []

        async def generate_one(self, input_ids, max_new_tokens, params, **kwargs):
            self.calls.append(kwargs)

    async def requests(priority):
        client = Client()
        generate_one = bind_generate(client, SamplingParams(max_new_tokens=1), extra_key="v0",
                                     continuation_priority=priority)
        await generate_one((1,), 4)
        await generate_one((1, 2), 4, continuation=True)
        return client.calls

    assert asyncio.run(requests(1)) == [{"extra_key": "v0"}, {"extra_key": "v0", "priority": 1}]
    assert asyncio.run(requests(None)) == [{"extra_key": "v0"}, {"extra_key": "v0"}]


def test_samples_refuse_inconsistent_segments():
    assert find_subsequence((1, 7, 8, 7, 8), (7, 8)) == 1
    assert find_subsequence((1, 7), (7, 8)) is None
    with pytest.raises(ValueError, match="sampled segment"):
        Segment(token_ids=(1, 2), logprobs=(-1.0,), versions=(0, 0))
    with pytest.raises(ValueError, match="no log-probs or versions"):
        Segment(token_ids=(1,), logprobs=(-1.0,), versions=(0,), sampled=False)
    empty = assemble_sample(group_id=0, sample_index=0, prompt_token_ids=(1,), segments=[],
                            finish_reason="abort")
    assert empty.oldest_version is None and empty.num_loss_tokens == 0


def test_aborted_request_is_resubmitted_with_what_is_left_of_its_budget():
    """pause_mode abort ends running requests at a weight update: the completion goes on from
    prompt + output so far; the old tokens keep their version, the new ones carry the next."""
    script = Script(((10, 11), "abort", 4), ((12, 13, 14), "length", 5),
                    ((20, 21), "stop", 5))
    sample = _run(script)
    assert script.requests == [((1, 2), 5), ((1, 2, 10, 11), 3),
                               ((1, 2, 10, 11, 12, 13, 14, 90, 91, 92), 3)]
    assert script.continuations == [False, True, True]  # a resubmission continues it too
    assert sample.token_ids == (10, 11, 12, 13, 14, 90, 91, 92, 20, 21)
    assert sample.versions == (4, 4, 5, 5, 5) + (NOT_SAMPLED,) * 3 + (5, 5)
    assert sample.loss_mask == (1,) * 5 + (0,) * 3 + (1, 1)
    assert sample.segment_offsets == (0, 2, 5, 8)
    assert sample.interrupted and sample.finish_reason == "stop"


def test_abort_in_the_answer_and_an_abort_with_no_tokens_are_resubmitted():
    script = Script(((10, 11, 12, 13, 14), "length", 4), ((20,), "abort", 4),
                    ((), "abort", 4), ((21, 22), "stop", 5))
    sample = _run(script)
    phrase_end = (1, 2, 10, 11, 12, 13, 14, 90, 91, 92)
    assert script.requests == [((1, 2), 5), (phrase_end, 3), (phrase_end + (20,), 2),
                               (phrase_end + (20,), 2)]
    assert sample.token_ids[-3:] == (20, 21, 22) and sample.versions[-3:] == (4, 5, 5)
    assert sample.finish_reason == "stop"


def test_abort_that_fills_the_budget_counts_as_length_and_idle_aborts_are_an_error():
    off = InterruptionSettings(enabled=False, thinking_budget_min=3, thinking_budget=3,
                               solution_budget=1)
    sample = _run(Script(((10, 11), "abort", 1), ((12, 13), "abort", 1)), settings=off)
    assert sample.token_ids == (10, 11, 12, 13) and sample.finish_reason == "length"
    from megatron_rl.rollout.interruption import MAX_IDLE_ABORTS
    from megatron_rl.rollout.types import GeneratorError

    with pytest.raises(GeneratorError, match="aborted before producing a token"):
        _run(Script(*[((), "abort", 1)] * MAX_IDLE_ABORTS), settings=off)
