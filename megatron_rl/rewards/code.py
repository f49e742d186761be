"""Code rewards: the candidate program (the last fenced code block after `</think>`) run against
stdin/stdout tests and HumanEval-style function-call tests in the sandbox. The reward comes from
the pass fraction; the reason is "correct" when every test passes, else the first failing test's
reason (wrong, timeout, runtime_error, memory_limit, ... see Reason).

Function-call tests run inside the program's own interpreter (that is what `check(candidate)`
needs), so a program that deliberately tampers with the harness in-process could fake a pass;
the harness does count leaving early (sys.exit / os._exit before the tests finish) as failure.
stdin/stdout tests are compared here, outside the sandbox, and cannot be faked that way.

If the sandbox fails on any test (`sandbox_error`), the whole result is `sandbox_error` (no
reward): a pass fraction with tests that never ran would grade the completion on part of its tests.
"""
from __future__ import annotations

import dataclasses
import re

from megatron_rl.data.records import CodeTests, StdioTest
from megatron_rl.rewards.sandbox import ExecutionRequest, ExecutionResult, Sandbox, SandboxLimits
from megatron_rl.rewards.types import (
    THINK_END,
    VERIFIER_FAILURES,
    Reason,
    RewardResult,
    RewardScale,
    final_answer,
    make_result,
)

_CODE_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\r?\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("", "python", "python3", "py")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CodeRewardConfig:
    think_end: str | None = THINK_END
    limits: SandboxLimits | None = None  # None: the sandbox's own limits
    scale: RewardScale = dataclasses.field(default_factory=RewardScale)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CodeTestReport:
    """Per-test outcomes (stdio tests first, then function-call tests) and their summary."""

    outcomes: tuple[Reason, ...]
    pass_fraction: float
    reason: Reason
    detail: str = ""


def extract_code(answer_text: str) -> str | None:
    """The last ```python (or untagged) fenced block; None when there is none."""
    blocks = [body for tag, body in _CODE_BLOCK.findall(answer_text)
              if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def outputs_match(actual: str, expected: str) -> bool:
    """Line by line, ignoring trailing whitespace on each line and trailing blank lines."""
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]
    return lines(actual) == lines(expected)


def _stdio_outcome(test: StdioTest, result: ExecutionResult) -> tuple[Reason, str]:
    if not result.ok:
        return Reason(result.status), result.detail
    if outputs_match(result.stdout, test.expected_stdout):
        return Reason.CORRECT, ""
    return Reason.WRONG, f"expected {test.expected_stdout[:60]!r}, got {result.stdout[:60]!r}"


def run_code_tests(program: str, tests: CodeTests, sandbox: Sandbox, *,
                   limits: SandboxLimits | None = None) -> CodeTestReport:
    """Run every test of `tests` against `program` (concurrently, within the sandbox's bound)."""
    program = f"{tests.prelude}\n{program}" if tests.prelude else program
    requests = [ExecutionRequest(program=program, stdin=t.stdin, limits=limits)
                for t in tests.stdio]
    if tests.function_calls:
        requests.append(ExecutionRequest(program=program, tests=tests.function_calls,
                                         limits=limits))
    results = sandbox.map(requests)
    outcomes = [_stdio_outcome(t, r) for t, r in zip(tests.stdio, results)]
    if tests.function_calls:
        result = results[-1]
        failed = (Reason(result.status), result.detail) if not result.ok else (Reason.WRONG, "")
        # A sandbox failure reports no per-test outcomes: every function test counts as failed.
        test_passed = result.test_passed or (False,) * len(tests.function_calls)
        outcomes += [(Reason.CORRECT, "") if passed else failed for passed in test_passed]
    num_passed = sum(reason == Reason.CORRECT for reason, _ in outcomes)
    verifier_failure = next(((r, d) for r, d in outcomes if r in VERIFIER_FAILURES), None)
    first_failure = next(((r, d) for r, d in outcomes if r != Reason.CORRECT), None)
    reason, detail = verifier_failure or first_failure or (Reason.CORRECT, "")
    return CodeTestReport(outcomes=tuple(r for r, _ in outcomes),
                          pass_fraction=num_passed / len(outcomes), reason=reason, detail=detail)


class CodeReward:
    """Reward of a completion for code tests; thread-safe (the sandbox bounds concurrency)."""

    def __init__(self, sandbox: Sandbox, config: CodeRewardConfig | None = None) -> None:
        self.sandbox = sandbox
        self.config = config or CodeRewardConfig()

    def __call__(self, completion: str, tests: CodeTests) -> RewardResult:
        scale = self.config.scale
        answer = final_answer(completion, think_end=self.config.think_end)
        if answer is None:
            return make_result(Reason.NO_ANSWER, scale, detail=f"no {self.config.think_end}")
        program = extract_code(answer)
        if program is None:
            return make_result(Reason.NO_ANSWER, scale, detail="no ```python code block")
        report = run_code_tests(program, tests, self.sandbox, limits=self.config.limits)
        return make_result(report.reason, scale, pass_fraction=report.pass_fraction,
                           detail=report.detail)
