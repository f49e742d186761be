"""The Pipeline-RL staleness bound (SCALERL.md section 7): which new prompts may start generating
(the admission gate), whether a finished group may still be trained on (the take-time check),
and the per-step staleness histogram the driver logs. Pure Python, no processes: the rollout
manager asks the gate before every admission and every take, and checkpoints its counters.

Versions: the trainer's policy version v counts its published optimizer steps (0 = the initial
weights; v + 1 is published once step v + 1's weights reached the generators). Optimizer step
v + 1 trains on `prompts_per_step` groups taken at version v, so "lag" = v - (a token's version).

`pipeline` with max off-policyness k: a group is admitted only while the groups started are
fewer than (k + 1 + v) x prompts_per_step, so at most (k + 1) x prompts_per_step groups are ever
generating or waiting ahead of the trainer, and a group admitted at version a is meant for a step
trained at version a + k at the latest. Groups finish out of order (long generations are
overtaken), so the bound is also checked when the trainer takes a group: one whose oldest token
is older than v - k is not trained on; it is re-queued (its prompt is admitted again later and
regenerated) or dropped, and counted. Re-queueing is bounded: a prompt regenerated
`max_requeues` times that goes stale once more (a generation that always outlasts k steps would
be regenerated forever), or whose prompt No-Positive-Resampling has retired meanwhile, is
dropped instead. k = 0 is the synchronous on-policy baseline: step v + 1's
data starts generating only once version v is published, and every trained token has version v.
`ppo_off_policy` (the paper's PPO-off-policy-k baseline) is the same gate with rounds: k x
prompts_per_step groups are generated with one policy, the trainer waits for the whole round and
takes k steps on it, and only then does the next round start, with the newest weights.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Iterable
from typing import Any, Literal

MODES = ("pipeline", "ppo_off_policy")
STALE_POLICIES = ("requeue", "drop")
SCALAR_PREFIX = "rollout/staleness"
_STATE_VERSION = 1


class TakeDecision(enum.StrEnum):
    """What the trainer does with a finished group it takes from the buffer."""

    FRESH = "fresh"  # within the bound: train on it
    REQUEUE = "requeue"  # too stale: not trained; its prompt is admitted again (regenerated)
    DROP = "drop"  # too stale: not trained; discarded and counted


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    # bool is an int subclass; `max_off_policyness: true` in a recipe is a mistake, not k = 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StalenessSettings:
    """How far generation may run ahead of training. The driver fills it from the run config
    (rollout.mode, rollout.max_off_policyness, RunConfig.prompts_per_step)."""

    mode: Literal["pipeline", "ppo_off_policy"] = "pipeline"
    max_off_policyness: int  # k: most optimizer steps the trainer may be ahead of its data
    prompts_per_step: int  # groups consumed per optimizer step
    # Requeue is the default: the groups that go stale are the slowest, i.e. the longest
    # generations, so dropping them would bias training towards short responses.
    stale_policy: Literal["requeue", "drop"] = "requeue"
    max_requeues: int = 3  # regenerations of one stale prompt before it is dropped instead

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got "
                             f"{self.stale_policy!r}")
        _require_int("max_off_policyness", self.max_off_policyness, minimum=0)
        _require_int("prompts_per_step", self.prompts_per_step, minimum=1)
        _require_int("max_requeues", self.max_requeues, minimum=0)
        if self.mode == "ppo_off_policy" and self.max_off_policyness < 1:
            raise ValueError(
                "max_off_policyness must be >= 1 with mode='ppo_off_policy' (it is the number "
                "of optimizer steps taken on each generated round), got "
                f"{self.max_off_policyness}; use mode='pipeline' with max_off_policyness=0 "
                "for the synchronous baseline")

    @classmethod
    def from_run_config(cls, run) -> "StalenessSettings":
        """From megatron_rl.config's RunConfig (rollout.mode, rollout.max_off_policyness,
        rollout.stale_group_policy, rollout.max_requeues and the run's prompts_per_step)."""
        rollout = run.rollout
        return cls(mode=rollout.mode, max_off_policyness=rollout.max_off_policyness,
                   prompts_per_step=run.prompts_per_step,
                   stale_policy=rollout.stale_group_policy, max_requeues=rollout.max_requeues)

    @property
    def max_outstanding_groups(self) -> int:
        """Most groups admitted and not yet taken at any time: (k + 1) x prompts_per_step for
        pipeline, one round of k x prompts_per_step for ppo_off_policy."""
        k, per_step = self.max_off_policyness, self.prompts_per_step
        return (k + 1) * per_step if self.mode == "pipeline" else k * per_step

    @property
    def round_size(self) -> int:
        """ppo_off_policy: groups generated per round with one policy (k x prompts_per_step)."""
        return self.max_off_policyness * self.prompts_per_step


class AdmissionGate:
    """Counts groups from admission to take and applies the staleness bound.

    Every admitted group leaves through exactly one of `on_take` (trained, re-queued or dropped)
    or `on_abandon` (lost: its generator died, or it was in flight at a checkpoint that did not
    keep it); until then it is outstanding (generating, or finished and waiting in the buffer).
    "Groups started" in the bound counts the trained and the outstanding ones: a group that is
    discarded or abandoned gives its slot back. Counting it would shrink the pipeline by one
    group for good with every discard, down to prompts_per_step groups: Pipeline-RL-k would
    quietly become the synchronous schedule (and abandoned groups could stall it outright).

    The formula (k + 1 + v) x prompts_per_step relies on each optimizer step taking exactly
    prompts_per_step fresh groups through `on_take` (a zero-variance filter applied after the
    take does not matter); the gate refuses a trainer version that its counts cannot explain.
    """

    def __init__(self, settings: StalenessSettings) -> None:
        self.settings = settings
        self._num_admitted = 0
        self._num_trained = 0
        self._num_requeued = 0
        self._num_dropped = 0
        self._num_abandoned = 0
        self._trainer_version = 0  # newest version seen; versions never go back

    @property
    def num_admitted(self) -> int:
        """Groups admitted so far (a re-queued prompt counts again when re-admitted)."""
        return self._num_admitted

    @property
    def num_trained(self) -> int:
        """Groups taken fresh into an optimizer step's batch."""
        return self._num_trained

    @property
    def num_requeued(self) -> int:
        return self._num_requeued

    @property
    def num_dropped(self) -> int:
        return self._num_dropped

    @property
    def num_abandoned(self) -> int:
        return self._num_abandoned

    @property
    def num_outstanding(self) -> int:
        """Admitted groups not yet taken or abandoned: generating, or finished and buffered."""
        return (self._num_admitted - self._num_trained - self._num_requeued - self._num_dropped
                - self._num_abandoned)

    @property
    def num_started(self) -> int:
        """The "groups started" of the bound: trained plus outstanding."""
        return self._num_trained + self.num_outstanding

    def admission_limit(self, trainer_version: int) -> int:
        """How many groups may have been started at this trainer version."""
        self._observe(trainer_version)
        k, per_step = self.settings.max_off_policyness, self.settings.prompts_per_step
        if self.settings.mode == "pipeline":
            return (k + 1 + trainer_version) * per_step
        # Round r is generated at version r x k; the next opens once its k steps are published.
        return (trainer_version // k + 1) * self.settings.round_size

    def may_admit(self, trainer_version: int) -> bool:
        """Whether one more group may start generating now. For ppo_off_policy this also means
        "the previous round is fully consumed": the version after its k steps exists only once
        its k x prompts_per_step groups were trained (`_observe` holds the trainer to that)."""
        return self.num_started < self.admission_limit(trainer_version)

    def on_admit(self, trainer_version: int) -> None:
        """Record an admission; refused (RuntimeError) when `may_admit` would say no, so a
        driver bug cannot silently exceed the bound."""
        if not self.may_admit(trainer_version):
            raise RuntimeError(
                f"admission refused at trainer version {trainer_version}: {self.num_started} "
                f"groups started, limit {self.admission_limit(trainer_version)}, "
                f"{self.num_outstanding} outstanding ({self.settings.mode}, "
                f"max_off_policyness={self.settings.max_off_policyness}); ask may_admit first")
        self._num_admitted += 1

    def may_take(self, num_finished_groups: int) -> bool:
        """Whether the trainer may take finished groups from the buffer (which holds
        `num_finished_groups`) for its next step. Pipeline: as soon as one is there.
        ppo_off_policy: only once the whole round has been admitted and has finished."""
        if not 0 <= num_finished_groups <= self.num_outstanding:
            raise ValueError(f"num_finished_groups={num_finished_groups} is not in [0, "
                             f"{self.num_outstanding}] (the groups admitted and not yet taken)")
        if num_finished_groups == 0:
            return False
        if self.settings.mode == "pipeline":
            return True
        round_admitted = self.num_started % self.settings.round_size == 0
        return round_admitted and num_finished_groups == self.num_outstanding

    def is_fresh(self, oldest_version: int, trainer_version: int) -> bool:
        """Whether a group whose oldest token has `oldest_version` is within the bound."""
        return oldest_version >= trainer_version - self.settings.max_off_policyness

    def on_take(self, oldest_version: int, trainer_version: int, *, times_requeued: int = 0,
                retired: bool = False) -> TakeDecision:
        """Check and record one group taken by the trainer. `trainer_version` is the version of
        the weights the step it is taken for starts from (take for the next step only, not
        ahead: a group taken at v but trained at v + 1 would be checked one step too young).
        A stale group is re-queued under the requeue policy unless its prompt was regenerated
        `max_requeues` times already (`times_requeued`) or No-Positive-Resampling has retired
        it (`retired`): then it is dropped."""
        self._observe(trainer_version)
        _require_int("times_requeued", times_requeued, minimum=0)
        _require_int("oldest_version", oldest_version, minimum=0)
        if oldest_version > trainer_version:
            raise ValueError(
                f"a group's oldest token has version {oldest_version}, newer than the trainer's "
                f"{trainer_version}: the generators' version labels are wrong")
        if self.num_outstanding == 0:
            raise RuntimeError("on_take with no group outstanding: every taken group must have "
                               "been admitted through on_admit (a group taken twice?)")
        if self.is_fresh(oldest_version, trainer_version):
            self._num_trained += 1
            return TakeDecision.FRESH
        if self.settings.stale_policy == "requeue" and not retired \
                and times_requeued < self.settings.max_requeues:
            self._num_requeued += 1
            return TakeDecision.REQUEUE
        self._num_dropped += 1
        return TakeDecision.DROP

    def on_put_back(self, num_groups: int) -> None:
        """Undo `on_take` of `num_groups` fresh groups that went back to the buffer untrained
        (their take's caller stopped as it completed: RolloutManager.put_back); they are
        outstanding again. Refused for groups the trainer's version already counts on."""
        _require_int("num_groups", num_groups, minimum=0)
        spare = self._num_trained - self._trainer_version * self.settings.prompts_per_step
        if num_groups > spare:
            raise ValueError(f"cannot put back {num_groups} trained groups: trainer version "
                             f"{self._trainer_version} counts on all but {spare} of the "
                             f"{self._num_trained} trained")
        self._num_trained -= num_groups

    def on_abandon(self, num_groups: int = 1) -> None:
        """Record admitted groups that will never be taken (generator lost, or in flight at a
        checkpoint that did not keep them); their slots are given back. Re-admitting their
        prompts is the caller's choice."""
        _require_int("num_groups", num_groups, minimum=0)
        if num_groups > self.num_outstanding:
            raise ValueError(f"cannot abandon {num_groups} groups: only {self.num_outstanding} "
                             "are outstanding")
        self._num_abandoned += num_groups

    def to_scalars(self) -> dict[str, float]:
        """Cumulative counters, TensorBoard-ready."""
        return {f"{SCALAR_PREFIX}/{name}": float(value) for name, value in (
            ("admitted", self._num_admitted), ("trained", self._num_trained),
            ("requeued", self._num_requeued), ("dropped", self._num_dropped),
            ("abandoned", self._num_abandoned), ("outstanding", self.num_outstanding))}

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values for the checkpoint. Outstanding groups are saved as outstanding:
        a driver that does not restore them with its buffer calls `on_abandon` after loading."""
        return {
            "state_version": _STATE_VERSION,
            "prompts_per_step": self.settings.prompts_per_step,
            "num_admitted": self._num_admitted,
            "num_trained": self._num_trained,
            "num_requeued": self._num_requeued,
            "num_dropped": self._num_dropped,
            "num_abandoned": self._num_abandoned,
            "trainer_version": self._trainer_version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters. mode, k and the stale policy stay as constructed (configuration,
        may be changed on resume); prompts_per_step may not, since the bound relates the trainer
        version to the groups trained through it."""
        if state.get("state_version") != _STATE_VERSION:
            raise ValueError(f"admission-gate state version {state.get('state_version')!r} is not "
                             f"{_STATE_VERSION}; it was written by an incompatible release")
        if state["prompts_per_step"] != self.settings.prompts_per_step:
            raise ValueError(
                f"admission-gate state is for prompts_per_step={state['prompts_per_step']} but "
                f"this run has {self.settings.prompts_per_step}; the staleness bound cannot carry "
                "over a change of batch size")
        counters = {name: state[name] for name in ("num_admitted", "num_trained", "num_requeued",
                                                   "num_dropped", "num_abandoned",
                                                   "trainer_version")}
        for name, value in counters.items():
            _require_int(f"admission-gate state {name}", value, minimum=0)
        taken = sum(counters[name] for name in ("num_trained", "num_requeued", "num_dropped",
                                                "num_abandoned"))
        if taken > counters["num_admitted"]:
            raise ValueError(f"admission-gate state has {taken} groups taken or abandoned but only "
                             f"{counters['num_admitted']} admitted")
        self._num_admitted = counters["num_admitted"]
        self._num_trained = counters["num_trained"]
        self._num_requeued = counters["num_requeued"]
        self._num_dropped = counters["num_dropped"]
        self._num_abandoned = counters["num_abandoned"]
        self._trainer_version = counters["trainer_version"]

    def _observe(self, trainer_version: int) -> None:
        _require_int("trainer_version", trainer_version, minimum=0)
        if trainer_version < self._trainer_version:
            raise ValueError(f"trainer version went back from {self._trainer_version} to "
                             f"{trainer_version}; published versions only increase")
        needed = trainer_version * self.settings.prompts_per_step
        if needed > self._num_trained:
            raise ValueError(
                f"trainer version {trainer_version} means {needed} groups trained "
                f"({trainer_version} steps x prompts_per_step={self.settings.prompts_per_step}), "
                f"but the gate recorded {self._num_trained}: every step must take its groups "
                "through on_take, and a resumed run must load the gate's state")
        self._trainer_version = trainer_version


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StalenessHistogram:
    """How old one optimizer step's data is: counts[lag] entries (tokens, or groups) with
    version trainer_version - lag, for lag 0 .. k."""

    trainer_version: int
    counts: tuple[int, ...]  # [k + 1]

    @property
    def num_entries(self) -> int:
        return sum(self.counts)

    @property
    def mean_lag(self) -> float:
        return sum(lag * n for lag, n in enumerate(self.counts)) / self.num_entries

    @property
    def max_lag(self) -> int:
        return max(lag for lag, n in enumerate(self.counts) if n)

    def to_scalars(self) -> dict[str, float]:
        """`rollout/staleness/lag_<n>` for n = 0 .. k, plus mean_lag and max_lag."""
        scalars = {f"{SCALAR_PREFIX}/lag_{lag}": float(n) for lag, n in enumerate(self.counts)}
        scalars[f"{SCALAR_PREFIX}/mean_lag"] = self.mean_lag
        scalars[f"{SCALAR_PREFIX}/max_lag"] = float(self.max_lag)
        return scalars


def staleness_histogram(versions: Iterable[int], *, trainer_version: int,
                        max_off_policyness: int,
                        num_tokens: Iterable[int] | None = None) -> StalenessHistogram:
    """Lag histogram of a step's batch. `versions` are the sampled tokens' versions (inserted
    tokens such as the interruption phrase have none: leave them out), or one oldest version per
    group; `num_tokens`, if given, says how many tokens each entry stands for (the lengths of
    SGLang's version spans, so a 25M-token batch needs no per-token Python loop). A lag above
    k or below 0 is an error: the take-time check should have refused the group."""
    _require_int("trainer_version", trainer_version, minimum=0)
    _require_int("max_off_policyness", max_off_policyness, minimum=0)
    versions = list(versions)
    weights = [1] * len(versions) if num_tokens is None else list(num_tokens)
    if len(weights) != len(versions):
        raise ValueError(f"{len(versions)} versions but {len(weights)} num_tokens")
    per_lag: collections.Counter[int] = collections.Counter()
    for version, weight in zip(versions, weights):
        version, weight = int(version), int(weight)  # tolerate numpy / 0-d tensor scalars
        lag = trainer_version - version
        if version < 0 or not 0 <= lag <= max_off_policyness:
            raise ValueError(
                f"token version {version} at trainer version {trainer_version} has lag {lag}, "
                f"outside [0, max_off_policyness={max_off_policyness}] (versions must be >= 0: "
                "pass only sampled tokens)")
        if weight < 0:
            raise ValueError(f"num_tokens must be >= 0, got {weight}")
        per_lag[lag] += weight
    if sum(per_lag.values()) == 0:
        raise ValueError("no tokens: a step's batch cannot be empty")
    return StalenessHistogram(trainer_version=trainer_version,
                              counts=tuple(per_lag[lag] for lag in range(max_off_policyness + 1)))
