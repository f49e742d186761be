"""The rollout manager's scheduling logic without a server: generator failures (taken out of the
rotation, groups regenerated once under their ids), checkpoint state, sampling seeds. The
live-server behaviour is in tests/integration/test_rollout_live.py and the chaos tests."""
import asyncio

import pytest

from megatron_rl.algorithms import NoPositiveResamplingSampler
from megatron_rl.data.records import PromptRecord
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.async_client import AsyncSGLangClient
from megatron_rl.rollout.interruption import InterruptionSettings
from megatron_rl.rollout.manager import RolloutError, RolloutManager
from megatron_rl.rollout.sglang_server import free_port
from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings

pytestmark = pytest.mark.unit


def _manager(client, record, *, params, prompts_per_step, score, clients=None, num_prompts=1,
             max_off_policyness=0):
    """A manager over `num_prompts` prompts (tokens [5, 6]) and one client (or `clients`), no
    forced interruption."""
    return RolloutManager(
        clients=clients or [client], prompt_token_ids=[[5, 6]] * num_prompts,
        records=[record] * num_prompts,
        sampler=NoPositiveResamplingSampler(num_prompts, seed=0, enabled=False),
        gate=AdmissionGate(StalenessSettings(max_off_policyness=max_off_policyness,
                                             prompts_per_step=prompts_per_step)),
        params=params,
        interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                          thinking_budget=4, solution_budget=4),
        score=score, decode=str, max_finished_groups=2 * prompts_per_step)


def _wrong(texts, records):
    from megatron_rl.rewards.types import Reason, RewardResult

    return [RewardResult(reward=0.0, reason=Reason.WRONG, pass_fraction=0.0)] * len(texts)


class ScriptedClient:
    """A stand-in generator for scheduling logic only (the live server is in
    tests/integration/test_rollout_live.py): answers one token and records the seeds it was
    asked for; `hang` makes every request wait until cancelled."""

    def __init__(self, *, hang=False):
        self.seeds = []
        self.hang = hang
        self.cancelled = 0
        self.version = 0  # the policy version its answers are labelled with

    async def generate_one(self, input_ids, max_new_tokens, params, *, extra_key=None):
        from megatron_rl.rollout import GenerationResult

        self.seeds.append(params.seed)
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return GenerationResult(prompt_index=0, sample_index=0,
                                prompt_token_ids=tuple(input_ids), token_ids=(9,),
                                logprobs=(-0.1,), versions=(self.version,),
                                finish_reason="stop")


RECORD = PromptRecord(prompt_id="p0", task="rg/x", prompt="1 + 1 =", answer="2")


def test_a_dead_generator_is_taken_out_and_its_group_regenerated_once_elsewhere():
    """Generator 0 is a real client of a port nothing listens on: its group fails, the manager
    takes it out of the rotation, reports it by URL, and generates the group again, under the
    same group id and seeds, on generator 1 (a scripted stand-in); nothing is lost or doubled."""
    from megatron_rl.rollout.types import derive_seed

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    params = SamplingParams(max_new_tokens=1, num_samples=2, seed=7)

    async def run():
        good = ScriptedClient()
        async with AsyncSGLangClient(url, request_timeout_s=30, connection_retries=0) as dead:
            manager = _manager(None, RECORD, params=params, prompts_per_step=2, score=_wrong,
                               clients=[dead, good], num_prompts=4)
            manager.start()
            try:
                groups = await asyncio.wait_for(manager.take(2), timeout=60)
            finally:
                await manager.stop()
        return manager, groups, good

    manager, groups, good = asyncio.run(run())
    assert [g.group_id for g in groups] == [0, 1]
    failures = manager.take_failures()
    assert len(failures) == 1 and failures[0].index == 0 and url in failures[0].reason
    assert failures[0].requeued_groups == 0  # the failing group itself re-queued, no other
    assert manager.down == {0}
    # Group 0 ran on generator 1 with its own seeds: the same samples a healthy run draws.
    assert sorted(good.seeds) == sorted(derive_seed(7, "train", g, k)
                                        for g in range(2) for k in range(2))
    assert manager.gate.num_admitted == 2 and manager.gate.num_trained == 2


def test_mark_down_cancels_a_hung_generators_groups_and_requeues_each_once():
    """A hung generator (requests never answer) is taken out by the driver's health check
    (`mark_down`): its groups in flight are cancelled and regenerated on the others, once each;
    `mark_up` puts a restarted one back."""
    async def run():
        hung, good = ScriptedClient(hang=True), ScriptedClient()
        manager = _manager(None, RECORD, params=SamplingParams(max_new_tokens=1, num_samples=2),
                           prompts_per_step=2, score=_wrong, clients=[hung, good],
                           num_prompts=4)
        manager.start()
        try:
            while not hung.seeds:
                await asyncio.sleep(0.01)
            assert manager.num_in_flight >= 1
            manager.mark_down(0, "no health answer within 30 s")
            manager.mark_down(0, "again")  # already down: no second report, no re-queue
            groups = await asyncio.wait_for(manager.take(2), timeout=60)
            replacement = ScriptedClient()
            replacement.version = good.version = 1
            manager.mark_up(0, replacement)
            manager.publish_version(1)
            more = await asyncio.wait_for(manager.take(2), timeout=60)
        finally:
            await manager.stop()
        return manager, groups, more, hung, replacement

    manager, groups, more, hung, replacement = asyncio.run(run())
    assert hung.cancelled == 2  # group 0's two samples
    failures = manager.take_failures()
    assert [(f.index, f.requeued_groups) for f in failures] == [(0, 1)]
    ids = [g.group_id for g in groups + more]
    assert ids == [0, 1, 2, 3]  # each once, in order
    assert replacement.seeds  # back in the rotation: group 2 went to generator 0 again
    assert manager.down == frozenset()


def test_state_dict_restores_buffer_and_regenerates_groups_in_flight_under_their_ids():
    """A checkpoint taken while groups are buffered and in flight: a new manager loaded from it
    trains the buffered groups as they were and regenerates the in-flight ones under the same
    group ids (same seeds), then continues with new ids; the sampler and gate carry over."""
    import pickle

    from megatron_rl.rollout.types import derive_seed

    params = SamplingParams(max_new_tokens=1, num_samples=2, seed=3)

    async def first_run():
        hung = ScriptedClient(hang=True)
        good = ScriptedClient()
        manager = _manager(None, RECORD, params=params, prompts_per_step=2, score=_wrong,
                           clients=[good, hung], num_prompts=8, max_off_policyness=1)
        manager.start()
        try:
            while manager.num_finished < 2 or not hung.seeds:
                await asyncio.sleep(0.01)
            state = pickle.loads(pickle.dumps(manager.state_dict()))
        finally:
            await manager.stop()
        return state

    state = asyncio.run(first_run())
    # Groups 0, 2 (generator 0) finished; 1, 3 (hung generator 1) in flight.
    assert sorted(g.group_id for g in state["finished"]) == [0, 2]
    assert [t.group_id for t in state["tickets"]] == [1, 3]

    async def resumed():
        clients = [ScriptedClient(), ScriptedClient()]
        manager = _manager(None, RECORD, params=params, prompts_per_step=2, score=_wrong,
                           clients=clients, num_prompts=8, max_off_policyness=1)
        manager.load_state_dict(state)
        manager.start()
        try:
            step1 = await asyncio.wait_for(manager.take(2), timeout=60)
            manager.publish_version(1)
            step2 = await asyncio.wait_for(manager.take(2), timeout=60)
        finally:
            await manager.stop()
        return manager, step1, step2, clients[0].seeds + clients[1].seeds

    manager, step1, step2, seeds = asyncio.run(resumed())
    assert [g.group_id for g in step1] == [0, 2]  # the buffered groups, as saved
    assert [g.group_id for g in step2] == [1, 3]  # regenerated under their own ids
    assert {derive_seed(3, "train", g, k) for g in (1, 3) for k in range(2)} <= set(seeds)
    assert manager.next_group_id >= 4 and manager.gate.num_trained == 4


def test_run_anywhere_moves_a_request_off_a_dead_or_hung_generator_and_waits_when_all_are_down():
    """Validation's requests (run_anywhere): one to a generator that answers dead is sent again
    to another, which is taken out of the rotation and reported; one on a hung generator is
    cancelled by the driver's mark_down and sent again; with every generator down a request
    waits for mark_up. Scripted stand-in clients (scheduling logic only)."""
    from megatron_rl.rollout.types import GeneratorDeadError

    class DeadClient(ScriptedClient):
        async def generate_one(self, *args, **kwargs):
            raise GeneratorDeadError("connection refused")

    async def request(client):
        result = await client.generate_one((5, 6), 1, SamplingParams(max_new_tokens=1, seed=1))
        return client, result.token_ids

    async def run():
        dead, good, hung = DeadClient(), ScriptedClient(), ScriptedClient(hang=True)
        manager = _manager(None, RECORD, params=SamplingParams(max_new_tokens=1),
                           prompts_per_step=1, score=_wrong, clients=[dead, good, hung])
        answered = await asyncio.wait_for(manager.run_anywhere(0, request), timeout=60)
        assert answered == (good, (9,)) and manager.down == {0}  # preferred 0: dead
        on_hung = asyncio.ensure_future(manager.run_anywhere(2, request))
        while not hung.seeds:
            await asyncio.sleep(0.01)
        manager.mark_down(2, "no health answer")
        assert await asyncio.wait_for(on_hung, timeout=60) == (good, (9,))
        assert hung.cancelled == 1
        manager.mark_down(1, "killed")
        waiting = asyncio.ensure_future(manager.run_anywhere(4, request))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # nothing up: it waits
        replacement = ScriptedClient()
        manager.mark_up(2, replacement)
        assert await asyncio.wait_for(waiting, timeout=60) == (replacement, (9,))
        return manager.take_failures()

    failures = asyncio.run(run())
    assert [(f.index, f.requeued_groups) for f in failures] == [(0, 0), (2, 0), (1, 0)]
    assert "connection refused" in failures[0].reason


def test_a_group_is_never_both_buffered_and_in_flight():
    """A finished group leaves the groups in flight in the same step as it enters the buffer:
    a state_dict (or mark_down) taken right after it finished, before its task's done-callback
    has run, must not hold it twice (it would be trained and regenerated on resume). The state
    is taken at every notification, which is where that moment falls."""
    snapshots = []

    async def run():
        manager = _manager(None, RECORD, params=SamplingParams(max_new_tokens=1, num_samples=2),
                           prompts_per_step=2, score=_wrong, clients=[ScriptedClient()],
                           num_prompts=4, max_off_policyness=1)
        notify = manager._notify

        def notify_and_snapshot():
            state = manager.state_dict()
            snapshots.append(([g.group_id for g in state["finished"]],
                              [t.group_id for t in state["tickets"]]))
            notify()

        manager._notify = notify_and_snapshot
        manager.start()
        try:
            groups = await asyncio.wait_for(manager.take(2), timeout=60)
        finally:
            await manager.stop()
        return groups

    assert [g.group_id for g in asyncio.run(run())] == [0, 1]
    finished_moments = [s for s in snapshots if s[0]]
    assert finished_moments  # the check below saw groups finish
    for finished, tickets in snapshots:
        assert not set(finished) & set(tickets), (finished, tickets)


def test_every_sample_of_a_group_gets_its_own_sampling_seed():
    """SGLang samples a seeded request with noise drawn from (seed, position, token) alone, so
    G requests of one prompt under one seed return the same completion (a group with no
    exploration, and a mean@k that is mean@1). The manager gives each sample its own seed,
    derived from the run's seed, the group and the sample, so a rerun draws the same ones. The
    client is a scripted stand-in that records the seeds (scheduling logic only; the live
    server is in tests/integration/test_rollout_live.py)."""
    from megatron_rl.rewards.types import Reason, RewardResult
    from megatron_rl.rollout import GenerationResult
    from megatron_rl.rollout.types import derive_seed

    record = PromptRecord(prompt_id="p0", task="rg/x", prompt="1 + 1 =", answer="2")

    class RecordingClient:
        def __init__(self):
            self.seeds = []

        async def generate_one(self, input_ids, max_new_tokens, params, *, extra_key=None):
            self.seeds.append(params.seed)
            return GenerationResult(prompt_index=0, sample_index=0,
                                    prompt_token_ids=tuple(input_ids), token_ids=(9,),
                                    logprobs=(-0.1,), versions=(0,), finish_reason="stop")

    async def run(seed):
        client = RecordingClient()
        manager = _manager(
            client, record, params=SamplingParams(max_new_tokens=1, num_samples=4, seed=seed),
            prompts_per_step=2, score=lambda texts, records: [
                RewardResult(reward=0.0, reason=Reason.WRONG, pass_fraction=0.0)] * len(texts))
        manager.start()
        try:
            await asyncio.wait_for(manager.take(2), timeout=60)
        finally:
            await manager.stop()
        return client.seeds

    seeds = asyncio.run(run(1234))
    assert len(seeds) == 8 and len(set(seeds)) == 8  # 2 groups x 4 samples, all different
    assert sorted(seeds) == sorted(derive_seed(1234, "train", g, k)
                                   for g in range(2) for k in range(4))
    assert asyncio.run(run(1234)) == seeds  # reproducible
    assert set(asyncio.run(run(99))).isdisjoint(seeds)
    unseeded = SamplingParams(max_new_tokens=1)
    assert unseeded.for_sample("train", 0, 1) is unseeded  # SGLang's own stream: already differs


def _passed(texts, records):
    from megatron_rl.rewards.types import Reason, RewardResult

    return [RewardResult(reward=1.0, reason=Reason.CORRECT, pass_fraction=1.0)] * len(texts)


def test_all_prompts_retired_stops_take_with_the_cause_instead_of_waiting_forever():
    """Issue 29: 2 prompts and a scorer that passes everything: step 1 trains both, and
    No-Positive-Resampling retires both; the admission task then has nothing to draw. Its
    failure must reach take() (and raise_if_failed, the driver's check) naming the cause and
    the fix, not leave take() waiting forever."""
    async def run():
        manager = RolloutManager(
            clients=[ScriptedClient()], prompt_token_ids=[[5, 6]] * 2, records=[RECORD] * 2,
            sampler=NoPositiveResamplingSampler(2, seed=0),
            gate=AdmissionGate(StalenessSettings(max_off_policyness=0, prompts_per_step=2)),
            params=SamplingParams(max_new_tokens=1, num_samples=2),
            interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                              thinking_budget=4, solution_budget=4),
            score=_passed, decode=str, max_finished_groups=4)
        manager.start()
        try:
            first = await asyncio.wait_for(manager.take(2), timeout=30)
            manager.publish_version(1)
            with pytest.raises(RolloutError) as raised:
                await asyncio.wait_for(manager.take(2), timeout=10)
            with pytest.raises(RolloutError):
                manager.raise_if_failed()
        finally:
            await manager.stop()
        return first, str(raised.value)

    first, message = asyncio.run(run())
    assert sorted(g.prompt_index for g in first) == [0, 1]
    assert "all 2 prompts are retired" in message and "algorithm.npr_threshold" in message


def test_an_admission_gate_error_reaches_take():
    """The gate refuses a version its counts cannot explain (a driver bug: version 3 published
    with no group trained); that ValueError is raised in the admission task, and must stop
    take() with its message, not hang it."""
    async def run():
        manager = _manager(None, RECORD, params=SamplingParams(max_new_tokens=1, num_samples=2),
                           prompts_per_step=2, score=_wrong, clients=[ScriptedClient()],
                           num_prompts=4)
        manager.start()
        try:
            manager.publish_version(3)
            with pytest.raises(RolloutError, match="trainer version 3 means 6 groups trained"):
                await asyncio.wait_for(manager.take(2), timeout=10)
        finally:
            await manager.stop()

    asyncio.run(run())


def test_no_task_exception_is_left_unretrieved_when_groups_fail_together():
    """Two groups on one dying generator: the first one's failure takes the generator out
    (mark_down), which cancels the second; the second's request fails as it is cancelled (its
    connection breaks as the engine goes down), so that group ends with GeneratorDeadError
    after it left the manager's books. That exception must be consumed, not logged at garbage
    collection as "Task exception was never retrieved" (issue 31 item 7)."""
    import gc

    from megatron_rl.rollout.types import GeneratorDeadError

    class DyingClient(ScriptedClient):
        async def generate_one(self, input_ids, max_new_tokens, params, *, extra_key=None):
            self.seeds.append(params.seed)
            if len(self.seeds) == 1:  # group 0's first request
                raise GeneratorDeadError("connection refused")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise GeneratorDeadError("connection reset while cancelled") from None

    unretrieved = []

    async def run():
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: unretrieved.append(context))
        manager = _manager(None, RECORD, params=SamplingParams(max_new_tokens=1, num_samples=2),
                           prompts_per_step=2, score=_wrong,
                           clients=[DyingClient(), ScriptedClient()], num_prompts=4,
                           max_off_policyness=1)  # 4 groups: 0 and 2 on the dying one
        manager.start()
        try:
            groups = await asyncio.wait_for(manager.take(4), timeout=30)
        finally:
            await manager.stop()
        failures = manager.take_failures()
        del manager
        gc.collect()
        await asyncio.sleep(0)
        return groups, failures

    groups, failures = asyncio.run(run())
    assert [g.group_id for g in groups] == [0, 1, 2, 3]
    assert [(f.index, f.requeued_groups) for f in failures] == [(0, 1)]
    assert not unretrieved, [c.get("message") for c in unretrieved]


def test_a_stale_prompt_is_regenerated_at_most_max_requeues_times():
    """A generator whose tokens always come out older than the bound (it lags: labels version
    0 while the trainer is at 1, k = 0) makes every group stale. Each stale prompt is re-queued
    `max_requeues` (2) times, then dropped; re-queueing has a cap."""
    async def run():
        lagging = ScriptedClient()  # labels every token version 0
        manager = RolloutManager(
            clients=[lagging], prompt_token_ids=[[5, 6]] * 3, records=[RECORD] * 3,
            sampler=NoPositiveResamplingSampler(3, seed=0, enabled=False),
            gate=AdmissionGate(StalenessSettings(max_off_policyness=0, prompts_per_step=1,
                                                 max_requeues=2)),
            params=SamplingParams(max_new_tokens=1, num_samples=2),
            interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                              thinking_budget=4, solution_budget=4),
            score=_wrong, decode=str, max_finished_groups=1)
        manager.start()
        try:
            await asyncio.wait_for(manager.take(1), timeout=30)  # version 0: fresh
            manager.publish_version(1)
            taking = asyncio.ensure_future(manager.take(1))  # never fresh: keeps discarding
            for _ in range(500):
                if manager.gate.num_dropped >= 2:
                    break
                await asyncio.sleep(0.01)
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)
        finally:
            await manager.stop()
        return manager.take_discarded(), manager.gate

    discarded, gate = asyncio.run(run())
    decisions = [(prompt, decision) for _, prompt, decision in discarded]
    first, second = decisions[0][0], decisions[3][0]
    assert decisions[:6] == [(first, "requeue"), (first, "requeue"), (first, "drop"),
                             (second, "requeue"), (second, "requeue"), (second, "drop")]
    assert gate.num_dropped >= 2 and gate.num_outstanding <= 1


def test_a_requeued_prompt_retired_meanwhile_is_not_regenerated():
    """A stale prompt waits for re-admission; meanwhile No-Positive-Resampling retired it
    (another group of it passed). Resumed from that state, the manager draws the next prompt
    from the sampler instead of regenerating the retired one; and the gate drops, rather than
    re-queues, a stale group whose prompt is retired."""
    async def first_run():
        manager = _manager(None, RECORD, params=SamplingParams(max_new_tokens=1, num_samples=2),
                           prompts_per_step=1, score=_wrong, clients=[ScriptedClient()],
                           num_prompts=3)
        return manager.state_dict()

    state = asyncio.run(first_run())
    state["requeued"] = [(0, 1)]
    state["sampler"]["retired"] = [0]

    async def resumed():
        manager = _manager(None, RECORD, params=SamplingParams(max_new_tokens=1, num_samples=2),
                           prompts_per_step=1, score=_wrong, clients=[ScriptedClient()],
                           num_prompts=3)
        manager.load_state_dict(state)
        manager.start()
        try:
            return await asyncio.wait_for(manager.take(1), timeout=30)
        finally:
            await manager.stop()

    [group] = asyncio.run(resumed())
    assert group.prompt_index != 0
    gate = AdmissionGate(StalenessSettings(max_off_policyness=0, prompts_per_step=1))
    gate.on_admit(0)
    assert gate.on_take(0, 0) == "fresh"
    gate.on_admit(1)
    assert gate.on_take(0, 1, retired=True) == "drop" and gate.num_requeued == 0


def test_requests_after_a_restore_use_a_new_prefix_cache_key():
    """After a trainer restore the versions are redone with other weights: version n's KV
    cached before the restore must not serve them. Every load_state_dict begins a new
    incarnation of the prefix-cache key (`prefix_cache_key`, which validation uses too)."""
    class KeyRecordingClient(ScriptedClient):
        def __init__(self):
            super().__init__()
            self.keys = []

        async def generate_one(self, input_ids, max_new_tokens, params, *, extra_key=None):
            self.keys.append(extra_key)
            return await super().generate_one(input_ids, max_new_tokens, params)

    client = KeyRecordingClient()

    async def run(state=None):
        manager = _manager(None, RECORD, params=SamplingParams(max_new_tokens=1, num_samples=2),
                           prompts_per_step=1, score=_wrong, clients=[client], num_prompts=2)
        if state is not None:
            manager.load_state_dict(state)
        before = manager.state_dict()
        manager.start()
        try:
            await asyncio.wait_for(manager.take(1), timeout=30)
        finally:
            await manager.stop()
        return manager, before

    first, initial = asyncio.run(run())
    keys_before = set(client.keys)
    client.keys.clear()
    restored, _ = asyncio.run(run(initial))  # the restore point: version 0 again
    assert keys_before == {first.prefix_cache_key(0)}
    assert set(client.keys) == {restored.prefix_cache_key(0)}
    assert first.prefix_cache_key(0) != restored.prefix_cache_key(0)
    restored.load_state_dict(restored.state_dict())  # a second restore: yet another key
    assert len({first.prefix_cache_key(0), restored.prefix_cache_key(0), "v0"}) == 3
