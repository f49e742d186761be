"""Multi-turn rollouts' bookkeeping (megatron_rl/rollout/multi_turn.py, the manager's and
validation's multi-turn path, TrainBatch of a trajectory): which requests are made (input = the
prompt and the history's token ids, stop ids, budgets, continuation), how turns and observations
become one sample (loss mask, versions, log-probs, routed experts), turn and token limits, and
failures. The generation call, the environment and the turn format are scripted stand-ins
(scheduling logic only); the live path (real SGLang, real sandbox) is the e2e's."""
import asyncio
import dataclasses
import json
import pickle
import random

import pytest
import torch

from megatron_rl.environments.base import Environment, EnvironmentSession, StepResult
from megatron_rl.rewards.types import Reason, RewardResult
from megatron_rl.rollout.interruption import InterruptionSettings
from megatron_rl.rollout.multi_turn import (MultiTurnRollout, MultiTurnSettings,
                                            generate_trajectory)
from megatron_rl.rollout.samples import NOT_SAMPLED
from megatron_rl.rollout.types import GenerationResult

pytestmark = pytest.mark.unit

STOP, EOS, OPEN = 99, 3, 30  # the tool-call end, end of sequence, the format's turn closer
PLAIN = InterruptionSettings(enabled=False, thinking_budget_min=4, thinking_budget=4,
                             solution_budget=4)  # turns of at most 8 tokens
CORRECT = RewardResult(reward=1.0, reason=Reason.CORRECT, pass_fraction=1.0)


class Script:
    """A scripted generate_one (stand-in): answers each request with the next (tokens, finish,
    version, cached tokens) and records (input, max new tokens, stop ids, continuation)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests = []

    async def __call__(self, input_ids, max_new_tokens, *, stop_token_ids=(),
                       continuation=False):
        self.requests.append((tuple(input_ids), max_new_tokens, tuple(stop_token_ids),
                              continuation))
        tokens, finish, version, cached = self.answers.pop(0)
        assert len(tokens) <= max_new_tokens
        return GenerationResult(prompt_index=0, sample_index=0, prompt_token_ids=tuple(input_ids),
                                token_ids=tuple(tokens),
                                logprobs=tuple(-0.1 * (i + 1) for i in range(len(tokens))),
                                versions=(version,) * len(tokens), finish_reason=finish,
                                cached_tokens=cached)


class Session(EnvironmentSession):
    """A scripted environment session (stand-in): answers each step with the next scripted
    StepResult (or raises it), recording (text, final); counts closes."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.steps = []
        self.closed = 0

    async def step(self, turn, *, final=False):
        self.steps.append((turn, final))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def close(self):
        self.closed += 1


class Format:
    """A stand-in TurnFormat: an observation's content is its token ids ("40 41"), preceded by
    OPEN when the model's turn was not closed; records each `turn_closed`."""

    def __init__(self):
        self.closed = []

    def observation_ids(self, messages, *, turn_closed):
        self.closed.append(turn_closed)
        ids = tuple(int(t) for m in messages for t in m["content"].split())
        return ids if turn_closed else (OPEN, *ids)


def decode(ids):
    return " ".join(map(str, ids))


def observe(content, calls=1, errors=0, seconds=0.0):
    return StepResult(done=False, observation=({"role": "tool", "content": content},),
                      tool_calls=calls, tool_errors=errors, tool_seconds=seconds)


def done(result=CORRECT):
    return StepResult(done=True, reward=result)


def settings(max_turns=3, max_trajectory_tokens=50):
    return MultiTurnSettings(max_turns=max_turns, max_trajectory_tokens=max_trajectory_tokens,
                             turn_stop_ids=(STOP,), end_of_turn_ids=(EOS,))


def run(script, session, turn_settings=None, interruption=PLAIN, fmt=None):
    return asyncio.run(generate_trajectory(
        script, (1, 2), session=session, turn_format=fmt or Format(),
        settings=turn_settings or settings(), interruption=interruption,
        rng=random.Random(0), group_id=4, sample_index=1, decode=decode))


def test_three_turns_are_one_sample_with_observations_masked_and_ids_carried():
    script = Script(((10, 11, STOP), "stop", 0, 0), ((20, EOS), "stop", 0, 2),
                    ((21, 22), "stop", 0, 8))
    session = Session(observe("40 41", calls=1, errors=1, seconds=0.25),
                      observe("42", seconds=0.5), done())
    fmt = Format()
    sample, result = run(script, session, fmt=fmt)
    assert result == CORRECT
    # Each request reads the prompt and the history as token ids, with the turn's stop id;
    # turns after the first continue the trajectory.
    assert script.requests == [
        ((1, 2), 8, (STOP,), False),
        ((1, 2, 10, 11, STOP, OPEN, 40, 41), 8, (STOP,), True),
        ((1, 2, 10, 11, STOP, OPEN, 40, 41, 20, EOS, 42), 8, (STOP,), True)]
    assert sample.token_ids == (10, 11, STOP, OPEN, 40, 41, 20, EOS, 42, 21, 22)
    assert sample.loss_mask == (1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1)
    assert sample.versions == (0, 0, 0) + (NOT_SAMPLED,) * 3 + (0, 0, NOT_SAMPLED, 0, 0)
    assert sample.logprobs[3:6] == (0.0,) * 3 and sample.logprobs[8] == 0.0
    assert sample.logprobs[6] == pytest.approx(-0.1) and sample.logprobs[10] == pytest.approx(-0.2)
    assert sample.segment_offsets == (0, 3, 6, 8, 9)
    assert not sample.interrupted and sample.finish_reason == "stop"
    assert sample.thinking_budget is None and (sample.group_id, sample.sample_index) == (4, 1)
    # The environment saw the decoded turns (stop ids included); the last turn was final.
    assert session.steps == [("10 11 99", False), ("20 3", False), ("21 22", True)]
    assert fmt.closed == [False, True]  # the second turn ended with EOS
    assert session.closed == 1
    stats = sample.trajectory
    assert (stats.turns, stats.tool_calls, stats.tool_errors, stats.requests) == (3, 2, 1, 3)
    assert stats.tool_run_seconds == 0.75  # the environment's own figures, summed
    assert (stats.decode_tokens, stats.observation_tokens) == (7, 4)
    # input - cached per request: (2 - 0) + (8 - 2) + (11 - 8); cached 0 + 2 + 8
    assert (stats.prefill_tokens, stats.cached_tokens) == (11, 10)


def test_the_turn_limit_makes_the_last_turn_final_and_a_length_cut_too():
    session = Session(done())
    sample, _ = run(Script(((10, STOP), "stop", 0, None)), session, settings(max_turns=1))
    assert session.steps == [("10 99", True)] and sample.trajectory.turns == 1
    # Cut by length (8 tokens, the turn's cap) on turn 1 of 3: no further turn.
    session = Session(done())
    sample, _ = run(Script(((10,) * 8, "length", 0, None)), session)
    assert session.steps == [(decode((10,) * 8), True)] and sample.finish_reason == "length"
    # Unknown cached tokens: the whole input is prefill.
    assert sample.trajectory.prefill_tokens == 2 and sample.trajectory.cached_tokens == 0


def test_budget_caps_the_turn_and_an_observation_that_does_not_fit_truncates_the_trajectory():
    # 6 tokens: turn 1 takes 3, the observation (OPEN 40) 2; turn 2 is capped at the 1 left.
    script = Script(((10, 11, STOP), "stop", 0, None), ((20,), "stop", 0, None))
    session = Session(observe("40"), done())
    sample, _ = run(script, session, settings(max_trajectory_tokens=6))
    assert [r[1] for r in script.requests] == [6, 1]
    assert session.steps == [("10 11 99", False), ("20", True)]  # the budget is spent: final
    assert len(sample.token_ids) == 6
    # 5 tokens: turn 1 takes 3; the observation (2 tokens) leaves no room for a model token.
    script = Script(((10, 11, STOP), "stop", 0, None))
    session = Session(observe("40"), done())
    sample, result = run(script, session, settings(max_trajectory_tokens=5))
    assert session.steps == [("10 11 99", False), ("", True)] and result == CORRECT
    assert sample.token_ids == (10, 11, STOP) and sample.trajectory.observation_tokens == 0
    assert session.closed == 1


def test_an_environment_failure_is_the_samples_verifier_failure_and_the_session_is_closed():
    session = Session(observe("40"), RuntimeError("grader down"))
    sample, result = run(Script(((10, STOP), "stop", 0, None), ((20, EOS), "stop", 0, None)),
                         session)
    assert result.reason == Reason.VERIFIER_ERROR and result.reward is None
    assert "grader down" in result.detail and session.closed == 1
    assert sample.token_ids == (10, STOP, OPEN, 40, 20, EOS)
    # A final step that does not end the trajectory breaks the contract: a verifier failure too.
    session = Session(observe("40"))
    _, result = run(Script(((10, STOP), "stop", 0, None)), session, settings(max_turns=1))
    assert result.reason == Reason.VERIFIER_ERROR and "final" in result.detail


class Hung(Session):
    """A scripted session (stand-in) whose step `hang_at` (1-based), or close, never answers
    until cancelled; records the cancellations it saw."""

    def __init__(self, *answers, hang_at=None, hang_close=False):
        super().__init__(*answers)
        self.hang_at, self.hang_close, self.cancelled = hang_at, hang_close, []

    async def _hang(self, what):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(what)
            raise

    async def step(self, turn, *, final=False):
        if len(self.steps) + 1 == self.hang_at:
            self.steps.append((turn, final))
            await self._hang("step")
        return await super().step(turn, final=final)

    async def close(self):
        await super().close()
        if self.hang_close:
            await self._hang("close")


def test_an_environment_that_does_not_answer_ends_its_trajectory_not_the_run():
    """environment.step_timeout_s: a step, a close or a start that never answers is cancelled
    after the timeout and the trajectory is a verifier failure that says so; an environment's
    own TimeoutError is its failure, not a missed answer; a cancelled trajectory cancels the
    step it waits on."""
    def turns(timeout_s):
        return dataclasses.replace(settings(), step_timeout_s=timeout_s)

    two_turns = (((10, STOP), "stop", 0, None), ((20, EOS), "stop", 0, None))
    session = Hung(observe("40"), hang_at=2)
    sample, result = run(Script(*two_turns), session, turns(0.2))
    assert result.reason == Reason.VERIFIER_ERROR and result.reward is None
    assert "the environment's step (turn 2) did not answer within 0.2 s" in result.detail
    assert "environment.step_timeout_s" in result.detail
    assert session.cancelled == ["step"] and session.closed == 1
    assert sample.token_ids == (10, STOP, OPEN, 40, 20, EOS)  # what was generated stays

    session = Session(observe("40"), TimeoutError("tool service timed out"))
    _, result = run(Script(*two_turns), session, turns(30.0))
    assert result.detail == "environment step raised TimeoutError: tool service timed out"

    session = Hung(observe("40"), done(), hang_close=True)
    _, result = run(Script(*two_turns), session, turns(0.2))
    assert result.reason == Reason.VERIFIER_ERROR and session.cancelled == ["close"]
    assert "session.close() did not answer within 0.2 s" in result.detail

    class NeverStarts(Env):
        async def start(self, record):
            await asyncio.Event().wait()

    rollout = MultiTurnRollout(environments=lambda record: NeverStarts(),
                               turn_format=Format(), settings_for=lambda env: turns(0.2),
                               decode=decode)
    sample, result = asyncio.run(rollout.run(Script(), (1, 2), None, interruption=PLAIN,
                                             rng=random.Random(0), group_id=0, sample_index=0))
    assert sample.token_ids == () and sample.finish_reason == "abort"
    assert "the environment's start did not answer within 0.2 s" in result.detail

    async def cancelled_while_stepping():
        session = Hung(hang_at=1)
        task = asyncio.ensure_future(generate_trajectory(
            Script(((10, STOP), "stop", 0, None)), (1, 2), session=session,
            turn_format=Format(), settings=turns(30.0), interruption=PLAIN,
            rng=random.Random(0), group_id=0, sample_index=0, decode=decode))
        while not session.steps:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return session

    session = asyncio.run(cancelled_while_stepping())
    assert session.cancelled == ["step"] and session.closed == 1
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        turns(0.0)


def test_a_failed_trajectorys_group_can_be_recorded_in_the_ledger():
    """The step's ledger digest hashes every result's reward: a verifier failure (None) must
    not stop the run there (it hashes as NaN, unlike any reward)."""
    from megatron_rl.resilience.ledger import groups_digest
    from megatron_rl.rollout.manager import FinishedGroup

    session = Session(RuntimeError("sandbox unreachable"))
    sample, failed = run(Script(((10, STOP), "stop", 0, None)), session)
    group = FinishedGroup(group_id=0, prompt_index=0, admission_version=0, samples=(sample,),
                          results=(failed,))
    scored = dataclasses.replace(group, results=(CORRECT,))
    assert groups_digest([group]) != groups_digest([scored])


def test_an_aborted_request_inside_turn_two_is_resubmitted_and_tokens_keep_their_versions():
    # Turn 1 at v0; a weight update aborts turn 2 after one token (v0); the resubmission, from
    # everything so far, finishes at v1.
    script = Script(((10, STOP), "stop", 0, None), ((20,), "abort", 0, None),
                    ((21, EOS), "stop", 1, None))
    session = Session(observe("40"), done())
    sample, _ = run(script, session)
    assert script.requests[2] == ((1, 2, 10, STOP, OPEN, 40, 20), 7, (STOP,), True)
    assert sample.versions == (0, 0, NOT_SAMPLED, NOT_SAMPLED, 0, 1, 1)
    assert sample.loss_mask == (1, 1, 0, 0, 1, 1, 1)
    assert session.steps[1] == ("20 21 3", False)  # the whole turn, once
    assert (sample.oldest_version, sample.newest_version) == (0, 1)
    assert sample.trajectory.requests == 3 and sample.trajectory.turns == 2


def test_forced_interruption_inside_a_turn():
    interruption = InterruptionSettings(thinking_budget_min=5, thinking_budget=5,
                                        solution_budget=6, phrase_ids=(90, 91),
                                        think_end_ids=(7,))
    # Turn 1 thinks to its budget: the phrase is appended, the answer ends at the tool call.
    script = Script(((10, 11, 12, 13, 14), "length", 0, None), ((20, STOP), "stop", 0, None),
                    ((7, 21, EOS), "stop", 0, None))
    session = Session(observe("40"), done())
    sample, _ = run(script, session, interruption=interruption)
    # The thinking request stops at the marker or the tool call; the answer at the tool call.
    assert [r[2] for r in script.requests] == [(7, STOP), (STOP,), (7, STOP)]
    assert script.requests[1][:2] == ((1, 2, 10, 11, 12, 13, 14, 90, 91), 4)
    assert sample.token_ids == (10, 11, 12, 13, 14, 90, 91, 20, STOP, OPEN, 40, 7, 21, EOS)
    assert sample.loss_mask == (1,) * 5 + (0, 0) + (1, 1) + (0, 0) + (1, 1, 1)
    assert sample.interrupted and sample.thinking_budget == 5
    assert session.steps[0] == ("10 11 12 13 14 90 91 20 99", False)
    # A turn capped by the trajectory's budget below thinking + solution budget (11) is one
    # plain request of what is left: no budget drawn, no end-of-thinking stop.
    script = Script(((10, 11, STOP), "stop", 0, None))
    sample, _ = run(script, Session(done()), settings(max_trajectory_tokens=8),
                    interruption=interruption)
    assert script.requests == [((1, 2), 8, (STOP,), False)] and sample.thinking_budget is None
    # A trajectory without a forced interruption is not "interrupted" for its observations.
    script = Script(((7, 20, STOP), "stop", 0, None), ((7, 21, EOS), "stop", 0, None))
    sample, _ = run(script, Session(observe("40"), done()), interruption=interruption)
    assert not sample.interrupted


def test_a_trajectory_sample_pickles_and_its_stats_serialise():
    sample, _ = run(Script(((10, STOP), "stop", 0, 0)), Session(done()),
                    settings(max_turns=1))
    assert pickle.loads(pickle.dumps(sample)) == sample
    assert json.loads(json.dumps(dataclasses.asdict(sample.trajectory)))["turns"] == 1
    # Stats pickled before tool_run_seconds (a checkpoint's buffered groups) load, with 0.0.
    stats = sample.trajectory
    old = stats.__getstate__()[:-1]
    assert len(old) == len(dataclasses.fields(stats)) - 1
    loaded = object.__new__(type(stats))
    loaded.__setstate__(old)
    assert loaded == dataclasses.replace(stats, tool_run_seconds=0.0)


def test_a_trajectory_trains_as_one_sequence_with_observation_masks_and_merged_routing():
    """TrainBatch.from_groups of a 2-turn trajectory: mask 0 on prompt and observation tokens,
    the behaviour log-probs in place, and routing replay's table taking each position's row from
    the request that computed it (the observation's rows from turn 2's request)."""
    from megatron_rl.trainer.batch import TrainBatch

    def rows(n, mark):  # [n, 2] expert ids; column 1 tells the request
        return torch.stack([torch.arange(n), torch.full((n,), mark)], 1).to(torch.uint8)

    class Routed(Script):
        async def __call__(self, input_ids, max_new_tokens, **kw):
            result = await super().__call__(input_ids, max_new_tokens, **kw)
            n = len(input_ids) + len(result.token_ids) - 1
            return dataclasses.replace(result, routed_experts=rows(n, len(self.requests)))

    script = Routed(((10, STOP), "stop", 0, None), ((20, EOS), "stop", 1, None))
    sample, _ = run(script, Session(observe("40"), done()))
    batch = TrainBatch.from_groups([[sample]], [[0.5]])
    assert batch.token_ids[0].tolist() == [1, 2, 10, STOP, OPEN, 40, 20, EOS]
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert batch.old_logprobs[0][[4, 5]].tolist() == [0.0, 0.0]
    assert batch.old_logprobs[0][6].item() == pytest.approx(-0.1)
    table = batch.routed_experts[0]
    # Positions 0-2 (prompt, turn 1 up to its last input) from request 1; 3-6 from request 2.
    assert table[:, 0].tolist() == list(range(7))
    assert table[:, 1].tolist() == [1, 1, 1, 2, 2, 2, 2]


# ---------------------------------------------------------------- manager and validation


class Env(Environment):
    """A scripted 2-turn environment (stand-in): a tool call, then the verdict; records its
    sessions."""

    stop_texts = ("</tool>",)

    def __init__(self, multi_turn=True):
        self.multi_turn = multi_turn
        self.sessions = []

    async def start(self, record):
        session = Session(observe("40"), done())
        self.sessions.append(session)
        return session


class Client:
    """A stand-in generator client: answers (10, STOP) then (20, EOS) per sample (keyed by the
    seed), recording each request's extra_key; `hang_second` makes second turns wait until
    cancelled."""

    def __init__(self, hang_second=False):
        self.requests = []  # (input ids, extra_key, priority, seed)
        self.hang_second = hang_second

    async def generate_one(self, input_ids, max_new_tokens, params, *, extra_key=None,
                           priority=None):
        self.requests.append((tuple(input_ids), extra_key, priority, params.seed))
        second = STOP in input_ids
        if second and self.hang_second:
            await asyncio.Event().wait()
        tokens = (20, EOS) if second else (10, STOP)
        return GenerationResult(prompt_index=0, sample_index=0, prompt_token_ids=tuple(input_ids),
                                token_ids=tokens, logprobs=(-0.1, -0.2), versions=(0, 0),
                                finish_reason="stop")


def _rollout(env):
    return MultiTurnRollout(environments=lambda record: env, turn_format=Format(),
                            settings_for=lambda environment: settings(), decode=decode)


def _manager(clients, rollout, scored):
    from megatron_rl.algorithms import NoPositiveResamplingSampler
    from megatron_rl.data.records import PromptRecord
    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.manager import RolloutManager
    from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings

    def score(texts, records):
        scored.extend(texts)
        return [CORRECT] * len(texts)

    record = PromptRecord(prompt_id="p0", task="tool/x", prompt="1 + 1 =", answer="2")
    return RolloutManager(
        clients=clients, prompt_token_ids=[[1, 2]] * 4, records=[record] * 4,
        sampler=NoPositiveResamplingSampler(4, seed=0, enabled=False),
        gate=AdmissionGate(StalenessSettings(max_off_policyness=0, prompts_per_step=1)),
        params=SamplingParams(max_new_tokens=1, num_samples=2, seed=5),
        interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                          thinking_budget=4, solution_budget=4,
                                          continuation_priority=1),
        score=score, decode=decode, max_finished_groups=1, multi_turn=rollout)


def test_the_manager_runs_a_multi_turn_group_as_trajectories_scored_by_the_environment():
    from megatron_rl.rollout.types import derive_seed

    env, client, scored = Env(), Client(), []

    async def go():
        manager = _manager([client], _rollout(env), scored)
        manager.start()
        try:
            return await asyncio.wait_for(manager.take(1), timeout=30)
        finally:
            await manager.stop()

    (group,) = asyncio.run(go())
    assert scored == []  # the environment scored them, not the batch verifier
    assert group.results == (CORRECT, CORRECT)
    assert [s.token_ids for s in group.samples] == [(10, STOP, OPEN, 40, 20, EOS)] * 2
    assert all(s.trajectory.turns == 2 for s in group.samples)
    # Every request of the group with its prefix-cache key; second turns as continuations;
    # each sample its own seed, the same on both of its turns.
    assert {r[1] for r in client.requests} == {"v0-r0"}
    assert sorted((r[2] or 0, r[3]) for r in client.requests) == sorted(
        (p, derive_seed(5, "train", 0, k)) for k in (0, 1) for p in (0, 1))
    assert [s.closed for s in env.sessions] == [1, 1]
    # A single-turn environment takes today's path: the verifier scores the group.
    env, scored = Env(multi_turn=False), []
    client = Client()

    async def single():
        manager = _manager([client], _rollout(env), scored)
        manager.start()
        try:
            return await asyncio.wait_for(manager.take(1), timeout=30)
        finally:
            await manager.stop()

    (group,) = asyncio.run(single())
    assert scored == ["10 99", "10 99"] and env.sessions == []
    assert group.samples[0].trajectory is None


def test_mark_down_mid_trajectory_requeues_the_group_and_closes_its_sessions():
    env, hung, good, scored = Env(), Client(hang_second=True), Client(), []

    async def go():
        manager = _manager([hung, good], _rollout(env), scored)
        manager.start()
        try:
            while sum(STOP in r[0] for r in hung.requests) < 2:  # both in their second turn
                await asyncio.sleep(0.01)
            manager.mark_down(0, "hung")
            groups = await asyncio.wait_for(manager.take(1), timeout=30)
        finally:
            await manager.stop()
        return manager, groups

    manager, (group,) = asyncio.run(go())
    assert group.group_id == 0 and group.results == (CORRECT, CORRECT)
    assert [f.requeued_groups for f in manager.take_failures()] == [1]
    assert len(env.sessions) == 4 and all(s.closed == 1 for s in env.sessions)
    assert [len(s.steps) for s in env.sessions[:2]] == [1, 1]  # cancelled in turn 2


def test_validation_runs_multi_turn_records_in_their_environment():
    """HeldoutValidation with a stand-in manager (run_anywhere on one scripted client): the
    multi-turn record's results are its environment's, its text the whole trajectory; the
    single-turn record is scored by the registry."""
    from types import SimpleNamespace

    from megatron_rl.data.records import PromptRecord
    from megatron_rl.validation import HeldoutValidation

    records = [PromptRecord(prompt_id="t", task="tool/x", prompt="a", answer="2"),
               PromptRecord(prompt_id="s", task="rg/x", prompt="b", answer="2")]
    envs = {"t": Env(), "s": Env(multi_turn=False)}
    rollout = MultiTurnRollout(environments=lambda r: envs[r.prompt_id], turn_format=Format(),
                               settings_for=lambda e: settings(), decode=decode)
    client = Client()
    manager = SimpleNamespace(prefix_cache_key=lambda v: f"v{v}",
                              run_anywhere=lambda key, request: request(client))

    class Registry:
        def score_many(self, completions, records, num_threads=8):
            self.seen = list(completions)
            return [RewardResult(reward=0.0, reason=Reason.WRONG, pass_fraction=0.0)
                    for _ in completions]

    registry = Registry()
    cfg = SimpleNamespace(rollout=SimpleNamespace(temperature=1.0), seed=0,
                          eval=SimpleNamespace(samples_per_prompt=2))
    validation = HeldoutValidation(cfg, None, tokenizer=SimpleNamespace(decode=decode),
                                   registry=registry, records=records,
                                   prompt_ids=[[1, 2], [1, 2]], manager=manager,
                                   interruption=PLAIN, wait=asyncio.run, multi_turn=rollout)
    completions = asyncio.run(validation._generate(2, version=3))
    texts = [[decode(s.token_ids) for s, _ in group] for group in completions]
    scored = validation._score(texts, completions)
    assert texts[0] == ["10 99 30 40 20 3"] * 2 and texts[1] == ["10 99"] * 2
    assert [(s.prompt_id, s.passed) for s in scored] == [("t", True)] * 2 + [("s", False)] * 2
    assert registry.seen == ["10 99"] * 2
    assert {r[1] for r in client.requests} == {"v3"}
