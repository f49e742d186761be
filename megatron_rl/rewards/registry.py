"""Reward dispatch by task tag: a registry from task tag (exact, like "math", or a family prefix,
like "rg/") to a reward function `fn(completion, record) -> RewardResult`, with the record fields
each one needs. `default_registry` wires math (math-verify), code (sandbox) and reasoning-gym
procedural tasks with one shared RewardScale. `score_many` re-scores verifier failures (a dead
math worker, an unreachable sandbox: usually transient, and the verifier starts a fresh worker or
server) before handing them on; what remains has no reward and its group is dropped (failures.py).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from megatron_rl.data.records import PromptRecord
from megatron_rl.data.sources import PROCEDURAL_TASK_PREFIX
from megatron_rl.rewards.code import CodeReward, CodeRewardConfig
from megatron_rl.rewards.math import MathVerifier
from megatron_rl.rewards.procedural import ProceduralReward, ProceduralRewardConfig
from megatron_rl.rewards.sandbox import Sandbox, SandboxUnavailableError
from megatron_rl.rewards.types import Reason, RewardResult, RewardScale, make_result

RewardFn = Callable[[str, PromptRecord], RewardResult]
_REQUIRABLE = ("answer", "tests", "metadata")
_log = logging.getLogger(__name__)


class UnknownTaskError(ValueError):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    fn: RewardFn
    requires: tuple[str, ...]


class RewardRegistry:
    def __init__(self) -> None:
        self._exact: dict[str, _Entry] = {}
        self._families: dict[str, _Entry] = {}

    def register(self, task: str, fn: RewardFn, *, requires: Sequence[str] = ()) -> None:
        """`task` is an exact tag, or a family prefix ending in "/" ("rg/" matches "rg/gcd")."""
        unknown = [field for field in requires if field not in _REQUIRABLE]
        if unknown:
            raise ValueError(f"requires={list(requires)}: {unknown} are not PromptRecord fields "
                             f"that can be required; choose from {_REQUIRABLE}")
        table = self._families if task.endswith("/") else self._exact
        if task in table:
            raise ValueError(f"a reward for task {task!r} is already registered")
        table[task] = _Entry(fn, tuple(requires))

    @property
    def tasks(self) -> tuple[str, ...]:
        """Registered tags; families shown as 'prefix/*'."""
        return tuple(sorted(self._exact) + sorted(f"{p}*" for p in self._families))

    def grades(self, task: str) -> bool:
        """Whether a reward is registered for `task` (exactly or by family)."""
        return self._lookup(task) is not None

    def _lookup(self, task: str) -> _Entry | None:
        entry = self._exact.get(task)
        if entry is None:
            prefix = longest_family(self._families, task)
            entry = None if prefix is None else self._families[prefix]
        return entry

    def _entry(self, task: str) -> _Entry:
        entry = self._lookup(task)
        if entry is None:
            raise UnknownTaskError(f"no reward function for task {task!r}; registered tasks: "
                                   f"{list(self.tasks)}. Fix the prompt's 'task' field or "
                                   "register one with RewardRegistry.register")
        return entry

    def missing_fields(self, record: PromptRecord) -> list[str]:
        """The record fields its reward needs that it lacks; UnknownTaskError for an unknown
        task. Only the registrations are read: no verifier needs to be running."""
        return [f for f in self._entry(record.task).requires if not getattr(record, f)]

    def check(self, records: Sequence[PromptRecord]) -> None:
        """Fail before training if a record's task is unknown or lacks what its reward needs."""
        problems = []
        for record in records:
            missing = self.missing_fields(record)
            if missing:
                problems.append(f"{record.prompt_id} (task {record.task!r}) lacks {missing}")
        if problems:
            raise ValueError(f"{len(problems)} prompt(s) cannot be graded: {problems[:5]}")

    def score(self, completion: str, record: PromptRecord) -> RewardResult:
        return self._entry(record.task).fn(completion, record)

    def _score_one(self, completion: str, record: PromptRecord) -> RewardResult:
        """`score`, with an exception confined to this sample (`confined_score`)."""
        return confined_score(self.score, completion, record)

    def score_many(self, completions: Sequence[str], records: Sequence[PromptRecord], *,
                   num_threads: int = 8, retries: int = 1) -> list[RewardResult]:
        """Score completion i against records[i], `num_threads` at a time (verifiers wait on
        worker processes and sandboxes, so threads suffice); results in input order. A result
        whose verifier failed (`RewardResult.verifier_failed`) is scored again, up to `retries`
        times; one that still fails comes back as it is (no reward). A reward function that
        raises fails only its own sample (`verifier_error`)."""
        if len(completions) != len(records):
            raise ValueError(f"{len(completions)} completions but {len(records)} records; "
                             "pass one record per completion")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        for record in {r.task: r for r in records}.values():
            self._entry(record.task)  # unknown tags fail before any work starts
        with ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="reward") as pool:
            results = list(pool.map(self._score_one, completions, records))
            for attempt in range(1, retries + 1):
                failed = [i for i, result in enumerate(results) if result.verifier_failed]
                if not failed:
                    break
                first = results[failed[0]]
                _log.warning("re-scoring %d of %d samples whose verifier failed (attempt %d of "
                             "%d); e.g. %s: %s", len(failed), len(results), attempt, retries,
                             first.reason, first.detail)
                rescored = pool.map(self._score_one, [completions[i] for i in failed],
                                    [records[i] for i in failed])
                for i, result in zip(failed, rescored):
                    results[i] = result
        return results


def longest_family(prefixes, task: str) -> str | None:
    """The longest of the family `prefixes` ("rg/", "tool/") that `task` belongs to: it starts
    with the prefix and names something after it. None when none does."""
    return next((p for p in sorted(prefixes, key=len, reverse=True)
                 if task.startswith(p) and len(task) > len(p)), None)


def confined_score(fn: RewardFn, completion: str, record: PromptRecord) -> RewardResult:
    """`fn(completion, record)`, with an exception confined to this sample: a verifier failure
    (`Reason.VERIFIER_ERROR`, no reward) instead of an error that would fail every sample of the
    batch (or every trajectory of a group: environments/ grade through it too). A sandbox that
    cannot isolate programs on this host is a configuration error and still raises."""
    try:
        return fn(completion, record)
    except SandboxUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001 - any verifier bug stays with its sample
        _log.warning("the reward of a %r sample raised; scored as %s", record.task,
                     Reason.VERIFIER_ERROR, exc_info=True)
        return make_result(Reason.VERIFIER_ERROR, RewardScale(),
                           detail=f"{type(exc).__name__}: {exc}"[:300])


def default_registry(*, math_verifier: MathVerifier, sandbox: Sandbox,
                     scale: RewardScale | None = None) -> RewardRegistry:
    """Tasks "math", "code" and "rg/<dataset>" with one reward scale (overriding the math
    verifier's own). The caller owns (and closes) the verifier and the sandbox."""
    scale = scale or RewardScale()
    registry = RewardRegistry()
    registry.register("math", lambda c, r: math_verifier.grade(c, r.answer, scale=scale),
                      requires=("answer",))
    code = CodeReward(sandbox, CodeRewardConfig(scale=scale))
    registry.register("code", lambda c, r: code(c, r.tests), requires=("tests",))
    procedural = ProceduralReward(ProceduralRewardConfig(scale=scale))
    registry.register(PROCEDURAL_TASK_PREFIX, procedural, requires=("answer",))
    return registry


def start_run_verifiers(run, stack) -> tuple[MathVerifier, Sandbox, RewardRegistry]:
    """A training run's verifiers: the math-verify workers and the code sandbox (closed by the
    ExitStack `stack`) behind the default registry. The sandbox is returned too: the tool
    environment runs the model's calls in it (environments/)."""
    from megatron_rl.rewards.sandbox import SandboxConfig

    math_verifier = MathVerifier()
    stack.callback(math_verifier.close)
    sandbox = Sandbox(SandboxConfig.from_run_config(run))
    stack.callback(sandbox.close)
    return math_verifier, sandbox, default_registry(math_verifier=math_verifier,
                                                    sandbox=sandbox)
