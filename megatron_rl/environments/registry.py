"""Environment dispatch by task tag, as rewards/registry.py dispatches verifiers: an exact tag or a
family prefix ending in "/" -> an `Environment`; a task with no environment of its own but a
registered reward gets the shared single-turn `VerifierEnvironment` (so every existing recipe runs
as before). `default_environments` adds the family "tool/": task "tool/<inner>" (e.g.
"tool/rg/basic_arithmetic", "tool/math") is the Python tool environment graded by the reward of
task <inner>. `load_environment_modules` is how a run registers users' own environments (the
config's `environment.modules`): each module defines `register_environments(registry, **context)`.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence

from megatron_rl.data.records import PromptRecord
from megatron_rl.environments.base import Environment
from megatron_rl.environments.python_tool import PythonToolEnvironment, ToolSettings
from megatron_rl.environments.verifier import VerifierEnvironment
from megatron_rl.rewards.registry import RewardRegistry, UnknownTaskError, longest_family
from megatron_rl.rewards.sandbox import Sandbox

TOOL_TASK_PREFIX = "tool/"
REGISTER_FUNCTION = "register_environments"
# A record of a task -> what it lacks to be run (e.g. "lacks ['answer']"); [] when it is fine.
RecordCheck = Callable[[PromptRecord], Sequence[str]]


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    environment: Environment
    check: RecordCheck | None


class EnvironmentRegistry:
    def __init__(self, reward_registry: RewardRegistry) -> None:
        self.reward_registry = reward_registry
        self._exact: dict[str, _Entry] = {}
        self._families: dict[str, _Entry] = {}
        self._verifier = VerifierEnvironment(reward_registry)

    def register(self, task: str, environment: Environment, *,
                 check: RecordCheck | None = None) -> None:
        """`task` is an exact tag, or a family prefix ending in "/" ("tool/" matches
        "tool/math"). `check(record)` optionally names what a record of it lacks (check())."""
        if not isinstance(environment, Environment):
            raise ValueError(f"register({task!r}, ...) needs an Environment (megatron_rl."
                             f"environments.Environment), got {type(environment).__name__}")
        table = self._families if task.endswith("/") else self._exact
        if task in table:
            raise ValueError(f"an environment for task {task!r} is already registered")
        table[task] = _Entry(environment, check)

    @property
    def tasks(self) -> tuple[str, ...]:
        """Registered tags; families shown as 'prefix/*'."""
        return tuple(sorted(self._exact) + sorted(f"{p}*" for p in self._families))

    def _entry(self, task: str) -> _Entry | None:
        entry = self._exact.get(task)
        if entry is None:
            prefix = longest_family(self._families, task)
            entry = None if prefix is None else self._families[prefix]
        return entry

    def for_task(self, task: str) -> Environment:
        """The environment of `task`: exact tag, then the longest family prefix, then the shared
        verifier environment where the reward registry grades the task."""
        entry = self._entry(task)
        if entry is not None:
            return entry.environment
        if self.reward_registry.grades(task):
            return self._verifier
        raise UnknownTaskError(f"no environment for task {task!r}: environments are registered "
                               f"for {list(self.tasks)} and rewards for "
                               f"{list(self.reward_registry.tasks)}. Fix the prompt's 'task' "
                               "field or register one (EnvironmentRegistry.register, or a module "
                               "in environment.modules)")

    def check(self, records: Sequence[PromptRecord]) -> None:
        """Fail before training if a record has no environment or lacks what it needs."""
        problems = []
        for record in records:
            try:
                entry = self._entry(record.task)
                if entry is None:
                    self.for_task(record.task)  # the verifier fallback, or UnknownTaskError
                    missing = self.reward_registry.missing_fields(record)
                    lacks = [f"lacks {missing} (its reward needs them)"] if missing else []
                else:
                    lacks = list(entry.check(record)) if entry.check else []
            except UnknownTaskError as exc:
                lacks = [str(exc)]
            if lacks:
                problems.append(f"{record.prompt_id} (task {record.task!r}): "
                                + "; ".join(lacks))
        if problems:
            raise ValueError(f"{len(problems)} prompt(s) cannot be run in their environment "
                             f"(first {min(5, len(problems))}): " + " | ".join(problems[:5]))

    def any_multi_turn(self, records: Sequence[PromptRecord]) -> bool:
        return any(self.for_task(task).multi_turn for task in {r.task for r in records})


def inner_record(record: PromptRecord, prefix: str = TOOL_TASK_PREFIX) -> PromptRecord:
    """The record as its inner task's reward reads it ("tool/math" -> "math")."""
    return dataclasses.replace(record, task=record.task[len(prefix):])


def default_environments(reward_registry: RewardRegistry, sandbox: Sandbox,
                         tool_settings: ToolSettings = ToolSettings()) -> EnvironmentRegistry:
    """Every task the reward registry grades (single-turn, as before), and "tool/<inner>": the
    Python tool environment in `sandbox`, graded by the reward of <inner> on the record."""
    registry = EnvironmentRegistry(reward_registry)

    def grade(text: str, record: PromptRecord):
        return reward_registry.score(text, inner_record(record))

    def check(record: PromptRecord) -> list[str]:
        try:
            missing = reward_registry.missing_fields(inner_record(record))
        except UnknownTaskError:
            return [f"inner task {record.task[len(TOOL_TASK_PREFIX):]!r} has no reward; "
                    f"rewards are registered for {list(reward_registry.tasks)}"]
        return [f"lacks {missing} (its inner task's reward needs them)"] if missing else []

    registry.register(TOOL_TASK_PREFIX,
                      PythonToolEnvironment(sandbox, grade=grade, settings=tool_settings),
                      check=check)
    return registry


def load_environment_modules(registry: EnvironmentRegistry, modules: Sequence[str],
                             **context) -> None:
    """Import each module (a dotted name on sys.path) and call its
    `register_environments(registry, **context)`."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"environment module {name!r} cannot be imported ({exc}); put it "
                             "on PYTHONPATH (or install it) and give its dotted name") from exc
        register = getattr(module, REGISTER_FUNCTION, None)
        if not callable(register):
            raise ValueError(f"environment module {name!r} ({getattr(module, '__file__', '?')}) "
                             f"defines no {REGISTER_FUNCTION}(registry, **context); add one that "
                             "calls registry.register(task, environment)")
        register(registry, **context)
