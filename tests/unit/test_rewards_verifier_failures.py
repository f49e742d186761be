"""Verifier failures are not wrong answers: a math-verify that raises, a dead math worker, a
procedural scorer that raises and a sandbox error give no reward (None) and a failure reason;
the registry re-scores them once; what still fails is counted, drops its group, and stops the run
past algorithm.max_verifier_failure_fraction.

Fakes stand in for the infrastructure only, to force its failures: the math worker process
(`_FakeWorker`, which grades healthy requests in-process with the real `grade_math_answer`), the
connection to it, the sandbox (`_FakeSandbox`, returning what the real one returns when its server
is unreachable) and the reasoning-gym scorer (`_BrokenScorer`). The real MathVerifier,
CodeReward, ProceduralReward and default_registry run around them.
tests/integration/test_sandbox_math_timeout.py kills a real math worker.
"""
import math
import signal
import types

import pytest
import torch

import megatron_rl.algorithms as alg
import megatron_rl.rewards as rewards
from megatron_rl.data import CodeTests, PromptRecord, StdioTest, reasoning_gym_prompts
from megatron_rl.rewards import (
    CodeReward,
    CodeRewardConfig,
    ExecutionResult,
    MathVerifier,
    ProceduralReward,
    Reason,
    RewardResult,
    RewardScale,
    default_registry,
    grade_math_answer,
    make_result,
)
from megatron_rl.rewards import math as math_module
from megatron_rl.rewards import math_worker, procedural

pytestmark = pytest.mark.unit

SIGNED = RewardScale(incorrect_reward=-1.0)
MATH = PromptRecord(prompt_id="m", task="math", prompt="2 + 2?", answer="4")


# --- infrastructure fakes -------------------------------------------------------------------------
class _FakeWorkers:
    """Replaces the math worker subprocess. `plan` says what the next gradings do: "die" (the
    process died: the connection raises EOFError) or a reply tuple; then it grades for real."""

    def __init__(self) -> None:
        self.plan: list = []
        self.started: list = []
        fakes = self

        class _FakeWorker:
            def __init__(self, options: dict) -> None:
                self.options, self.alive = options, True
                fakes.started.append(self)

            def is_alive(self) -> bool:
                return self.alive

            def grade(self, answer_text: str, gold: str, timeout_s: float):
                action = fakes.plan.pop(0) if fakes.plan else None
                if action == "die":
                    self.alive = False
                    raise EOFError("the worker process exited")
                if action is not None:
                    return action
                reason, detail = grade_math_answer(answer_text, gold, **self.options)
                return reason.value, detail

            def kill(self) -> None:
                self.alive = False

        self.cls = _FakeWorker


@pytest.fixture
def workers(monkeypatch):
    fakes = _FakeWorkers()
    monkeypatch.setattr(math_module, "_Worker", fakes.cls)
    return fakes


class _FakeConnection:
    """The worker's end of its connection: replays requests, records replies."""

    def __init__(self, requests) -> None:
        self.requests, self.sent = list(requests), []

    def recv(self):
        if not self.requests:
            raise EOFError
        return self.requests.pop(0)

    def send(self, obj) -> None:
        self.sent.append(obj)


def _sandbox_failure(detail: str) -> ExecutionResult:
    return ExecutionResult(status="sandbox_error", stdout="", stderr="", test_passed=(),
                           exit_code=None, signal=None, wall_time_s=0.0, cpu_time_s=0.0,
                           max_rss_bytes=0, isolation="", uid=None, detail=detail)


def _ok(stdout: str) -> ExecutionResult:
    return ExecutionResult(status="ok", stdout=stdout, stderr="", test_passed=(),
                           exit_code=0, signal=None, wall_time_s=0.01, cpu_time_s=0.01,
                           max_rss_bytes=1 << 20, isolation="namespaces", uid=None)


class _FakeSandbox:
    """`map` answers from `replies` (one list of results per call); None, or no reply left,
    answers what the real sandbox does when its server cannot be reached."""

    def __init__(self, *replies) -> None:
        self.replies, self.calls = list(replies), 0

    def map(self, requests):
        self.calls += 1
        reply = self.replies.pop(0) if self.replies else None
        return reply or [_sandbox_failure("could not reach the sandbox server: [Errno 111]")
                         for _ in requests]


class _BrokenScorer:
    """A reasoning-gym scorer that raises on its next `num_failures` calls whatever the answer (a
    backend outage), and always for the entries of `broken_prompts` (a record it chokes on);
    otherwise it scores by exact match. `calls` counts the calls per prompt."""

    def __init__(self, monkeypatch, *, num_failures: int = 0, broken_prompts=()) -> None:
        self.num_failures, self.broken_prompts = num_failures, set(broken_prompts)
        self.calls: dict[str, int] = {}
        monkeypatch.setattr(procedural, "_score_fn", lambda dataset: self)

    def __call__(self, answer, entry) -> float:
        self.calls[entry["question"]] = self.calls.get(entry["question"], 0) + 1
        if self.num_failures > 0 or entry["question"] in self.broken_prompts:
            self.num_failures -= 1
            raise ConnectionError("scorer backend unavailable")
        return 1.0 if answer == entry["answer"] else 0.0


CODE = CodeTests(stdio=(StdioTest(stdin="", expected_stdout="1"),
                        StdioTest(stdin="", expected_stdout="2")))
PROGRAM = "</think>```python\nprint(1)\n```"


# --- each verifier: failure -> reward None and a failure reason -----------------------------------
def test_math_verify_raising_is_a_verifier_failure(monkeypatch, workers):
    def explode(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded in sympify")

    monkeypatch.setattr(math_worker, "grade_math_answer", explode)
    conn = _FakeConnection([("\\boxed{4}", "4", 5.0)])
    handler = signal.getsignal(signal.SIGALRM)
    try:
        math_worker.serve(conn, {})  # the worker's loop, in this process
    finally:
        signal.signal(signal.SIGALRM, handler)
    ready, reply = conn.sent
    assert ready == "ready"
    assert reply[0] == "verifier_error" and "RecursionError" in reply[1]
    # ... and the verifier turns that reply into a result without a reward.
    workers.plan.append(reply)
    with MathVerifier() as verifier:
        result = verifier.grade("</think> \\boxed{4}", "4", scale=SIGNED)
    assert result.reward is None
    assert result.reason == Reason.VERIFIER_ERROR and result.verifier_failed
    assert not result.passed and "RecursionError" in result.detail


def test_dead_math_worker_is_a_verifier_failure(workers):
    workers.plan.append("die")
    with MathVerifier() as verifier:
        dead = verifier.grade("</think> \\boxed{5}", "4", scale=SIGNED)
        assert dead.reward is None
        assert (dead.reason, dead.verifier_failed) == (Reason.VERIFIER_ERROR, True)
        assert "math worker died" in dead.detail
        wrong = verifier.grade("</think> \\boxed{5}", "4", scale=SIGNED)  # a fresh worker
    assert (wrong.reason, wrong.reward, wrong.verifier_failed) == (Reason.WRONG, -1.0, False)
    assert len(workers.started) == 2 and not workers.started[0].alive


def test_procedural_scorer_raising_is_a_verifier_failure(monkeypatch):
    record = reasoning_gym_prompts("basic_arithmetic", num_prompts=1, seed=5)[0]
    _BrokenScorer(monkeypatch, num_failures=2)  # the answer's call and the reference's
    reward = ProceduralReward(procedural.ProceduralRewardConfig(scale=SIGNED))
    result = reward("</think><answer>nonsense</answer>", record)
    assert result.reward is None
    assert result.reason == Reason.VERIFIER_ERROR and "ConnectionError" in result.detail
    assert "on the reference answer too" in result.detail
    assert reward("</think><answer>nonsense</answer>", record).reward == -1.0  # scorer back


def test_a_real_scorer_raising_on_junk_is_the_answers_fault():
    """prime_factorization's own scorer raises ValueError on text it cannot parse, and scores
    the reference: a parse error, not a verifier failure."""
    record = reasoning_gym_prompts("prime_factorization", num_prompts=1, seed=0)[0]
    reward = ProceduralReward(procedural.ProceduralRewardConfig(scale=SIGNED))
    junk = reward("</think><answer>zzz</answer>", record)
    assert (junk.reason, junk.reward) == (Reason.PARSE_ERROR, -1.0)
    assert "ValueError" in junk.detail
    assert reward(f"</think><answer>{record.answer}</answer>", record).passed


def test_sandbox_error_is_a_verifier_failure_even_when_other_tests_passed():
    partial = CodeReward(_FakeSandbox([_ok("1"), _sandbox_failure("monitor did not report")]),
                         CodeRewardConfig(scale=RewardScale(incorrect_reward=-1.0,
                                                            partial_credit=True)))
    result = partial(PROGRAM, CODE)
    assert result.reward is None  # not -1 + 2 * 1/2: the second test never ran
    assert (result.reason, result.verifier_failed) == (Reason.SANDBOX_ERROR, True)
    assert result.detail == "monitor did not report"
    # Function-call tests only: the failed run reports no per-test outcomes.
    calls = CodeTests(function_calls=("assert f() == 1",))
    result = CodeReward(_FakeSandbox(), CodeRewardConfig(scale=SIGNED))(PROGRAM, calls)
    assert (result.reward, result.reason) == (None, Reason.SANDBOX_ERROR)


def test_a_failure_result_never_carries_a_number():
    for reason in (Reason.SANDBOX_ERROR, Reason.VERIFIER_ERROR):
        assert make_result(reason, SIGNED).reward is None
        with pytest.raises(ValueError, match="needs reward None"):
            RewardResult(reward=-1.0, reason=reason, pass_fraction=0.0)
    with pytest.raises(ValueError, match="needs reward a number"):
        RewardResult(reward=None, reason=Reason.WRONG, pass_fraction=0.0)
    assert rewards.VERIFIER_FAILURES == {Reason.SANDBOX_ERROR, Reason.VERIFIER_ERROR}


# --- score -> retry once -> result ----------------------------------------------------------------
def test_retry_once_succeeds_after_one_transient_failure(workers):
    sandbox = _FakeSandbox(None, [_ok("1"), _ok("2")])  # server down once, then back
    code = PromptRecord(prompt_id="c", task="code", prompt="print 1", tests=CODE)
    workers.plan.append("die")
    with MathVerifier() as verifier:
        registry = default_registry(math_verifier=verifier, sandbox=sandbox, scale=SIGNED)
        results = registry.score_many(["</think> \\boxed{4}", "</think> \\boxed{3}", PROGRAM],
                                      [MATH, MATH, code], num_threads=1)
    assert [(r.reason, r.reward) for r in results] == [
        (Reason.CORRECT, 1.0), (Reason.WRONG, -1.0), (Reason.CORRECT, 1.0)]
    assert len(workers.started) == 2  # the retry got a fresh worker
    assert sandbox.calls == 2


def test_group_dropped_after_two_failures(monkeypatch):
    records = reasoning_gym_prompts("basic_arithmetic", num_prompts=2, seed=5)
    scorer = _BrokenScorer(monkeypatch, broken_prompts={records[0].prompt})
    group_size = 2
    completions = [f"</think><answer>{records[0].answer}</answer>", "</think><answer>x</answer>",
                   f"</think><answer>{records[1].answer}</answer>", "</think><answer>y</answer>"]
    with MathVerifier() as verifier:
        registry = default_registry(math_verifier=verifier, sandbox=_FakeSandbox(),
                                    scale=SIGNED)
        results = registry.score_many(completions, [r for r in records for _ in range(group_size)],
                                      num_threads=1)
    # Group 0: 2 samples x 2 attempts x (the answer, then the reference) = 8 scorer calls.
    assert scorer.calls == {records[0].prompt: 8, records[1].prompt: 2}
    assert [r.reason for r in results] == [Reason.VERIFIER_ERROR, Reason.VERIFIER_ERROR,
                                           Reason.CORRECT, Reason.WRONG]
    values = torch.tensor(rewards.reward_values(results)).view(-1, group_size)  # [prompts, G]
    assert torch.isnan(values[0]).all() and values[1].tolist() == [1.0, -1.0]
    assert alg.verified_mask(values).tolist() == [False, True]
    assert alg.group_keep_mask(values).tolist() == [False, True]
    counter = rewards.VerifierFailureCounter(max_failure_fraction=0.5)
    counter.update(results, group_size)
    assert counter.metrics() == {
        "verifier/dropped_samples": 2.0, "verifier/dropped_groups": 1.0,
        "verifier/failures/sandbox_error": 0.0, "verifier/failures/verifier_error": 2.0,
        "verifier/failure_fraction": 0.5}


def test_retries_are_bounded(workers):
    workers.plan.extend(["die"] * 3)
    with MathVerifier() as verifier:
        registry = default_registry(math_verifier=verifier, sandbox=_FakeSandbox())
        (once,) = registry.score_many(["</think> 4"], [MATH], retries=1)
        (twice,) = registry.score_many(["</think> 4"], [MATH], retries=1)
        with pytest.raises(ValueError, match="retries must be >= 0"):
            registry.score_many(["</think> 4"], [MATH], retries=-1)
    assert once.reward is None and twice.passed  # 2 deaths, then 1 death and a good retry
    assert len(workers.started) == 4


# --- the failure counter and the run stop ---------------------------------------------------------
def _results(num_failed: int, num_ok: int, reason=Reason.SANDBOX_ERROR, detail="server down"):
    failed = [make_result(reason, SIGNED, detail=detail) for _ in range(num_failed)]
    return failed + [make_result(Reason.WRONG, SIGNED) for _ in range(num_ok)]


def test_failure_fraction_stop_names_fraction_threshold_reasons_and_fix():
    counter = rewards.VerifierFailureCounter(max_failure_fraction=0.05)
    counter.update(_results(1, 39), group_size=4)  # 1 of 40 = 2.5%
    assert counter.metrics()["verifier/failure_fraction"] == 0.025
    counter.update(_results(0, 40), group_size=4)  # cumulative: 1 of 80
    assert counter.metrics()["verifier/dropped_samples"] == 0.0  # per batch
    batch = (_results(2, 2, Reason.VERIFIER_ERROR, "math worker died: EOFError")
             + _results(1, 3, detail="could not reach the sandbox server: [Errno 111]"))
    with pytest.raises(rewards.VerifierFailureError) as raised:
        counter.update(batch, group_size=4)  # 4 of 88 = 4.5%: still under
        counter.update(_results(3, 1), group_size=4)  # 7 of 92 = 7.6%: stop
    message = str(raised.value)
    assert "7.6%" in message and "7 of 92" in message
    assert "algorithm.max_verifier_failure_fraction=0.05" in message
    assert "sandbox_error x5 (e.g. 'server down')" in message
    assert "verifier_error x2 (e.g. 'math worker died: EOFError')" in message
    assert "fix the verifier" in message
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        counter.update(_results(0, 3), group_size=4)


def test_threshold_zero_stops_at_the_first_failure_and_state_round_trips():
    counter = rewards.VerifierFailureCounter(max_failure_fraction=0.0)
    counter.update(_results(0, 8), group_size=2)
    with pytest.raises(rewards.VerifierFailureError, match="1 of 10"):
        counter.update(_results(1, 1), group_size=2)
    resumed = rewards.VerifierFailureCounter(max_failure_fraction=0.5)
    resumed.load_state_dict(counter.state_dict())
    assert (resumed.num_samples, resumed.num_failed, resumed.failure_fraction) == (10, 1, 0.1)
    with pytest.raises(ValueError, match="max_verifier_failure_fraction must be in"):
        rewards.VerifierFailureCounter(max_failure_fraction=1.5)


def test_counter_from_run_config():
    from megatron_rl.config import load_config

    run = load_config(None, ["algorithm.max_verifier_failure_fraction=0.2"])
    assert rewards.VerifierFailureCounter.from_run_config(run).max_failure_fraction == 0.2
    assert rewards.VerifierFailureCounter.from_run_config(
        load_config(None)).max_failure_fraction == 0.05
    stand_in = types.SimpleNamespace(
        algorithm=types.SimpleNamespace(max_verifier_failure_fraction=1.0))
    counter = rewards.VerifierFailureCounter.from_run_config(stand_in)
    counter.update(_results(4, 0), group_size=4)  # 1.0 never stops
    assert counter.failure_fraction == 1.0
