"""A stop that gives up on a `take` as it completes loses no group (issue 37 item 4).

The driver waits for `RolloutManager.take` on the rollout loop's thread (RolloutLoop.submit,
GeneratorHealth.wait). When it gives up (a stop), the take may already have taken its groups out
of the buffer and updated the gate and the No-Positive-Resampling sampler; a bare
`future.cancel()` from the driver's thread then dropped its result, so the checkpoint written on
the stop lacked those groups. `RolloutLoop.abandon` puts them back through `put_back`. Both
orders of the race are driven deterministically, on a real event loop in its own thread, with
the real manager, gate and sampler; the generators are stand-ins for the scheduling logic only
(no server: every request answers one token at once).
"""
import contextlib
import threading

import pytest

from megatron_rl.algorithms import NoPositiveResamplingSampler
from megatron_rl.data.records import PromptRecord
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.event_loop import RolloutLoop
from megatron_rl.rollout.interruption import InterruptionSettings
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings

pytestmark = pytest.mark.unit

RECORD = PromptRecord(prompt_id="p0", task="rg/x", prompt="1 + 1 =", answer="2")


class InstantClient:
    """A stand-in generator (scheduling logic only, no server): one token, at once."""

    async def generate_one(self, input_ids, max_new_tokens, params, *, extra_key=None):
        from megatron_rl.rollout import GenerationResult

        return GenerationResult(prompt_index=0, sample_index=0,
                                prompt_token_ids=tuple(input_ids), token_ids=(9,),
                                logprobs=(-0.1,), versions=(0,), finish_reason="stop")


def _passed(texts, records):
    from megatron_rl.rewards.types import Reason, RewardResult

    return [RewardResult(reward=1.0, reason=Reason.CORRECT, pass_fraction=1.0)] * len(texts)


@contextlib.contextmanager
def buffered_manager(loop: RolloutLoop):
    """A started manager on `loop` with its two groups (k = 0, 2 per step) generated and
    buffered; every completion passes, so taking a group retires its prompt
    (No-Positive-Resampling). Stops the manager, then the loop."""
    manager = RolloutManager(
        clients=[InstantClient()], prompt_token_ids=[[5, 6]] * 4, records=[RECORD] * 4,
        sampler=NoPositiveResamplingSampler(4, seed=0),
        gate=AdmissionGate(StalenessSettings(max_off_policyness=0, prompts_per_step=2)),
        params=SamplingParams(max_new_tokens=1, num_samples=2),
        interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                          thinking_budget=4, solution_budget=4),
        score=_passed, decode=str, max_finished_groups=2)
    try:
        loop.run(manager.start)
        loop.call(manager.wait_until_idle(), timeout=30)
        assert loop.run(lambda: manager.num_finished) == 2
        yield manager
    finally:
        loop.call(manager.stop())
        loop.stop()


def _assert_put_back(loop: RolloutLoop, manager: RolloutManager, before: dict) -> None:
    """The state is the one before the take (buffer in order, gate, sampler, requeue counts),
    and the next take returns the same groups, each counted once."""
    assert loop.run(manager.state_dict) == before
    assert manager.gate.num_trained == 0 and manager.gate.num_outstanding == 2
    assert manager.sampler.num_retired == 0
    groups = loop.call(manager.take(2), timeout=30)
    assert [g.group_id for g in groups] == [g.group_id for g in before["finished"]] == [0, 1]
    assert manager.gate.num_trained == 2 and manager.sampler.num_retired == 2
    for group in groups:
        assert manager.sampler.pass_rate_history(group.prompt_index) == [1.0]


def test_a_take_cancelled_after_it_completed_but_before_its_hand_over_puts_its_groups_back():
    """The take completes on the loop (groups out of the buffer, gate and sampler updated); the
    driver cancels before the loop has handed the result over. The stall after the take stands
    in for that moment: it holds the loop until the driver's cancel has happened."""
    loop = RolloutLoop()
    with buffered_manager(loop) as manager:
        before = loop.run(manager.state_dict)
        taken, given_up = threading.Event(), threading.Event()

        async def take_then_stall():
            groups = await manager.take(2)
            taken.set()
            given_up.wait(30)  # blocks the loop: the hand-over comes after the driver's cancel
            return groups

        future = loop.submit(take_then_stall(), put_back=manager.put_back)
        future.add_done_callback(lambda _: given_up.set())  # runs in the cancelling thread
        assert taken.wait(30)
        # Committed (read while the loop is held in the stall): the groups are out of the books.
        assert manager.gate.num_trained == 2 and manager.num_finished == 0
        loop.abandon(future)
        assert future.cancelled() and future.ended.is_set()
        _assert_put_back(loop, manager, before)


def test_a_take_handed_over_but_never_read_is_put_back_when_the_driver_gives_up():
    """The take completed and its result reached the driver's future, but the driver gave up
    before reading it (an error or a stop between two slices of its wait): `abandon` cannot
    cancel it any more and puts its groups back itself."""
    loop = RolloutLoop()
    with buffered_manager(loop) as manager:
        before = loop.run(manager.state_dict)
        future = loop.submit(manager.take(2), put_back=manager.put_back)
        assert future.ended.wait(30) and future.done() and not future.cancelled()
        assert loop.run(lambda: manager.gate.num_trained) == 2  # taken, as the driver never saw
        loop.abandon(future)
        _assert_put_back(loop, manager, before)


def test_a_stop_while_the_driver_waits_for_a_completed_take_loses_no_group():
    """Through the driver's own wait (GeneratorHealth.wait): the stop comes in its health
    check, after the take has completed; the StopRequested goes on, and the groups are back
    for the checkpoint written on the stop."""
    from megatron_rl.resilience.recovery import GeneratorHealth
    from megatron_rl.resilience.stop import StopRequested

    submitted = []

    class RecordingLoop(RolloutLoop):
        def submit(self, coroutine, **kwargs):
            submitted.append(super().submit(coroutine, **kwargs))
            return submitted[-1]

    loop = RecordingLoop()
    with buffered_manager(loop) as manager:
        before = loop.run(manager.state_dict)
        # Only what `wait` uses: the loop, and a health check in which the stop comes.
        health = GeneratorHealth.__new__(GeneratorHealth)
        health.loop = loop

        def stop_once_taken():
            assert submitted[-1].ended.wait(30)  # the take has completed, unread
            raise StopRequested("waiting for take: abandoned for the SIGTERM")

        health.check = stop_once_taken
        with pytest.raises(StopRequested):
            health.wait(manager.take(2), put_back=manager.put_back)
        _assert_put_back(loop, manager, before)


def test_put_back_refuses_groups_other_than_the_latest_takes():
    """Only the latest take, once: anything else would count a group twice."""
    loop = RolloutLoop()
    with buffered_manager(loop) as manager:
        groups = loop.call(manager.take(2), timeout=30)
        with pytest.raises(RuntimeError, match=r"only the latest take's groups can be put back "
                                                 r"\(\[0, 1\]\)"):
            loop.run(lambda: manager.put_back(groups[:1]))
        loop.run(lambda: manager.put_back(groups))
        with pytest.raises(RuntimeError, match=r"can be put back \(none\), once"):
            loop.run(lambda: manager.put_back(groups))


def test_the_gate_refuses_to_put_back_groups_a_published_version_counts_on():
    """Version v means v x prompts_per_step groups trained; those cannot go back (their step
    was trained and published), only the ones taken since."""
    gate = AdmissionGate(StalenessSettings(max_off_policyness=1, prompts_per_step=2))
    for _ in range(4):
        gate.on_admit(0)
    for _ in range(3):
        assert gate.on_take(0, 0) == "fresh"
    assert gate.may_admit(1)  # the trainer is at version 1: its 2 groups were trained
    with pytest.raises(ValueError, match="trainer version 1 counts on all but 1 of the 3"):
        gate.on_put_back(2)
    gate.on_put_back(1)
    assert (gate.num_trained, gate.num_outstanding) == (2, 2)
