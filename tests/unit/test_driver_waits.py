"""Every wait on the driver is bounded, and a graceful stop can end it (issue 31 items 1, 4, 7).

- A scan of the driver's modules: no ray.get / ray.wait without a timeout, no future `.result()`
  or thread / process `.join()` / `.wait()` without one, no HTTP call without one, no rollout-loop
  call with timeout=None, except the allow-list below, each entry with the reason it is bounded.
- Every trainer call has its own timeout (TrainerTimeouts), from the run config.
- The first SIGTERM sets the stop request without ending the process; the rollout loop's bounded
  call cancels what it gave up on; a take abandoned by a stop loses no group; a generator that
  dies under a validation request is routed to mark_down with no task exception left unretrieved.
The real-Ray behaviour (abandoned waits, the second SIGTERM inside ray.get) is in
tests/integration/test_graceful_stop.py.
"""
from __future__ import annotations

import ast
import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from megatron_rl.algorithms import NoPositiveResamplingSampler
from megatron_rl.config import load_config
from megatron_rl.data.records import PromptRecord
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.interruption import InterruptionSettings
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"

# The modules whose code runs on the driver's paths (the loop, recovery, checkpoints, the
# cluster calls, validation, the rollout loop's callers).
DRIVER_MODULES = [
    "train.py", "run_setup.py", "validation.py", "metrics.py",
    "resilience/recovery.py", "resilience/run_checkpoints.py", "resilience/stop.py",
    "cluster/trainers.py", "cluster/weights.py", "cluster/remote.py", "cluster/launch.py",
    "cluster/generators.py", "cluster/runtime.py", "cluster/placement.py",
    "rollout/event_loop.py", "rollout/manager.py", "rewards/registry.py",
]

# (module, the call's source text) -> why it is bounded without a timeout argument.
ALLOWED = {
    ("rollout/manager.py", "task.result()"):
        "an asyncio task that is done already (after asyncio.wait / a TaskGroup): no wait",
    ("rollout/event_loop.py", "task.result()"):
        "an asyncio task that is done already (in its done-callback): no wait",
}

HTTP_CALLS = {"get", "post", "put", "delete", "patch", "request", "urlopen"}


def _unbounded_waits(relative: str, root: Path = PACKAGE) -> list[str]:
    """"line: source" of every call in the module that waits without a bound."""
    source = (root / relative).read_text()
    tree = ast.parse(source)
    awaited = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Await)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        owner = ast.unparse(node.func.value)
        keywords = {k.arg: k.value for k in node.keywords}
        timeout = keywords.get("timeout", keywords.get("timeout_s"))
        explicit_none = isinstance(timeout, ast.Constant) and timeout.value is None
        if owner == "ray" and name in ("get", "wait"):
            bad = timeout is None or explicit_none
        elif name in ("result", "join", "wait") and id(node) not in awaited:
            bad = not node.args and (timeout is None or explicit_none)
        elif owner in ("requests", "urllib.request", "httpx") and name in HTTP_CALLS:
            bad = timeout is None or explicit_none
        elif owner.endswith("loop") and name in ("call", "run"):
            bad = explicit_none or (len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                                    and node.args[1].value is None)
        else:
            continue
        text = ast.get_source_segment(source, node)
        if bad and (relative, text) not in ALLOWED:
            found.append(f"{relative}:{node.lineno}: {text}")
    return found


def test_no_wait_on_the_driver_is_unbounded():
    """Each wait names its timeout (a recipe field where a user may need to change it); one
    that is bounded otherwise goes in ALLOWED with the reason."""
    missing = [m for m in DRIVER_MODULES if not (PACKAGE / m).is_file()]
    assert not missing, f"driver modules moved: {missing}; update DRIVER_MODULES"
    unbounded = [hit for module in DRIVER_MODULES for hit in _unbounded_waits(module)]
    assert not unbounded, "waits without a timeout on the driver:\n  " + "\n  ".join(unbounded)
    stale = [key for key in ALLOWED if key[1] not in (PACKAGE / key[0]).read_text()]
    assert not stale, f"allow-list entries that match nothing any more: {stale}"


def test_the_scan_finds_an_unbounded_wait(tmp_path):
    """The scan itself: each kind of unbounded wait is reported, its bounded form is not."""
    (tmp_path / "m.py").write_text(
        "import ray, requests\n"
        "ray.get(ref)\nray.get(ref, timeout=5)\nray.wait(refs, timeout=None)\n"
        "future.result()\nfuture.result(3)\nthread.join()\n', '.join(x)\n"
        "requests.get(url)\nrequests.get(url, timeout=10)\nself.loop.call(c, None)\n"
        "async def f():\n    await event.wait()\nevent.wait()\n")
    hits = [h.split(": ", 1)[1] for h in _unbounded_waits("m.py", root=tmp_path)]
    assert hits == ["ray.get(ref)", "ray.wait(refs, timeout=None)", "future.result()",
                    "thread.join()", "requests.get(url)", "self.loop.call(c, None)",
                    "event.wait()"]


def test_every_trainer_call_has_its_own_timeout_from_the_recipe():
    """TrainerGroup waits for each TrainerWorker method as long as the run config says for that
    kind of call; a method without one is refused by name rather than waited on forever."""
    from megatron_rl.cluster.trainers import TrainerTimeouts, TrainerWorker
    from megatron_rl.config import load_config

    methods = {n for n in vars(TrainerWorker) if not n.startswith("_")} - {"shutdown"}
    cfg = load_config(None, ["train.step_timeout_s=111", "train.start_timeout_s=222",
                             "weight_sync.sync_timeout_s=3333", "checkpoint.timeout_s=444"])
    timeouts = TrainerTimeouts.from_run_config(cfg)
    by_method = {m: timeouts.of(m) for m in methods}
    assert by_method["train_step"] == 111 and by_method["setup"] == 222
    assert by_method["sync_weights"] == by_method["sync_new_generators"] == 3333
    assert by_method["save_checkpoint"] == by_method["finalize_checkpoints"] == 444
    assert by_method["load_checkpoint"] == 444
    with pytest.raises(ValueError, match="TrainerWorker.nope: no timeout"):
        timeouts.of("nope")


def test_the_first_sigterm_requests_a_stop_and_the_process_goes_on():
    """In this process: the signal thread sees the SIGTERM, sets the request (a wait for
    generation then abandons; a trainer call gets the grace period), prints one line, and
    nothing else happens; on exit the previous handlers are back."""
    from megatron_rl.resilience.stop import RUN_STOP, GracefulStop, StopRequested

    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop(grace_s=0.5) as stop:
        RUN_STOP.abandon_if_requested("nothing requested yet")  # no-op
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while stop.requested is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.requested == signal.SIGTERM
        with pytest.raises(StopRequested, match="waiting: abandoned for the SIGTERM"):
            RUN_STOP.abandon_if_requested("waiting")
        RUN_STOP.abandon_if_past_grace("a step")  # within the grace period: goes on
        time.sleep(0.6)
        with RUN_STOP.finishing():  # the final checkpoint's waits: their own timeouts
            RUN_STOP.abandon_if_past_grace("the checkpoint")
        with pytest.raises(StopRequested, match="still running 0 s after the SIGTERM"):
            RUN_STOP.abandon_if_past_grace("a step")
    assert signal.getsignal(signal.SIGTERM) is before and not RUN_STOP.requested


def test_a_rollout_loop_call_is_bounded_and_cancels_what_it_gave_up():
    from megatron_rl.rollout.event_loop import RolloutLoop

    loop = RolloutLoop()
    cancelled = []

    async def forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish .*forever within 0 s"):
            loop.call(forever(), timeout=0.2)
        assert time.monotonic() - started < 5
        assert loop.run(lambda: 7) == 7
        deadline = time.monotonic() + 5
        while not cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cancelled
    finally:
        loop.stop()


RECORD = PromptRecord(prompt_id="p0", task="rg/x", prompt="1 + 1 =", answer="2")


def _wrong(texts, records):
    from megatron_rl.rewards.types import Reason, RewardResult

    return [RewardResult(reward=0.0, reason=Reason.WRONG, pass_fraction=0.0)] * len(texts)


class GatedClient:
    """A stand-in generator for scheduling logic only (fake: no server): answers one token once
    `open` is set for its group's prompt; `dead` raises GeneratorDeadError instead."""

    def __init__(self, *, dead: bool = False):
        self.dead = dead
        self.gate = asyncio.Event()
        self.requests = 0

    async def generate_one(self, input_ids, max_new_tokens, params, *, extra_key=None):
        from megatron_rl.rollout import GenerationResult
        from megatron_rl.rollout.types import GeneratorDeadError

        self.requests += 1
        if self.dead:
            raise GeneratorDeadError("connection refused (stand-in)")
        await self.gate.wait()
        return GenerationResult(prompt_index=0, sample_index=0,
                                prompt_token_ids=tuple(input_ids), token_ids=(9,),
                                logprobs=(-0.1,), versions=(0,), finish_reason="stop")


def _manager(clients, *, num_prompts, prompts_per_step, k=0):
    return RolloutManager(
        clients=clients, prompt_token_ids=[[5, 6]] * num_prompts,
        records=[RECORD] * num_prompts,
        sampler=NoPositiveResamplingSampler(num_prompts, seed=0, enabled=False),
        gate=AdmissionGate(StalenessSettings(max_off_policyness=k,
                                             prompts_per_step=prompts_per_step)),
        params=SamplingParams(max_new_tokens=1, num_samples=2),
        interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                          thinking_budget=4, solution_budget=4),
        score=_wrong, decode=str, max_finished_groups=2 * prompts_per_step)


def test_a_take_abandoned_by_a_stop_loses_no_group():
    """A take of 3 groups holds 2 when a graceful stop cancels it (the third cannot be
    generated): the 2 go back to the buffer, in order, uncounted by the gate; a state_dict taken
    meanwhile holds them once; the next take returns all three exactly once."""
    async def run():
        slow, fast = GatedClient(), GatedClient()
        fast.gate.set()
        manager = _manager([fast, slow], num_prompts=6, prompts_per_step=3)
        manager.start()
        try:
            taking = asyncio.ensure_future(manager.take(3))
            for _ in range(500):  # groups 0 and 2 (the fast generator's) are in hand
                if len(manager._taking) == 2:
                    break
                await asyncio.sleep(0.01)
            held = manager.state_dict()
            outstanding = manager.outstanding_group_ids()
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)
            trained_after_cancel = manager.gate.num_trained
            buffered = [g.group_id for g in manager._finished]
            slow.gate.set()
            groups = await asyncio.wait_for(manager.take(3), timeout=30)
        finally:
            await manager.stop()
        return held, outstanding, trained_after_cancel, buffered, groups, manager

    held, outstanding, trained_after_cancel, buffered, groups, manager = asyncio.run(run())
    assert sorted(g.group_id for g in held["finished"]) == [0, 2]
    assert sorted(t.group_id for t in held["tickets"]) == [1]
    assert outstanding == [0, 1, 2]
    assert trained_after_cancel == 0 and buffered == [0, 2]
    assert [g.group_id for g in groups] == [0, 1, 2]
    assert manager.gate.num_trained == 3
    for group in groups:  # each group's pass rate counted once, at the take that returned it
        assert manager.sampler.pass_rate_history(group.prompt_index) == [0.0]


def test_a_dead_generator_under_validation_is_routed_and_no_exception_is_unretrieved():
    """Validation's requests go through run_anywhere: a generator (a fake raising
    GeneratorDeadError) fails under it; the failure is routed (mark_down, reported by
    take_failures), the request answered by the other generator, and the loop's exception
    handler never hears of an unretrieved task exception, also after garbage collection."""
    import gc

    unretrieved = []

    async def run():
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: unretrieved.append(context.get("message")))
        dead, alive = GatedClient(dead=True), GatedClient()
        alive.gate.set()
        manager = _manager([dead, alive], num_prompts=2, prompts_per_step=1)

        async def request(client):
            return await client.generate_one([5, 6], 1, None)

        answers = await asyncio.wait_for(asyncio.gather(
            *(manager.run_anywhere(i, request) for i in range(4))), timeout=30)
        failures = manager.take_failures()
        down = manager.down
        del manager
        gc.collect()
        await asyncio.sleep(0)
        return answers, failures, down, dead.requests

    answers, failures, down, dead_requests = asyncio.run(run())
    gc.collect()
    assert len(answers) == 4 and all(a.token_ids == (9,) for a in answers)
    assert down == {0} and [f.index for f in failures] == [0]
    assert "connection refused (stand-in)" in failures[0].reason
    assert dead_requests >= 1
    assert not unretrieved, unretrieved


def test_any_other_failure_of_a_validation_request_is_a_rollout_error():
    """A request that fails otherwise (a stand-in raising ValueError) stops the run the way a
    rollout task's failure does: RolloutError naming the generator and the error."""
    from megatron_rl.rollout.manager import RolloutError

    async def run():
        manager = _manager([GatedClient()], num_prompts=1, prompts_per_step=1)

        async def request(client):
            raise ValueError("malformed answer")

        with pytest.raises(RolloutError, match="generator 0 failed: ValueError: malformed"):
            await asyncio.wait_for(manager.run_anywhere(0, request), timeout=30)
        return manager.down

    assert asyncio.run(run()) == frozenset()


class StoppingRun:
    """A stand-in RunSetup (control logic only) recording what the driver asks of it;
    `stop_in` names the wait during which the first SIGTERM arrives (a real signal to this
    process), and whether that wait is abandoned (as GeneratorHealth.wait / a trainer call
    past the grace period are) or finishes."""

    def __init__(self, stop_in: str, abandon: bool):
        self.stop_in, self.abandon = stop_in, abandon
        self.step, self.calls, self.last_checkpoint_step = 0, [], None
        self.checkpoints = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.calls.append("teardown")

    def _wait(self, name: str) -> None:
        from megatron_rl.resilience.stop import RUN_STOP

        if name != self.stop_in or self.step != 1:
            return
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not RUN_STOP.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.abandon:
            RUN_STOP.abandon_if_requested(name)

    def progress(self, steps):
        class Bar:
            n = 0

            def update(self, n):
                pass

        return Bar()

    def take_groups(self, num_groups):
        self._wait("take")
        self.calls.append(("take", self.step + 1))
        return [None] * num_groups

    def record_ledger(self, step, groups):
        pass

    def rewards_of(self, groups):
        import torch

        return torch.zeros(len(groups), 2)  # zero variance: no train step

    def rollout_metrics(self, groups, rewards, keep):
        return {}

    def push_weights(self):
        self._wait("push")
        self.step += 1
        self.calls.append(("pushed", self.step))
        return {}

    def log(self, step, metrics):
        pass

    def commit_checkpoint(self, *, blocking):
        if blocking:
            self.calls.append("commit")

    def save_checkpoint(self, step, *, wait=False):
        self.calls.append(("checkpoint", step))
        self.last_checkpoint_step = step

    def abandon_pending(self):
        self.calls.append("abandon pending")

    def finish(self):
        self.calls.append("finish")


@pytest.mark.parametrize("stop_in, abandon, expected", [
    # waiting for step 2's groups: abandoned; the step-1 state is whole: checkpointed
    ("take", True, [("take", 1), ("pushed", 1), "commit", ("checkpoint", 1), "finish"]),
    # step 2's push under way finishes within the grace period: step 2 checkpointed
    ("push", False, [("take", 1), ("pushed", 1), ("take", 2), ("pushed", 2), "commit",
                     ("checkpoint", 2), "finish"]),
    # step 2 abandoned half done (its groups taken, not pushed): no checkpoint of it
    ("push", True, [("take", 1), ("pushed", 1), ("take", 2), "abandon pending", "finish"]),
])
def test_a_graceful_stop_checkpoints_only_a_whole_step(monkeypatch, capsys, stop_in, abandon,
                                                       expected):
    from megatron_rl.run_setup import RunSetup
    from megatron_rl.train import train

    run = StoppingRun(stop_in, abandon)
    monkeypatch.setattr(RunSetup, "start", classmethod(lambda cls, cfg, backend=None: run))
    cfg = load_config("examples/configs/tiny_pipeline.yaml", [
        "train.num_steps=5", "eval.at_step_zero=false", "eval.interval_steps=0",
        "checkpoint.interval_steps=0"])
    assert train(cfg) == 128 + signal.SIGTERM
    assert run.calls == [*expected, "teardown"]
    said = capsys.readouterr().err
    assert ("no checkpoint was written; --resume continues from the start" in said) == \
        (expected[-2] == "abandon pending"), said
