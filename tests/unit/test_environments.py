"""Environments (megatron_rl/environments): the Python tool environment on the real code sandbox
(its server is a local subprocess, started once per module in ~0.1 s; isolation "auto" so that a
host without namespaces uses the seccomp fallback), graded by the real reasoning-gym reward; the
verifier environment against RewardRegistry.score; the registry's dispatch, checks and module
loading. No stand-ins except hand graders where a test needs to see what is graded, and one
sandbox whose programs wait on a barrier (how many tool calls run at once: scheduling logic)."""
import asyncio
import dataclasses
import os
import threading

import pytest

from megatron_rl.data import PromptRecord, reasoning_gym_prompts
from megatron_rl.data.sources import PROCEDURAL_TASK_PREFIX
from megatron_rl.environments import (
    EnvironmentRegistry,
    PythonToolEnvironment,
    ToolSettings,
    VerifierEnvironment,
    default_environments,
    load_environment_modules,
)
from megatron_rl.rewards import (
    ProceduralReward,
    Reason,
    RewardRegistry,
    RewardScale,
    Sandbox,
    SandboxConfig,
    make_result,
)
from megatron_rl.rewards.registry import UnknownTaskError
from megatron_rl.rewards.sandbox import ExecutionResult, SandboxUnavailableError

pytestmark = pytest.mark.unit

TOOL_TASK = "tool/rg/basic_arithmetic"


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(num_workers=2, isolation="auto")) as sb:
        yield sb


@pytest.fixture(scope="module")
def rg_record():
    (record,) = reasoning_gym_prompts("basic_arithmetic", num_prompts=1, seed=0)
    return record


@pytest.fixture(scope="module")
def rewards():
    """The procedural part of rewards.default_registry (no math workers, no code sandbox)."""
    registry = RewardRegistry()
    registry.register(PROCEDURAL_TASK_PREFIX, ProceduralReward(), requires=("answer",))
    return registry


def _steps(environment, record, turns, *, final_last=False):
    """The StepResults of `turns` played in one session (closed at the end)."""
    async def play():
        session = await environment.start(record)
        try:
            return [await session.step(turn, final=final_last and i == len(turns) - 1)
                    for i, turn in enumerate(turns)]
        finally:
            await session.close()
    return asyncio.run(play())


def _tool_env(sandbox, settings=ToolSettings(), grade=None):
    grade = grade or (lambda text, record: make_result(Reason.WRONG, RewardScale()))
    return PythonToolEnvironment(sandbox, grade=grade, settings=settings)


# --- the Python tool environment ----------------------------------------------------------------
def test_a_tool_trajectory_runs_its_calls_and_grades_the_models_turns(sandbox, rewards,
                                                                       rg_record):
    environment = default_environments(rewards, sandbox).for_task(TOOL_TASK)
    record = dataclasses.replace(rg_record, task=TOOL_TASK)
    turns = ["<think>First <tool>print(1)</tool> no, this: <tool>print(6 * 7)</tool>",
             f"42, so</think><answer>{rg_record.answer}</answer>"]
    call, end = _steps(environment, record, turns)
    # The last call of the turn ran; its stdout is the observation.
    assert call.observation == ({"role": "tool", "content": "42\n"},) and not call.done
    assert (call.tool_calls, call.tool_errors) == (1, 0) and call.tool_seconds > 0
    # Graded as the reward of the inner task grades the model's turns, observations excluded.
    assert end.done and end.reward == ProceduralReward()("".join(turns), rg_record)
    assert end.reward.reason == Reason.CORRECT
    (wrong,) = _steps(environment, record, ["</think><answer>7</answer>"])
    assert wrong.done and wrong.reward.reason == Reason.WRONG and wrong.tool_calls == 0
    assert environment.stop_texts == ("</tool>",) and environment.multi_turn


def test_failed_calls_are_observations(sandbox, rg_record):
    # The default 5 s for a program that fails at once (an interpreter's start under load
    # passed 0.5 s once, in the suite); 0.5 s for one that sleeps 2 s.
    (raised,) = _steps(_tool_env(sandbox), rg_record, [
        "<tool>print('partial')\nraise ValueError('bad input')</tool>"])
    (looped,) = _steps(_tool_env(sandbox, ToolSettings(wall_time_s=0.5)), rg_record, [
        "<tool>import time\ntime.sleep(2)\nprint('finished')</tool>"])
    long_output, long_error = _steps(_tool_env(sandbox, ToolSettings(max_output_chars=10)),
                                     rg_record, [
        "<tool>print('x' * 25)</tool>",
        "<tool>import sys\nsys.stderr.write('e' * 30 + 'END')\nsys.exit(3)</tool>"])
    for result in (raised, looped, long_error):
        assert not result.done and (result.tool_calls, result.tool_errors) == (1, 1), result
    content = raised.observation[0]["content"]
    assert content.startswith("partial\n") and content.endswith(
        "ValueError: bad input\n[runtime_error, exit 1]"), content
    assert looped.observation[0]["content"] == "[timeout after 0.5 s]"
    assert looped.tool_seconds >= 0.5  # the host waited for the kill (at 0.5 s, not 2 s)
    # stdout keeps its head, stderr its tail; each says how much was cut (26 and 33 characters).
    assert long_output.tool_errors == 0 and long_output.observation[0]["content"] == (
        "x" * 10 + "\n[... 16 more characters of output cut]")
    assert long_error.observation[0]["content"] == (
        "[... 23 characters of stderr cut]\neeeeeeeEND\n[runtime_error, exit 3]")


def test_the_last_turn_is_graded_without_running_its_call(sandbox, rg_record):
    graded = []

    def grade(text, record):
        graded.append(text)
        return make_result(Reason.CORRECT, RewardScale())

    environment = _tool_env(sandbox, grade=grade)
    call, end = _steps(environment, rg_record, ["<tool>print(2)</tool>", "<tool>print(3)</tool>"],
                       final_last=True)
    assert call.observation[0]["content"] == "2\n"
    assert end.done and end.reward.reason == Reason.CORRECT and end.tool_calls == 0
    assert graded == ["<tool>print(2)</tool><tool>print(3)</tool>"]
    # A grader that raises fails its trajectory only; one that finds no isolation raises.
    for error, outcome in ((KeyError("x"), Reason.VERIFIER_ERROR),
                           (SandboxUnavailableError("no namespaces"), SandboxUnavailableError)):
        def broken(text, record, error=error):
            raise error
        if outcome is SandboxUnavailableError:
            with pytest.raises(SandboxUnavailableError):
                _steps(_tool_env(sandbox, grade=broken), rg_record, ["no call"])
        else:
            (end,) = _steps(_tool_env(sandbox, grade=broken), rg_record, ["no call"])
            assert end.reward.reason == outcome and end.reward.reward is None


def test_tool_calls_run_on_the_sandboxs_workers_not_the_event_loops_few_threads(rg_record):
    """At scale thousands of trajectories call the tool at once: num_workers programs must run
    at a time, whatever the size of asyncio's default executor (min(32, CPUs + 4) threads, which
    the rollout's scoring shares). Stand-in: every program waits on a barrier of num_workers
    (a few more than that default executor), so the calls pass only if all run at once."""
    default_threads = min(32, (os.cpu_count() or 1) + 4)

    class Gathering(Sandbox):
        def __init__(self, parties):
            super().__init__(SandboxConfig(num_workers=parties, isolation="auto"))
            self.barrier = threading.Barrier(parties, timeout=60)

        def execute(self, request):
            self.barrier.wait()  # BrokenBarrierError after 60 s if fewer run at once
            return ExecutionResult(status="ok", stdout=request.program, stderr="",
                                   test_passed=(), exit_code=0, signal=None, wall_time_s=0.0,
                                   cpu_time_s=0.0, max_rss_bytes=0, isolation="seccomp",
                                   uid=None)

    parties = default_threads + 2
    with Gathering(parties) as sandbox:
        environment = _tool_env(sandbox)

        async def calls():
            async def one(i):
                session = await environment.start(rg_record)
                try:
                    return await session.step(f"<tool>print({i})</tool>")
                finally:
                    await session.close()
            return await asyncio.gather(*(one(i) for i in range(parties)))

        results = asyncio.run(calls())
    assert [r.observation[0]["content"] for r in results] == \
        [f"print({i})" for i in range(parties)]


def test_the_sandboxs_open_files_are_what_a_run_opens(sandbox, monkeypatch):
    """Sandbox.max_open_files (what megatron-rl train reserves beside its requests' sockets) is
    num_workers x the pipe ends one real run opens in this process (its server already up)."""
    import megatron_rl.rewards.sandbox as sandbox_module

    assert sandbox.run("pass").ok  # the server's own start (its pipes) is not a run's
    opened, pipe = [], os.pipe

    def counted():
        ends = pipe()
        opened.extend(ends)
        return ends

    monkeypatch.setattr(sandbox_module.os, "pipe", counted)
    assert sandbox.run("print(1)").stdout == "1\n"
    assert len(opened) > 0
    assert sandbox.max_open_files() == sandbox.config.num_workers * len(opened)


def test_a_sandbox_failure_ends_the_trajectory_without_reward(rg_record):
    # A real Sandbox whose server cannot start: what an unreachable server gives (sandbox_error).
    with Sandbox(SandboxConfig(num_workers=1, isolation="auto",
                               python_executable="/nonexistent/python")) as broken:
        (end,) = _steps(_tool_env(broken), rg_record, ["<tool>print(1)</tool>"])
    assert end.done and end.reward.reward is None and end.reward.reason == Reason.SANDBOX_ERROR
    assert (end.tool_calls, end.tool_errors) == (1, 1)


def test_the_system_prompt_is_prepended(sandbox, rg_record):
    settings = ToolSettings(system_prompt="Use <tool>code</tool>.")
    assert _tool_env(sandbox, settings).initial_messages(rg_record) == [
        {"role": "system", "content": "Use <tool>code</tool>."},
        {"role": "user", "content": rg_record.prompt}]
    assert _tool_env(sandbox).initial_messages(rg_record) == rg_record.conversation
    with_system = PromptRecord.with_prompt([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "6 * 7?"}],
                                           prompt_id="s", task=TOOL_TASK)
    assert _tool_env(sandbox, settings).initial_messages(with_system) == [
        {"role": "system", "content": "Use <tool>code</tool>.\n\nBe brief."},
        {"role": "user", "content": "6 * 7?"}]
    with pytest.raises(ValueError, match="call_open"):
        ToolSettings(call_open="</tool>")


# --- verifiers as environments --------------------------------------------------------------
def test_the_verifier_environment_scores_as_the_registry_does(rewards, rg_record):
    environment = VerifierEnvironment(rewards)
    assert not environment.multi_turn and environment.stop_texts == ()
    for text in (f"</think><answer>{rg_record.answer}</answer>", "</think><answer>3</answer>",
                 "no thinking end"):
        (end,) = _steps(environment, rg_record, [text])
        assert end.done and end.reward == rewards.score(text, rg_record), text
    broken = RewardRegistry()
    broken.register("x", lambda text, record: 1 / 0)
    record = dataclasses.replace(rg_record, task="x")
    (end,) = _steps(VerifierEnvironment(broken), record, ["t"])
    assert end.reward.reason == Reason.VERIFIER_ERROR and "ZeroDivisionError" in end.reward.detail


# --- the registry ---------------------------------------------------------------------------
def test_dispatch_exact_then_longest_family_then_verifier(sandbox, rewards):
    registry = EnvironmentRegistry(rewards)
    family, longer, exact = _tool_env(sandbox), _tool_env(sandbox), _tool_env(sandbox)
    registry.register("tool/", family)
    registry.register("tool/rg/", longer)
    registry.register("tool/rg/special", exact)
    assert registry.for_task("tool/math") is family
    assert registry.for_task("tool/rg/gcd") is longer
    assert registry.for_task("tool/rg/special") is exact
    assert isinstance(registry.for_task("rg/gcd"), VerifierEnvironment)
    with pytest.raises(UnknownTaskError, match=r"'math'.*\['tool/rg/special', 'tool/\*'"):
        registry.for_task("math")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("tool/", family)


def test_check_lists_what_cannot_run(sandbox, rewards, rg_record):
    registry = default_environments(rewards, sandbox)
    good = [rg_record, dataclasses.replace(rg_record, task=TOOL_TASK)]
    registry.check(good)
    assert not registry.any_multi_turn(good[:1]) and registry.any_multi_turn(good)
    bad = [dataclasses.replace(rg_record, prompt_id="a", task=TOOL_TASK, answer=None),
           dataclasses.replace(rg_record, prompt_id="b", task="tool/nope"),
           dataclasses.replace(rg_record, prompt_id="c", task="nope"),
           dataclasses.replace(rg_record, prompt_id="d", answer=None)]
    with pytest.raises(ValueError) as info:
        registry.check(good + bad)
    message = str(info.value)
    assert message.startswith("4 prompt(s) cannot be run")
    assert "a (task 'tool/rg/basic_arithmetic'): lacks ['answer'] (its inner task's" in message
    assert "b (task 'tool/nope'): inner task 'nope' has no reward" in message
    assert "c (task 'nope'): no environment for task 'nope'" in message
    assert "d (task 'rg/basic_arithmetic'): lacks ['answer'] (its reward needs" in message


def test_environment_modules_register_their_environments(tmp_path, monkeypatch, rewards):
    (tmp_path / "my_envs.py").write_text(
        "from megatron_rl.environments import VerifierEnvironment\n"
        "def register_environments(registry, **context):\n"
        "    registry.register('guess', VerifierEnvironment(registry.reward_registry))\n"
        "    registry.context = context\n")
    (tmp_path / "no_register.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = EnvironmentRegistry(rewards)
    load_environment_modules(registry, ["my_envs"], sandbox="the sandbox")
    assert registry.tasks == ("guess",) and registry.context == {"sandbox": "the sandbox"}
    with pytest.raises(ValueError, match="'missing_envs' cannot be imported.*PYTHONPATH"):
        load_environment_modules(registry, ["missing_envs"])
    with pytest.raises(ValueError, match=r"'no_register' .*defines no register_environments"):
        load_environment_modules(registry, ["no_register"])
