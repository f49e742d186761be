"""Math rewards: the final answer (after `</think>`) compared with the reference by math-verify
(LaTeX, fractions, sets, intervals, symbolic equality), with a per-call timeout that works from
any thread.

math-verify 0.9.0 bounds its own work with `signal.alarm`, which only works in the main thread
of the main interpreter (elsewhere it raises ValueError), takes whole seconds, and cannot
interrupt a long computation inside C (e.g. parsing `2^{2^{30}}` spends ~30 s in one big-integer
power). So `MathVerifier` grades in worker processes (math_worker.py): math-verify's timeouts
are off, the worker's main thread arms a float `setitimer` soft timeout, and the caller waits
at most `timeout_s + _HARD_GRACE_S` before killing the worker (a fresh one starts on next use).
`grade_math_answer` is the same grading, in-process and without a time bound.

A worker that dies, or math-verify raising inside it, is a verifier failure (`verifier_error`:
no reward), not a wrong answer; a grading timeout stays `timeout` (the answer is too costly).
At the hard timeout the worker's scheduler state tells the two apart: a worker still running
(state R: computing, e.g. the big power above) timed out on the answer; one that is not (stopped,
or asleep in a deadlock) hung, which says nothing about the answer: a verifier failure, graded
again by a fresh worker (`RewardRegistry.score_many`). Each dead or hung worker is a fault record
(`MathVerifier.take_faults`: detected when its grading failed, recovered when a fresh worker next
answered) that a run writes to faults.jsonl (docs/fault_tolerance.md).
"""
from __future__ import annotations

import dataclasses
import json
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from megatron_rl.rewards.types import (
    THINK_END,
    Reason,
    RewardResult,
    RewardScale,
    final_answer,
    make_result,
)

_HARD_GRACE_S = 1.0        # the soft timeout normally answers well within this
_WORKER_START_TIMEOUT_S = 300.0  # importing sympy + math-verify; generous on a loaded host
_START_POLL_S = 0.5  # how often a starting worker's process state is checked
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MathVerifyConfig:
    timeout_s: float = 5.0
    num_workers: int = 1
    think_end: str | None = THINK_END  # None: the whole completion is the answer
    float_rounding: int = 6
    numeric_precision: int = 15
    strict: bool = True  # variables matter; sets are not tuples (math-verify's `strict`)
    scale: RewardScale = dataclasses.field(default_factory=RewardScale)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"MathVerifyConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"MathVerifyConfig.num_workers must be >= 1, got {self.num_workers}")


def _as_latex(gold: str) -> str:
    """Reference answers usually come bare (`\\frac{1}{2}`, `(1,2]`): give them math delimiters."""
    return gold if any(d in gold for d in _LATEX_DELIMITERS) else f"${gold}$"


def grade_math_answer(answer_text: str, gold: str, *, float_rounding: int = 6,
                      numeric_precision: int = 15, strict: bool = True) -> tuple[Reason, str]:
    """(reason, detail) for an answer text (thinking already stripped) against the reference.
    In-process and unbounded in time: use `MathVerifier` for untrusted input."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = parse(_as_latex(gold), [LatexExtractionConfig(), ExprExtractionConfig()],
                        parsing_timeout=None)
    if not any(not isinstance(g, str) for g in gold_parsed):
        return Reason.PARSE_ERROR, f"reference answer {gold!r} does not parse (fix the dataset)"
    predicted = parse(answer_text, [LatexExtractionConfig(boxed_match_priority=0),
                                    ExprExtractionConfig()], parsing_timeout=None)
    if not predicted:
        return Reason.NO_ANSWER, "no answer found after the thinking part"
    if all(isinstance(p, str) for p in predicted):  # extracted, but not convertible to SymPy
        return Reason.PARSE_ERROR, f"answer {predicted[0]!r} does not parse"
    equal = verify(gold_parsed, predicted, float_rounding=float_rounding,
                   numeric_precision=numeric_precision, strict=strict, timeout_seconds=None)
    return (Reason.CORRECT, "") if equal else (Reason.WRONG, f"answer {predicted[-1]!r}")


# --- worker processes ---------------------------------------------------------------------------
class _WorkerStartFailed(Exception):
    """A grading process stopped or died before it was ready (not a slow start)."""


class _Worker:
    """One grading process (math_worker.py), started as a plain subprocess: multiprocessing's
    spawn/forkserver children re-import the caller's __main__ (a script without a main guard
    would run again) and its fork would copy the caller's threads and torch state."""

    def __init__(self, options: dict) -> None:
        parent, child = socket.socketpair()
        with child:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "megatron_rl.rewards.math_worker", str(child.fileno()),
                 json.dumps(options)], pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        self.conn = Connection(parent.detach())
        # Importing sympy + math-verify may take long on a loaded host, but a worker stopped
        # (SIGSTOP, a debugger) or dead while starting would otherwise hold the grading for the
        # whole start timeout: check its state while waiting.
        deadline = time.monotonic() + _WORKER_START_TIMEOUT_S
        while not self.conn.poll(_START_POLL_S):
            state = self.state()
            if self.process.poll() is not None or state in ("T", "t", "Z", "X"):
                self.kill()
                raise _WorkerStartFailed(f"process state {state} while starting")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("the math-verify worker did not start within "
                                   f"{_WORKER_START_TIMEOUT_S:.0f} s; is math-verify installed?")
        if self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError("the math-verify worker did not start; is math-verify installed?")

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def grade(self, answer_text: str, gold: str, timeout_s: float) -> tuple[str, str] | str:
        """The worker's reply; or, when it had to be killed at the hard timeout, its scheduler
        state then (a one-letter string: "R" running, "T" stopped, "S" asleep, ...)."""
        self.conn.send((answer_text, gold, timeout_s))
        if self.conn.poll(timeout_s + _HARD_GRACE_S):
            return self.conn.recv()
        state = self.state()
        self.kill()
        return state

    def state(self) -> str:
        """The process state letter from /proc (man 5 proc); "R" where /proc has none."""
        try:
            with open(f"/proc/{self.process.pid}/stat", encoding="ascii") as f:
                return f.read().rpartition(")")[2].split()[0]  # the command may hold spaces
        except (OSError, IndexError):
            return "R"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class MathVerifier:
    """Grades math completions; thread-safe; `num_workers` gradings run at once."""

    def __init__(self, config: MathVerifyConfig | None = None) -> None:
        self.config = config or MathVerifyConfig()
        self._options = {"float_rounding": self.config.float_rounding,
                         "numeric_precision": self.config.numeric_precision,
                         "strict": self.config.strict}
        # Workers start lazily (None) and are replaced after a hard timeout.
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(self.config.num_workers):
            self._idle.put(None)
        self._closed = threading.Event()
        self._faults_lock = threading.Lock()
        self._faults_open: list[dict] = []   # dead or hung workers no fresh worker answered since
        self._faults_done: list[dict] = []

    def __call__(self, completion: str, gold: str) -> RewardResult:
        return self.grade(completion, gold)

    def grade(self, completion: str, gold: str, *,
              scale: RewardScale | None = None) -> RewardResult:
        """`scale` overrides the config's reward values (e.g. one scale for every task)."""
        scale = scale or self.config.scale
        answer = final_answer(completion, think_end=self.config.think_end)
        if answer is None:
            return make_result(Reason.NO_ANSWER, scale, detail=f"no {self.config.think_end}")
        if not answer.strip():
            return make_result(Reason.NO_ANSWER, scale, detail="empty answer")
        if self._closed.is_set():
            raise RuntimeError("MathVerifier.grade called after close()")
        worker = self._idle.get()
        pid = None
        try:
            if worker is None:
                worker = _Worker(self._options)
            pid = getattr(worker, "pid", None)  # for the fault record
            reply = worker.grade(answer, gold, self.config.timeout_s)
        except (EOFError, OSError) as exc:  # the worker died: a verifier failure, not a verdict
            worker = None                     # (a fresh worker grades the retry)
            what = f"math worker died: {type(exc).__name__}: {exc}"
            self._fault(f"{what} (pid {pid})")
            return make_result(Reason.VERIFIER_ERROR, scale, detail=what)
        except _WorkerStartFailed as exc:  # stopped or dead before it was ready; killed
            worker = None
            what = f"math worker hung ({exc}); killed"
            self._fault(what)
            return make_result(Reason.VERIFIER_ERROR, scale, detail=what)
        finally:
            if worker is not None and (self._closed.is_set() or not worker.is_alive()):
                worker.kill()
                worker = None
            self._idle.put(worker)
        if isinstance(reply, str) and reply != "R":  # killed, and it was not computing: hung
            what = (f"math worker hung (process state {reply} at the hard timeout, "
                    f"{self.config.timeout_s + _HARD_GRACE_S} s); killed")
            self._fault(f"{what} (pid {pid})")
            return make_result(Reason.VERIFIER_ERROR, scale, detail=what)
        if isinstance(reply, str):
            return make_result(Reason.TIMEOUT, scale,
                               detail=f"killed after {self.config.timeout_s + _HARD_GRACE_S} s")
        self._answered()
        reason, detail = reply
        return make_result(Reason(reason), scale, detail=detail)

    def _fault(self, what: str) -> None:
        with self._faults_lock:
            self._faults_open.append({"kind": "reward_worker", "what": what,
                                      "detected_at": time.time()})

    def _answered(self) -> None:
        if self._faults_open:  # a worker answered after a dead or hung one: recovered
            with self._faults_lock:
                for fault in self._faults_open:
                    fault["recovered_at"] = time.time()
                self._faults_done += self._faults_open
                self._faults_open = []

    def take_faults(self) -> list[dict]:
        """The dead or hung workers since the last call that a fresh worker has replaced (and
        answered for): records {kind, what, detected_at, recovered_at} for faults.jsonl."""
        with self._faults_lock:
            done, self._faults_done = self._faults_done, []
        return done

    def close(self) -> None:
        self._closed.set()
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

