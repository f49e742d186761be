"""Math grading in worker processes: works from any thread (math-verify's own signal-based
timeout refuses to), the soft timeout interrupts Python-level work, the hard timeout kills a
worker stuck in C (a ~30 s big-integer power) and replaces it, and a worker that dies is a
verifier failure (no reward) that the registry's retry grades with a fresh worker."""
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from megatron_rl.data import PromptRecord
from megatron_rl.rewards import (
    MathVerifier,
    MathVerifyConfig,
    Reason,
    RewardRegistry,
    RewardScale,
)

pytestmark = pytest.mark.integration


def _worker_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children()
            if "megatron_rl.rewards.math_worker" in " ".join(p.cmdline())}


def test_math_verify_alone_refuses_threads():
    from math_verify import parse

    errors = []

    def run():
        try:
            parse("$1/2$")  # default parsing_timeout=5 uses signal.alarm
        except ValueError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "threaded environment" in errors[0]


def test_grading_from_many_threads():
    cases = [(r"</think> $\boxed{\frac{1}{2}}$", "0.5", Reason.CORRECT),
             (r"</think> $\boxed{0.6}$", "0.5", Reason.WRONG),
             (r"</think> $\boxed{\{2,1\}}$", r"\{1,2\}", Reason.CORRECT),
             (r"</think> no idea", "3", Reason.NO_ANSWER),
             (r"</think> $\boxed{\sqrt{}}$", "3", Reason.PARSE_ERROR)] * 2
    with MathVerifier(MathVerifyConfig(num_workers=2,
                                       scale=RewardScale(incorrect_reward=-1.0))) as verifier:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda c: verifier.grade(c[0], c[1]), cases))
        assert len(_worker_pids()) <= 2
    assert [r.reason for r in results] == [c[2] for c in cases]
    assert [r.reward for r in results] == [1.0 if c[2] == Reason.CORRECT else -1.0 for c in cases]
    assert _worker_pids() == set()


def test_soft_timeout_keeps_the_worker():
    with MathVerifier(MathVerifyConfig(timeout_s=0.5)) as verifier:
        assert verifier.grade("</think> $3$", "3").reason == Reason.CORRECT
        workers = _worker_pids()
        slow = verifier.grade(r"</think> $\boxed{9^{9^{9^{9}}}}$", "1")
        assert (slow.reason, slow.reward) == (Reason.TIMEOUT, 0.0)
        assert _worker_pids() == workers  # interrupted in Python: same worker goes on
        assert verifier.grade("</think> $4$", "4").reason == Reason.CORRECT


def test_pathological_power_times_out_and_the_verifier_recovers():
    # SymPy's 2**(2**30) (tens of seconds, partly inside one C call): a timeout either way.
    with MathVerifier(MathVerifyConfig(timeout_s=0.5)) as verifier:
        stuck = verifier.grade(r"</think> $\boxed{2^{2^{30}}}$", "1")
        assert (stuck.reason, stuck.pass_fraction) == (Reason.TIMEOUT, 0.0)
        assert verifier.grade(r"</think> $\boxed{\frac{2}{4}}$", "0.5").reason == Reason.CORRECT
        assert len(_worker_pids()) == 1


def test_a_hung_worker_is_killed_and_is_a_verifier_failure():
    """A worker that no signal reaches and that is not computing (stopped here; deadlocked in
    production) is killed after timeout_s + grace and replaced. Its hang says nothing about the
    answer: no reward (verifier_error), and the registry's retry grades it with a fresh worker;
    one fault record, recovered once the fresh worker answered. (A worker stuck computing in C is
    a timeout: test_pathological_power_times_out_and_the_verifier_recovers.)"""
    record = PromptRecord(prompt_id="m", task="math", prompt="2 + 2?", answer="4")
    with MathVerifier(MathVerifyConfig(timeout_s=0.5)) as verifier:
        registry = RewardRegistry()
        registry.register("math", lambda c, r: verifier.grade(c, r.answer), requires=("answer",))
        assert verifier.grade("</think> $3$", "3").reason == Reason.CORRECT
        (worker,) = _worker_pids()
        psutil.Process(worker).suspend()  # SIGSTOP: its soft timeout can never fire
        (stuck,) = registry.score_many(["</think> $4$"], [record], retries=0)
        assert stuck.reason == Reason.VERIFIER_ERROR and "hung (process state T" in stuck.detail
        assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie"
        assert verifier.take_faults() == []  # detected; no fresh worker has answered yet

        assert verifier.grade("</think> $3$", "3").reason == Reason.CORRECT
        (worker,) = _worker_pids()
        psutil.Process(worker).suspend()
        (retried,) = registry.score_many(["</think> $4$"], [record])  # retries=1
        assert (retried.reason, retried.reward) == (Reason.CORRECT, 1.0)
        assert len(_worker_pids()) == 1 and worker not in _worker_pids()  # a fresh worker
        faults = verifier.take_faults()
        assert [f["kind"] for f in faults] == ["reward_worker"] * 2
        assert all("hung" in f["what"] and f["recovered_at"] > f["detected_at"] for f in faults)
        assert verifier.take_faults() == []


def test_a_worker_stopped_while_starting_fails_fast_and_is_a_fault(monkeypatch):
    """A worker stopped before it is ready (SIGSTOP right after its start here) is killed at the
    next state check, not after the 300 s start timeout: a verifier failure with a "hung" fault
    record, recovered once a fresh worker answered the retry."""
    import signal

    from megatron_rl.rewards import math as math_rewards

    record = PromptRecord(prompt_id="m", task="math", prompt="2 + 2?", answer="4")
    popen, stopped = math_rewards.subprocess.Popen, []

    def start_stopped(*args, **kwargs):
        process = popen(*args, **kwargs)
        if not stopped:  # only the first worker
            os.kill(process.pid, signal.SIGSTOP)
            stopped.append(process.pid)
        return process

    monkeypatch.setattr(math_rewards.subprocess, "Popen", start_stopped)
    with MathVerifier(MathVerifyConfig(timeout_s=2.0)) as verifier:
        registry = RewardRegistry()
        registry.register("math", lambda c, r: verifier.grade(c, r.answer), requires=("answer",))
        started = time.monotonic()
        (result,) = registry.score_many(["</think> $4$"], [record])  # retries=1
        assert time.monotonic() - started < 120  # not the 300 s start timeout
        assert (result.reason, result.reward) == (Reason.CORRECT, 1.0)  # the fresh worker's
        assert not psutil.pid_exists(stopped[0]) or \
            psutil.Process(stopped[0]).status() == "zombie"
        (fault,) = verifier.take_faults()
        assert "hung (process state T while starting)" in fault["what"]
        assert fault["recovered_at"] > fault["detected_at"]


def _kill(pid: int) -> None:
    process = psutil.Process(pid)
    process.kill()
    psutil.wait_procs([process], timeout=10)  # reaped by its Popen later; zombie until then


def test_a_dead_worker_is_a_verifier_failure_and_the_retry_gets_a_fresh_one():
    """A worker killed between gradings (the OOM killer, a crash): no reward, not a wrong
    answer; `score_many` re-scores it once, with a fresh worker."""
    record = PromptRecord(prompt_id="m", task="math", prompt="2 + 2?", answer="4")
    with MathVerifier(MathVerifyConfig(scale=RewardScale(incorrect_reward=-1.0))) as verifier:
        registry = RewardRegistry()
        registry.register("math", lambda c, r: verifier.grade(c, r.answer), requires=("answer",))
        assert registry.score("</think> $4$", record).reason == Reason.CORRECT
        (first,) = _worker_pids()
        _kill(first)
        (dead,) = registry.score_many(["</think> $4$"], [record], retries=0)
        assert (dead.reward, dead.reason) == (None, Reason.VERIFIER_ERROR)
        assert "math worker died" in dead.detail
        assert registry.score("</think> $5$", record).reward == -1.0  # a fresh worker
        (second,) = _worker_pids()
        _kill(second)
        (retried,) = registry.score_many(["</think> $4$"], [record])  # retries=1
        assert (retried.reward, retried.reason) == (1.0, Reason.CORRECT)
        assert len(_worker_pids()) == 1 and not {first, second} & _worker_pids()
        assert [f"pid {first}" in f["what"] and "died" in f["what"]
                for f in verifier.take_faults()] == [True, False]
