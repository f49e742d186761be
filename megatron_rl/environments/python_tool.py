"""The Python tool environment: the model writes a call, `<tool>print(6 * 7)</tool>` by default,
the code sandbox (rewards/sandbox.py) runs it with its limits, and what it printed (with the error
and its status when it failed) comes back as an observation message; a turn without a call, or
the rollout's last turn, ends the trajectory and a grader scores the model's turns.

Failures (docs/environments.md): a program that raises, times out or hits a limit is an
observation the model reads (`tool_errors`), never an exception. The sandbox's own failure (status
"sandbox_error": its server unreachable, no report) ends the trajectory with
`Reason.SANDBOX_ERROR` (no reward: the group is dropped as with a failed verifier); a grader that
raises gives `Reason.VERIFIER_ERROR`; a sandbox that cannot isolate programs on this host
(`SandboxUnavailableError`) is a configuration error and raises.
"""
from __future__ import annotations

import asyncio
import dataclasses

from megatron_rl.data.records import PromptRecord
from megatron_rl.environments.base import Environment, EnvironmentSession, StepResult
from megatron_rl.environments.verifier import Grader, confined_grade
from megatron_rl.rewards.sandbox import (ExecutionRequest, ExecutionResult, Sandbox,
                                         SandboxLimits)
from megatron_rl.rewards.types import Reason, RewardScale, make_result


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ToolSettings:
    """How calls are written, limited and answered."""

    call_open: str = "<tool>"
    call_close: str = "</tool>"  # ends the model's turn: one token of the policy tokenizer
    wall_time_s: float = 5.0  # per call (the sandbox's wall and CPU time limits for it)
    max_output_chars: int = 1000  # of stdout (its head) and of stderr (its tail), each
    role: str = "tool"  # the observation message's role (as the chat template knows it)
    system_prompt: str | None = None  # prepended to the record's conversation when set

    def __post_init__(self) -> None:
        if not self.call_open or not self.call_close or self.call_open == self.call_close:
            raise ValueError(f"ToolSettings.call_open ({self.call_open!r}) and call_close "
                             f"({self.call_close!r}) must be two different non-empty texts")
        if not self.wall_time_s > 0:
            raise ValueError(f"ToolSettings.wall_time_s must be > 0, got {self.wall_time_s}")
        if self.max_output_chars < 1:
            raise ValueError("ToolSettings.max_output_chars must be >= 1, got "
                             f"{self.max_output_chars}")
        if not self.role:
            raise ValueError("ToolSettings.role must be a chat role, e.g. 'tool' or 'user'")


def last_call(turn: str, settings: ToolSettings) -> str | None:
    """The code of the turn's last complete call, None when it has none."""
    end = turn.rfind(settings.call_close)
    start = -1 if end < 0 else turn.rfind(settings.call_open, 0, end)
    return None if start < 0 else turn[start + len(settings.call_open):end]


def _status_line(result: ExecutionResult, settings: ToolSettings) -> str:
    if result.status == "timeout":
        return f"timeout after {settings.wall_time_s:g} s"
    if result.status == "runtime_error" and result.exit_code is not None:
        return f"runtime_error, exit {result.exit_code}"
    return f"{result.status}, {result.detail}" if result.detail else result.status


def render_observation(result: ExecutionResult, settings: ToolSettings) -> str:
    """What the model reads: stdout (its first `max_output_chars`), and when the run failed the
    tail of stderr (the traceback ends there) and its status, e.g. "[timeout after 5 s]"."""
    limit = settings.max_output_chars
    text = result.stdout
    if len(text) > limit:
        text = f"{text[:limit]}\n[... {len(text) - limit} more characters of output cut]"
    if result.ok:
        return text
    parts = [text.rstrip("\n")] if text else []
    stderr = result.stderr.rstrip("\n")
    if len(stderr) > limit:
        stderr = f"[... {len(stderr) - limit} characters of stderr cut]\n{stderr[-limit:]}"
    if stderr:
        parts.append(stderr)
    parts.append(f"[{_status_line(result, settings)}]")
    return "\n".join(parts)


class PythonToolEnvironment(Environment):
    """Runs the model's Python calls in `sandbox` and grades its turns with `grade(text, record)`
    (the model's turns joined, observations excluded) when the trajectory ends."""

    multi_turn = True

    def __init__(self, sandbox: Sandbox, *, grade: Grader,
                 settings: ToolSettings = ToolSettings()) -> None:
        self.sandbox, self.grade, self.settings = sandbox, grade, settings
        self.stop_texts = (settings.call_close,)
        # One call's limits: the sandbox's own, with the tool's (shorter) time budget.
        self.limits: SandboxLimits = dataclasses.replace(
            sandbox.config.limits, wall_time_s=settings.wall_time_s,
            cpu_time_s=settings.wall_time_s)

    def initial_messages(self, record: PromptRecord) -> list[dict[str, str]]:
        messages = record.conversation
        prompt = self.settings.system_prompt
        if prompt is None:
            return messages
        if messages[0]["role"] == "system":  # one system message: the tool's, then the record's
            return [{"role": "system", "content": f"{prompt}\n\n{messages[0]['content']}"},
                    *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    async def start(self, record: PromptRecord) -> EnvironmentSession:
        return _ToolSession(self, record)


class _ToolSession(EnvironmentSession):
    def __init__(self, environment: PythonToolEnvironment, record: PromptRecord) -> None:
        self._env, self._record = environment, record
        self._turns: list[str] = []

    async def step(self, turn: str, *, final: bool = False) -> StepResult:
        self._turns.append(turn)
        code = last_call(turn, self._env.settings)
        if code is None or final:
            text = "".join(self._turns)
            reward = await asyncio.to_thread(confined_grade, self._env.grade, text, self._record)
            return StepResult(done=True, reward=reward)
        # On the sandbox's num_workers threads, not the event loop's few (min(32, CPUs + 4)),
        # which the rollout's scoring shares: thousands of trajectories call at once at scale.
        result = await asyncio.wrap_future(self._env.sandbox.submit(
            ExecutionRequest(program=code, limits=self._env.limits)))
        seconds = result.wall_time_s  # the program's, not its wait for a worker
        if result.status == "sandbox_error":  # the sandbox failed, not the program: no verdict
            return StepResult(done=True, tool_calls=1, tool_errors=1, tool_seconds=seconds,
                              reward=make_result(Reason.SANDBOX_ERROR, RewardScale(),
                                                 detail=result.detail[:300]))
        content = render_observation(result, self._env.settings)
        return StepResult(done=False, observation=({"role": self._env.settings.role,
                                                    "content": content},),
                          tool_calls=1, tool_errors=0 if result.ok else 1, tool_seconds=seconds)
