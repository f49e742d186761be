"""The Pipeline-RL staleness bound (megatron_rl/rollout/staleness.py): admission gate, take-time
check, PPO-off-policy-k rounds, checkpointed counters and the staleness histogram.

Hand-computed boundary cases first, then a deterministic discrete-event simulation: a fake engine
with N slots on a virtual clock, groups that take a seeded random number of ticks (one token per
tick, labelled with the weights version of that tick, so weights pushed in flight give a group
tokens of versions a..b), and a trainer that takes prompts_per_step groups per step, checks them
at take time, trains for a tick or two and publishes v + 1. The fakes exist for the scheduling
logic only; the real generators are tested against live SGLang servers in tests/integration.
"""
import collections
import dataclasses
import json
import random

import pytest

from megatron_rl.rollout.staleness import (AdmissionGate, StalenessSettings, TakeDecision,
                                           staleness_histogram)

pytestmark = pytest.mark.unit


def _gate(mode="pipeline", k=2, per_step=3, stale_policy="requeue"):
    return AdmissionGate(StalenessSettings(mode=mode, max_off_policyness=k,
                                           prompts_per_step=per_step, stale_policy=stale_policy))


def _admit_all(gate, trainer_version):
    admitted = 0
    while gate.may_admit(trainer_version):
        gate.on_admit(trainer_version)
        admitted += 1
    return admitted


# --------------------------------------------------------------------------- hand-computed cases

def test_pipeline_admits_k_plus_one_plus_v_steps_of_groups():
    gate = _gate(k=2, per_step=3)
    for num_admitted in range(9):  # (2 + 1 + 0) x 3: admitted counts 0..8 may admit at v = 0
        assert gate.may_admit(0), num_admitted
        gate.on_admit(0)
    assert not gate.may_admit(0)  # the 10th is refused
    with pytest.raises(RuntimeError, match="admission refused at trainer version 0"):
        gate.on_admit(0)
    assert gate.num_admitted == 9 and gate.num_outstanding == 9
    for _ in range(3):  # step 1's batch, then version 1 is published
        assert gate.on_take(0, 0) is TakeDecision.FRESH
    assert gate.admission_limit(1) == 12 and _admit_all(gate, 1) == 3


def test_synchronous_k0_admits_one_step_after_each_publish():
    gate = _gate(k=0, per_step=2)
    assert _admit_all(gate, 0) == 2
    gate.on_take(0, 0)
    assert not gate.may_admit(0)  # the step has not been published: nothing generates ahead
    gate.on_take(0, 0)
    assert _admit_all(gate, 1) == 2
    assert gate.is_fresh(1, 1) and not gate.is_fresh(0, 1)


def test_take_time_boundary_oldest_v_minus_k_is_fresh_one_older_is_stale():
    for stale_policy, stale in (("requeue", TakeDecision.REQUEUE), ("drop", TakeDecision.DROP)):
        gate = _gate(k=2, per_step=1, stale_policy=stale_policy)
        gate.on_admit(0), gate.on_admit(0), gate.on_admit(0)
        for version in range(3):  # three steps on data of version 0 (lag 0, 1, 2)
            assert gate.on_take(0, version) is TakeDecision.FRESH
        gate.on_admit(3), gate.on_admit(3)
        assert gate.on_take(3 - 2, 3) is TakeDecision.FRESH  # oldest = v - k
        assert gate.on_take(3 - 2 - 1, 4) is stale  # oldest = v - k - 1
        assert (gate.num_trained, gate.num_requeued, gate.num_dropped) == \
            ((4, 1, 0) if stale_policy == "requeue" else (4, 0, 1))


def test_a_stale_group_is_requeued_at_most_max_requeues_times_and_never_when_retired():
    """Re-queueing has a cap: a stale group whose prompt was regenerated max_requeues times
    already, or whose prompt No-Positive-Resampling retired, is dropped (counted as dropped)."""
    gate = AdmissionGate(StalenessSettings(max_off_policyness=0, prompts_per_step=1,
                                           max_requeues=2))
    gate.on_admit(0)
    assert gate.on_take(0, 0) is TakeDecision.FRESH
    decisions = []
    for times_requeued, retired in ((0, False), (1, False), (2, False), (0, True)):
        gate.on_admit(1)
        decisions.append(gate.on_take(0, 1, times_requeued=times_requeued, retired=retired))
    assert decisions == [TakeDecision.REQUEUE, TakeDecision.REQUEUE, TakeDecision.DROP,
                         TakeDecision.DROP]
    assert (gate.num_requeued, gate.num_dropped, gate.num_outstanding) == (2, 2, 0)
    with pytest.raises(ValueError, match="times_requeued must be an int >= 0"):
        gate.on_admit(1)
        gate.on_take(0, 1, times_requeued=-1)


def test_a_discarded_group_gives_its_admission_slot_back():
    gate = _gate(k=1, per_step=1, stale_policy="drop")
    assert _admit_all(gate, 0) == 2
    assert gate.on_take(0, 0) is TakeDecision.FRESH
    assert _admit_all(gate, 1) == 1
    assert gate.on_take(0, 1) is TakeDecision.FRESH
    # The third group started at version 1, but an engine still on version 0 produced its first
    # token; at version 2 it is one step too old.
    assert gate.on_take(0, 2) is TakeDecision.DROP
    assert gate.num_started == 2 and _admit_all(gate, 2) == 2  # limit (1 + 1 + 2) x 1 = 4
    gate.on_abandon(2)
    assert gate.num_outstanding == 0 and _admit_all(gate, 2) == 2


def test_ppo_off_policy_rounds_open_only_after_k_published_steps():
    gate = _gate(mode="ppo_off_policy", k=2, per_step=3)
    assert _admit_all(gate, 0) == 6  # one round: k x prompts_per_step
    assert not gate.may_take(5)  # the trainer waits for the whole round
    assert gate.may_take(6)
    for _ in range(3):
        gate.on_take(0, 0)
    assert not gate.may_admit(1)  # between the round's two steps: no generation
    for _ in range(3):
        gate.on_take(0, 1)  # lag 1 < k: fresh
    assert gate.num_outstanding == 0 and _admit_all(gate, 2) == 6
    assert not gate.may_take(0)


def test_may_take_in_pipeline_mode_as_soon_as_a_group_finished():
    gate = _gate(k=1, per_step=3)
    _admit_all(gate, 0)
    assert not gate.may_take(0) and gate.may_take(1)
    with pytest.raises(ValueError, match=r"num_finished_groups=7 is not in \[0, 6\]"):
        gate.may_take(7)


def test_misuse_is_an_error_naming_what_went_wrong():
    gate = _gate(k=1, per_step=2)
    with pytest.raises(RuntimeError, match="no group outstanding"):
        gate.on_take(0, 0)
    _admit_all(gate, 0)
    with pytest.raises(ValueError, match="newer than the trainer's 0"):
        gate.on_take(1, 0)
    with pytest.raises(ValueError, match="means 2 groups trained"):
        gate.may_admit(1)  # version 1 cannot exist before step 1's two groups were taken
    gate.on_take(0, 0), gate.on_take(0, 0)
    gate.may_admit(1)
    with pytest.raises(ValueError, match="went back from 1 to 0"):
        gate.may_admit(0)
    with pytest.raises(ValueError, match="trainer_version must be an int >= 0"):
        gate.may_admit(-1)
    with pytest.raises(ValueError, match="cannot abandon 5 groups"):
        gate.on_abandon(5)


@pytest.mark.parametrize("fields, message", [
    (dict(mode="ppo_off_policy", max_off_policyness=0), "max_off_policyness must be >= 1 with "
                                                       "mode='ppo_off_policy'"),
    (dict(mode="async"), r"mode must be one of \('pipeline', 'ppo_off_policy'\)"),
    (dict(stale_policy="skip"), r"stale_policy must be one of \('requeue', 'drop'\)"),
    (dict(max_off_policyness=-1), "max_off_policyness must be an int >= 0, got -1"),
    (dict(max_off_policyness=True), "max_off_policyness must be an int >= 0, got True"),
    (dict(prompts_per_step=0), "prompts_per_step must be an int >= 1, got 0"),
    (dict(max_requeues=-1), "max_requeues must be an int >= 0, got -1"),
])
def test_settings_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        StalenessSettings(**({"max_off_policyness": 1, "prompts_per_step": 2} | fields))


def test_settings_are_frozen_and_know_their_outstanding_bound():
    settings = StalenessSettings(max_off_policyness=4, prompts_per_step=3)
    assert (settings.mode, settings.stale_policy) == ("pipeline", "requeue")
    assert settings.max_outstanding_groups == 15
    assert dataclasses.replace(settings, mode="ppo_off_policy").max_outstanding_groups == 12
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_off_policyness = 2


def test_state_dict_round_trips_through_json_and_refuses_a_new_batch_size():
    gate = _gate(k=1, per_step=2, stale_policy="drop")
    _admit_all(gate, 0)
    gate.on_take(0, 0), gate.on_take(0, 0)
    _admit_all(gate, 1)
    gate.on_take(0, 1), gate.on_take(0, 1)
    gate.on_admit(2)
    gate.on_take(0, 2)  # dropped
    state = json.loads(json.dumps(gate.state_dict()))
    restored = _gate(k=1, per_step=2, stale_policy="drop")
    restored.load_state_dict(state)
    assert restored.state_dict() == gate.state_dict()
    assert restored.to_scalars() == gate.to_scalars() == {
        "rollout/staleness/admitted": 7.0, "rollout/staleness/trained": 4.0,
        "rollout/staleness/requeued": 0.0, "rollout/staleness/dropped": 1.0,
        "rollout/staleness/abandoned": 0.0, "rollout/staleness/outstanding": 2.0}
    with pytest.raises(ValueError, match="went back from 2 to 1"):
        restored.may_admit(1)
    with pytest.raises(ValueError, match="prompts_per_step=2 but this run has 3"):
        _gate(k=1, per_step=3).load_state_dict(state)
    with pytest.raises(ValueError, match="state version 0 is not 1"):
        restored.load_state_dict(state | {"state_version": 0})
    with pytest.raises(ValueError, match="5 groups taken or abandoned but only 3 admitted"):
        restored.load_state_dict(state | {"num_admitted": 3})


def test_histogram_hand_values():
    histogram = staleness_histogram([5, 5, 4, 3, 5], trainer_version=5, max_off_policyness=2)
    assert histogram.counts == (3, 1, 1)
    assert histogram.mean_lag == pytest.approx(0.6) and histogram.max_lag == 2
    assert histogram.to_scalars() == {
        "rollout/staleness/lag_0": 3.0, "rollout/staleness/lag_1": 1.0,
        "rollout/staleness/lag_2": 1.0, "rollout/staleness/mean_lag": pytest.approx(0.6),
        "rollout/staleness/max_lag": 2.0}
    # Version spans (SGLang's weight_versions): 10 tokens of v 7, 30 of v 8, k = 4 bins.
    spans = staleness_histogram([7, 8], trainer_version=8, max_off_policyness=4,
                                num_tokens=[10, 30])
    assert spans.counts == (30, 10, 0, 0, 0) and spans.mean_lag == pytest.approx(0.25)


@pytest.mark.parametrize("versions, message", [
    ([4], "lag -1"),  # newer than the trainer
    ([0], "lag 3, outside"),  # older than v - k: the take check should have refused it
    ([-1], "pass only sampled tokens"),  # an inserted token's placeholder version
    ([], "no tokens"),
])
def test_histogram_refuses_impossible_lags(versions, message):
    with pytest.raises(ValueError, match=message):
        staleness_histogram(versions, trainer_version=3, max_off_policyness=2)


# ------------------------------------------------------------------------------------ simulation

@dataclasses.dataclass(kw_only=True)
class FakeGroup:
    group_id: int
    prompt_id: int
    round_index: int  # ppo_off_policy: which k x prompts_per_step round admitted it
    ticks_left: int
    token_versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def oldest_version(self) -> int:
        return min(self.token_versions)


class FakeEngine:
    """N slots; each running group emits one token per tick, labelled with the engine's weights
    version at that tick. New weights apply in flight: running groups just carry on."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.version = 0
        self.running: dict[int, FakeGroup] = {}

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - len(self.running)

    def start(self, group: FakeGroup) -> None:
        assert self.num_free_slots > 0
        self.running[group.group_id] = group

    def tick(self) -> list[FakeGroup]:
        finished = []
        for group in list(self.running.values()):
            group.token_versions.append(self.version)
            group.ticks_left -= 1
            if group.ticks_left == 0:
                finished.append(self.running.pop(group.group_id))
        return finished


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainedStep:
    trainer_version: int  # the weights the step started from; it publishes trainer_version + 1
    groups: tuple[FakeGroup, ...]


class Simulation:
    """The rollout manager's scheduling with fakes: admit while the gate allows and a slot is
    free, take for the next step at take time, train, publish. Checks the outstanding bound on
    every tick. `restart_after_step` simulates a resume: the gate goes through its JSON state
    and everything in flight or buffered is lost (abandoned, prompts re-queued)."""

    def __init__(self, settings: StalenessSettings, *, num_slots: int, seed: int,
                 restart_after_step: int | None = None) -> None:
        self.settings = settings
        self.gate = AdmissionGate(settings)
        self.engine = FakeEngine(num_slots)
        self.rng = random.Random(seed)
        self.restart_after_step = restart_after_step
        self.version = 0
        self.buffer: collections.deque[FakeGroup] = collections.deque()
        self.batch: list[FakeGroup] = []
        self.train_done_tick: int | None = None
        self.steps: list[TrainedStep] = []
        self.prompts_to_regenerate: collections.deque[int] = collections.deque()
        self.num_prompts_issued = 0
        self.admitted: list[FakeGroup] = []
        self.outcome: dict[int, str] = {}  # group id -> trained | requeue | drop | abandoned
        # Groups admitted beyond what the published steps consumed: outstanding plus the batch
        # of the step in progress; the gate keeps it <= (k + 1) x prompts_per_step.
        self.max_ahead_by_step: collections.Counter[int] = collections.Counter()
        self.num_ticks_gate_refused_a_free_slot = 0

    def _duration(self) -> int:
        # Mostly short generations with a long tail: the long ones are overtaken and go stale.
        return self.rng.randint(12, 40) if self.rng.random() < 0.15 else self.rng.randint(1, 4)

    def _next_prompt(self) -> int:
        if self.prompts_to_regenerate:
            return self.prompts_to_regenerate.popleft()
        self.num_prompts_issued += 1
        return self.num_prompts_issued - 1

    def run(self, num_steps: int, max_ticks: int = 20_000) -> None:
        for tick in range(max_ticks):
            if tick == self.train_done_tick:
                self._publish()
                if len(self.steps) == num_steps:
                    return
                if len(self.steps) == self.restart_after_step:
                    self._restart()
            for group in self.engine.tick():
                self.buffer.append(group)
            if self.train_done_tick is None or self.train_done_tick <= tick:
                self._fill_batch(tick)
            self._admit()
            self._check_bound()
        raise AssertionError(f"no progress: {len(self.steps)} of {num_steps} steps in "
                             f"{max_ticks} ticks (the gate or the trainer is stuck)")

    def _publish(self) -> None:
        self.steps.append(TrainedStep(trainer_version=self.version, groups=tuple(self.batch)))
        self.batch = []
        self.version += 1
        self.engine.version = self.version  # weights pushed in flight

    def _fill_batch(self, tick: int) -> None:
        while (len(self.batch) < self.settings.prompts_per_step
               and self.gate.may_take(len(self.buffer))):
            group = self.buffer.popleft()
            decision = self.gate.on_take(group.oldest_version, self.version)
            self.outcome[group.group_id] = "trained" if decision is TakeDecision.FRESH \
                else str(decision)
            if decision is TakeDecision.FRESH:
                self.batch.append(group)
            elif decision is TakeDecision.REQUEUE:
                self.prompts_to_regenerate.appendleft(group.prompt_id)
        if len(self.batch) == self.settings.prompts_per_step:
            self.train_done_tick = tick + self.rng.randint(1, 2)

    def _admit(self) -> None:
        while self.engine.num_free_slots > 0 and self.gate.may_admit(self.version):
            # Counted here, not asked of the gate: groups that still count (trained or live).
            num_live = sum(o == "trained" for o in self.outcome.values()) + \
                len(self.outstanding_groups())
            round_index = num_live // max(self.settings.round_size, 1)
            if self.settings.mode == "ppo_off_policy":
                # Rounds alternate with training: nothing of an older round is still outstanding.
                assert all(g.round_index == round_index for g in self.outstanding_groups())
            self.gate.on_admit(self.version)
            group = FakeGroup(group_id=len(self.admitted), prompt_id=self._next_prompt(),
                              round_index=round_index, ticks_left=self._duration())
            self.admitted.append(group)
            self.engine.start(group)
        if self.engine.num_free_slots > 0:
            self.num_ticks_gate_refused_a_free_slot += 1

    def _restart(self) -> None:
        saved_state = json.loads(json.dumps(self.gate.state_dict()))
        lost = self.outstanding_groups()
        self.gate = AdmissionGate(self.settings)
        self.gate.load_state_dict(saved_state)
        self.gate.on_abandon(len(lost))
        for group in lost:
            self.outcome[group.group_id] = "abandoned"
            self.prompts_to_regenerate.appendleft(group.prompt_id)
        self.engine.running.clear()
        self.buffer.clear()

    def outstanding_groups(self) -> list[FakeGroup]:
        return list(self.engine.running.values()) + list(self.buffer)

    def _check_bound(self) -> None:
        num_outstanding = len(self.outstanding_groups())
        assert num_outstanding == self.gate.num_outstanding
        num_ahead = num_outstanding + len(self.batch)
        assert num_ahead <= self.settings.max_outstanding_groups
        assert len(self.engine.running) <= self.engine.num_slots
        step = len(self.steps)
        self.max_ahead_by_step[step] = max(self.max_ahead_by_step[step], num_ahead)


def _check_conservation(sim: Simulation) -> None:
    """Counts in == counts out: every admitted group is trained, re-queued, dropped, abandoned
    or still outstanding, exactly once; every prompt is trained at most once."""
    gate, outstanding = sim.gate, {g.group_id for g in sim.outstanding_groups()}
    by_outcome = collections.Counter(sim.outcome.values())
    assert len(sim.admitted) == gate.num_admitted == len(sim.outcome) + len(outstanding)
    assert not outstanding & set(sim.outcome)
    assert (by_outcome["trained"], by_outcome["requeue"], by_outcome["drop"],
            by_outcome["abandoned"]) == (gate.num_trained, gate.num_requeued, gate.num_dropped,
                                         gate.num_abandoned)
    trained_ids = [g.group_id for step in sim.steps for g in step.groups]
    assert len(trained_ids) == len(set(trained_ids))
    assert set(trained_ids) == {gid for gid, outcome in sim.outcome.items()
                                if outcome == "trained"} - {g.group_id for g in sim.batch}
    trained_prompts = [g.prompt_id for step in sim.steps for g in step.groups] + \
        [g.prompt_id for g in sim.batch]
    dropped_prompts = [sim.admitted[gid].prompt_id for gid, o in sim.outcome.items()
                       if o == "drop"]
    pending_prompts = [g.prompt_id for g in sim.outstanding_groups()] + \
        list(sim.prompts_to_regenerate)
    every_prompt = trained_prompts + dropped_prompts + pending_prompts
    assert sorted(every_prompt) == list(range(sim.num_prompts_issued))  # none lost, none twice


@pytest.mark.parametrize("stale_policy", ["requeue", "drop"])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_pipeline_bound_holds_at_every_step(k, stale_policy):
    settings = StalenessSettings(max_off_policyness=k, prompts_per_step=4,
                                 stale_policy=stale_policy)
    sim = Simulation(settings, num_slots=24, seed=1000 + k)
    sim.run(num_steps=80)
    for step in sim.steps:
        v = step.trainer_version
        assert len(step.groups) == settings.prompts_per_step
        for group in step.groups:
            assert v - k <= group.oldest_version and max(group.token_versions) <= v
            if k == 0:
                assert set(group.token_versions) == {v}
        tokens = [version for group in step.groups for version in group.token_versions]
        histogram = staleness_histogram(tokens, trainer_version=v, max_off_policyness=k)
        assert histogram.num_entries == len(tokens) and len(histogram.counts) == k + 1
    _check_conservation(sim)
    # The gate, not the engine, limits what is in flight (24 slots > (k + 1) x 4), and it still
    # fills the pipeline late in the run: discarded groups gave their slots back.
    late_steps = range(60, 80)
    assert max(sim.max_ahead_by_step[s] for s in late_steps) == settings.max_outstanding_groups
    assert sim.num_ticks_gate_refused_a_free_slot > 0
    num_stale = sim.gate.num_requeued + sim.gate.num_dropped
    if k == 0:
        assert num_stale == 0
    else:  # the take-time path is exercised, with the chosen policy only
        assert num_stale > 0
        assert (sim.gate.num_requeued, sim.gate.num_dropped) == \
            ((num_stale, 0) if stale_policy == "requeue" else (0, num_stale))
    lags = [step.trainer_version - g.oldest_version for step in sim.steps for g in step.groups]
    assert max(lags) == k  # the bound is reached, not just respected


@pytest.mark.parametrize("k", [1, 4])
def test_ppo_off_policy_takes_k_steps_per_single_version_round(k):
    settings = StalenessSettings(mode="ppo_off_policy", max_off_policyness=k, prompts_per_step=4)
    sim = Simulation(settings, num_slots=6, seed=7 + k)  # fewer slots than a round
    sim.run(num_steps=6 * k)
    for step_index, step in enumerate(sim.steps):
        round_index, step_in_round = divmod(step_index, k)
        assert step.trainer_version == step_index
        for group in step.groups:
            assert group.round_index == round_index  # exactly k steps per generated round
            assert set(group.token_versions) == {round_index * k}  # one policy per round
    rounds = collections.Counter(g.round_index for step in sim.steps for g in step.groups)
    assert set(rounds.values()) == {settings.round_size}
    assert sim.gate.num_requeued == sim.gate.num_dropped == 0
    _check_conservation(sim)


@pytest.mark.parametrize("mode, k", [("pipeline", 2), ("ppo_off_policy", 3)])
def test_resume_from_the_gate_state_keeps_the_bound_and_the_counts(mode, k):
    settings = StalenessSettings(mode=mode, max_off_policyness=k, prompts_per_step=3,
                                 stale_policy="drop")
    sim = Simulation(settings, num_slots=8, seed=5, restart_after_step=10)
    sim.run(num_steps=30)
    assert sim.gate.num_abandoned > 0
    for step in sim.steps:
        assert all(step.trainer_version - g.oldest_version <= k for g in step.groups)
    _check_conservation(sim)


def test_settings_from_the_run_config():
    from megatron_rl.config import load_config

    run = load_config(None, ["rollout.mode=ppo_off_policy", "rollout.max_off_policyness=4",
                             "rollout.stale_group_policy=drop", "train.global_batch_size=64",
                             "rollout.samples_per_prompt=16", "rollout.max_requeues=5"])
    settings = StalenessSettings.from_run_config(run)
    assert (settings.mode, settings.max_off_policyness, settings.prompts_per_step,
            settings.stale_policy, settings.max_requeues) == ("ppo_off_policy", 4, 4, "drop", 5)
