"""Generator restarts (issue 37 items 1, 5, 6; docs/fault_tolerance.md "Generator failures"): a
failed engine start costs one attempt, not the engine; any number of down engines restart at once
and come back in one batch with one rebuild of the trainer's weight sync, while the driver goes on
(and keeps checking rollout.min_generators); the health-check strikes start from none when an
engine comes back; an engine that comes back after a train step holds the version of its weights.

The real GeneratorActor, GeneratorPool and GeneratorHealth run here (on a real RolloutLoop) against
stand-ins, for their scheduling logic only: Ray (`FakeRay`: an actor call runs the real actor's
method at once and its result is ready after a modelled duration on a modelled clock; a blocking
wait moves that clock on, and `World.blocked_s` sums it), the SGLang server (`FakeServer`: a start
can fail with "address already in use"), the rollout manager and the trainer group (recording).
No wall clock: every duration is the modelled clock's. Real Ray and SGLang restarts run in
tests/integration/test_cluster_ray.py and tests/e2e/test_fault_tolerance.py."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import types

import pytest
import ray.exceptions

from megatron_rl.cluster import generators as generators_module
from megatron_rl.cluster.generators import GeneratorActor, GeneratorPool
from megatron_rl.config import load_config
from megatron_rl.resilience import recovery as recovery_module
from megatron_rl.resilience.recovery import GeneratorHealth
from megatron_rl.rollout import GeneratorError, SGLangServerSettings
from megatron_rl.rollout.event_loop import RolloutLoop

pytestmark = pytest.mark.unit

REAL_RAY = sys.modules["ray"]
RESTART_S, START_S = 5.0, 600.0  # modelled: an actor's restart call, a server's start


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclasses.dataclass(eq=False)
class Ref:
    ready_at: float
    value: object = None
    error: BaseException | None = None


class FakeRay:
    """The part of the `ray` module the pool uses, on the modelled clock."""

    exceptions = ray.exceptions

    def __init__(self, world):
        self.world = world
        self.util = types.SimpleNamespace(get_node_ip_address=lambda: "10.0.0.1")

    def wait(self, refs, num_returns=1, timeout=None):
        clock = self.world.clock
        pending = sorted(r.ready_at for r in refs if r.ready_at > clock.now)
        if len(refs) - len(pending) < num_returns and timeout:  # a blocking wait: time passes
            until = pending[num_returns - (len(refs) - len(pending)) - 1] \
                if num_returns <= len(refs) else clock.now
            step = min(until, clock.now + timeout) - clock.now
            self.world.blocked_s += step
            clock.now += step
        ready = [r for r in refs if r.ready_at <= clock.now]
        return ready, [r for r in refs if r.ready_at > clock.now]

    def get(self, ref, timeout=None):
        if ref.ready_at > self.world.clock.now:  # a blocking get
            self.world.blocked_s += ref.ready_at - self.world.clock.now
            self.world.clock.now = ref.ready_at
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, handle, no_restart=True):
        handle.dead = True

    def get_runtime_context(self):
        return types.SimpleNamespace(get_node_id=lambda: "node-a")

    def __getattr__(self, name):  # Ray's own internals (its exceptions use them)
        return getattr(REAL_RAY, name)


class Handle:
    """A Ray actor handle: `handle.method.remote(*args)` -> a Ref (World.call)."""

    def __init__(self, world, name, settings):
        self.world, self.dead = world, False
        self.actor = GeneratorActor(name, settings)
        world.actors_created += 1

    def __getattr__(self, method):
        if method.startswith("_"):
            raise AttributeError(method)
        return types.SimpleNamespace(remote=lambda *args: self.world.call(self, method, args))


class FakeServer:
    """SGLangServer: launches at once; its start fails while World.failing_starts says so."""

    world = None

    def __init__(self, settings, port):
        self.settings, self.url = settings, f"http://{settings.host}:{port}"
        self.process = types.SimpleNamespace(pid=os.getpid())
        self.log_path = "/dev/null"

    @classmethod
    def launch(cls, settings, wait=False):
        cls.world.next_port += 1
        return cls(settings, cls.world.next_port)

    def wait_until_healthy(self):
        name = f"generator-{self.settings.random_seed}"  # (one seed per generator here)
        if self.world.failing_starts.get(name, 0):
            self.world.failing_starts[name] -= 1
            raise GeneratorError("server exited with code 1: [Errno 98] address already in use")

    def shutdown(self, timeout_s=None):
        pass


class World:
    def __init__(self, durations):
        self.clock, self.durations = Clock(), durations
        self.blocked_s = 0.0  # modelled seconds the driver spent blocked in Ray waits
        self.actors_created, self.next_port = 0, 30000
        self.failing_starts: dict[str, int] = {}
        self.sick: set[str] = set()  # generators whose health check fails
        self.version = 7

    def call(self, handle, method, args):
        now = self.clock.now
        if handle.dead:
            return Ref(now, error=ray.exceptions.RayActorError())
        try:
            if method == "check_health":  # (not the real one: it asks the server over HTTP)
                if handle.actor.name in self.sick:
                    raise GeneratorError(f"generator {handle.actor.name!r}: no answer")
                value, error = None, None
            else:
                value, error = getattr(handle.actor, method)(*args), None
        except Exception as exc:  # noqa: BLE001 (delivered as Ray does)
            error = ray.exceptions.RayTaskError(method, f"{type(exc).__name__}: {exc}", exc)
            value = None
        return Ref(now + self.durations.get(method, 0.0), value, error)


class Manager:
    def __init__(self, count):
        self.down, self.failures, self.clients = frozenset(), [], [None] * count

    def raise_if_failed(self):
        pass

    def mark_down(self, index, reason):
        if index not in self.down:
            self.down |= {index}
            self.failures.append(types.SimpleNamespace(index=index, reason=reason,
                                                       detected_at=1.0, requeued_groups=2))

    def mark_up(self, index, client):
        self.down -= {index}
        self.clients[index] = client

    def take_failures(self):
        failures, self.failures = self.failures, []
        return failures

    async def check_liveness(self, timeout_s):
        return {}


class Trainers:
    def __init__(self):
        self.calls = []

    def connect_generators(self, endpoints, hf_config_dir):
        self.calls.append(("connect", sorted(e.name for e in endpoints)))

    def sync_new_generators(self, endpoints, hf_config_dir, version, connect=None):
        self.calls.append(("sync_new", sorted(e.name for e in endpoints), version,
                           None if connect is None else sorted(e.name for e in connect)))


class Client:
    def __init__(self, url):
        self.url = url

    async def close(self):
        pass


@pytest.fixture
def loop():
    loop = RolloutLoop()
    yield loop
    loop.stop()


def _launched_pool(monkeypatch, num, durations=None):
    """A pool of `num` engines launched (not yet healthy), as RunCluster leaves it before
    `wait_until_healthy` -> (pool, world)."""
    world = World(durations if durations is not None
                  else {"restart": RESTART_S, "wait_until_healthy": START_S})
    FakeServer.world = world
    monkeypatch.setitem(sys.modules, "ray", FakeRay(world))
    monkeypatch.setattr("megatron_rl.rollout.SGLangServer", FakeServer)
    monkeypatch.setattr("megatron_rl.console.quiet_known_warnings", lambda **_: None)
    monkeypatch.setattr(generators_module, "kill_process_group", lambda *a, **k: None)
    monkeypatch.setattr(generators_module, "time", world.clock)
    names = [f"generator-{i}" for i in range(num)]
    settings = [SGLangServerSettings(model_path=".", random_seed=i) for i in range(num)]
    pool = GeneratorPool(None, [], names, start_timeout_s=900.0, call_timeout_s=30.0)
    pool._settings = settings
    monkeypatch.setattr(pool, "_new_actor", lambda i: Handle(world, names[i], settings[i]))
    pool.actors = [pool._new_actor(i) for i in range(num)]
    pool._endpoints = [None] * num
    for handle in pool.actors:
        handle.actor.launch()
    return pool, world


def _run(tmp_path, loop, monkeypatch, num, *overrides, durations=None):
    """A pool of `num` started engines under GeneratorHealth -> (health, pool, manager,
    trainers, world)."""
    pool, world = _launched_pool(monkeypatch, num, durations)
    monkeypatch.setattr(recovery_module, "time", world.clock)
    cfg = load_config("examples/configs/tiny_pipeline.yaml", [
        f"output_dir={tmp_path}", f"rollout.num_generators={num}",
        "rollout.engine_start_timeout_s=900", "rollout.health_check_interval_s=30", *overrides])
    names = pool.names
    for i, handle in enumerate(pool.actors):
        pool._endpoints[i] = handle.actor.wait_until_healthy()
    pool.connected = set(names)
    cluster = types.SimpleNamespace(generators=pool, trainers=Trainers(), model_dir="/model",
                                    stop_if_trainer_node_lost=lambda cfg: None,
                                    lost_nodes=lambda ids: {})  # no node is lost
    manager = Manager(num)
    health = GeneratorHealth(cfg, tmp_path, cluster=cluster, loop=loop, manager=manager,
                             clients=[Client(e.url) for e in pool.endpoints],
                             math_verifier=None, version=lambda: world.version,
                             new_client=Client, on_restarted=lambda: None)
    health._last_check = world.clock.now  # the timed health checks: every 30 modelled s
    return health, pool, manager, cluster.trainers, world


def _settle(health, world, until=None, *, poll_s: float = 5.0, limit_s: float = 3600.0):
    """The driver's checks, one per modelled `poll_s` (GeneratorHealth.wait: every second), until
    nothing is being brought back (or `until()`)."""
    deadline = world.clock.now + limit_s
    while world.clock.now < deadline:
        world.clock.sleep(poll_s)
        health.check()
        if (until() if until is not None else not health._placing or health._retry_at):
            return
    raise AssertionError(f"still being brought back after {limit_s} s: {health._placing}")


def test_a_failed_start_leaves_the_actor_able_to_restart():
    """Item 1 at its root: a server that does not come up ("address already in use") is stopped,
    but the actor is not shut down, so the next restart() launches a new server."""
    world = World({})
    FakeServer.world = world
    world.failing_starts["generator-0"] = 1
    mp = pytest.MonkeyPatch()
    try:
        mp.setitem(sys.modules, "ray", FakeRay(world))
        mp.setattr("megatron_rl.rollout.SGLangServer", FakeServer)
        mp.setattr("megatron_rl.console.quiet_known_warnings", lambda **_: None)
        stopped = []
        mp.setattr(generators_module, "kill_process_group", lambda pid, **_: stopped.append(pid))
        actor = GeneratorActor("generator-0", SGLangServerSettings(model_path="."))
        first = actor.launch()
        with pytest.raises(GeneratorError, match="did not start: .*address already in use"):
            actor.wait_until_healthy()
        assert stopped == [first.pid]  # the failed server's process group was stopped
        second = actor.restart()
        assert second.url != first.url and actor.wait_until_healthy() == second
        actor.shutdown()  # an explicit shutdown still ends the actor for good
        with pytest.raises(GeneratorError, match="restart\\(\\) after shutdown\\(\\)"):
            actor.restart()
    finally:
        mp.undo()


def test_a_transient_start_failure_costs_one_attempt_and_the_engine_comes_back(
        tmp_path, loop, monkeypatch):
    """Item 1 through the pool and the driver: generator-1's first restart fails to start; the
    second (after a 2 s backoff) succeeds, in the same actor. With max_generator_restarts=2 and
    min_generators=null (all engines needed) the run goes on."""
    health, pool, manager, trainers, world = _run(
        tmp_path, loop, monkeypatch, 2, "rollout.max_generator_restarts=2",
        "rollout.min_generators=null", "rollout.engine_start_timeout_s=3000")  # two starts
    world.failing_starts["generator-1"] = 1
    manager.mark_down(1, "generator 'generator-1': connection refused")
    health.check()
    assert health._restarts == {1: 1}
    _settle(health, world)  # the start failed: one attempt spent, the next after its backoff
    assert 1 not in health._given_up and health._retry_at[1] == world.clock.now + 2.0
    world.clock.sleep(2.0)
    health.check()  # attempt 2, in place: the actor is still usable
    assert health._restarts == {1: 2} and world.actors_created == 2
    _settle(health, world)
    assert manager.down == frozenset() and health.in_rotation() == 2
    assert trainers.calls == [("sync_new", ["generator-1"], 7, ["generator-0", "generator-1"])]
    (fault,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert fault["kind"] == "generator" and "recovered_at" in fault
    assert world.blocked_s == 0.0  # the driver never waited for a restart


def test_an_actor_whose_restart_raises_is_replaced_by_a_new_one(tmp_path, loop, monkeypatch):
    """Item 1, the pool's side: an actor's restart() that raises (Ray delivers a RayTaskError,
    e.g. "restart() after shutdown()") gets a fresh actor in its bundle, not a retry of the same
    failing call until the engine is given up."""
    health, pool, manager, trainers, world = _run(tmp_path, loop, monkeypatch, 2,
                                                  "rollout.max_generator_restarts=1")
    pool.actors[0].actor.shutdown()  # the state a failed start left on main
    manager.mark_down(0, "generator 'generator-0': connection refused")
    health.check()
    world.clock.sleep(RESTART_S)
    health.check()  # the restart raised: a new actor launches in the same bundle
    assert world.actors_created == 3 and pool.actors[0].actor._stopped is False
    _settle(health, world)
    assert manager.down == frozenset() and health._given_up == set()
    assert health._restarts == {0: 1}  # one attempt, not one per actor


def test_fifty_down_engines_restart_at_once_and_come_back_in_one_batch(tmp_path, loop,
                                                                       monkeypatch):
    """Item 5: a rack (50 of 60 engines) goes down. Every restart starts in the same check and
    none is waited for (no modelled time passes in the driver's checks); rollout.min_generators
    is checked while they are under way; after one start's time all 50 are back, synced over one
    weight-update group, and the trainer's main sync is rebuilt once."""
    health, pool, manager, trainers, world = _run(tmp_path, loop, monkeypatch, 60,
                                                  "rollout.min_generators=20")
    enough_checks = []
    check_enough = health._check_enough
    monkeypatch.setattr(health, "_check_enough", lambda: (
        enough_checks.append((world.clock.now, len(pool._replacing))), check_enough())[1])
    down = range(10, 60)
    for index in down:
        manager.mark_down(index, f"generator 'generator-{index}': its node's rack lost power")
    failed_at = world.clock.now
    health.check()
    assert world.clock.now == failed_at and len(pool._replacing) == 50
    assert enough_checks == [(failed_at, 50)]  # checked with all 50 in flight: 10 < 20 noticed
    assert health._below_min_since == failed_at
    for _ in range(3):  # the driver goes on checking (every modelled second) while they start
        world.clock.sleep(1.0)
        health.check()
    assert len(enough_checks) == 4 and all(n == 50 for _, n in enough_checks)
    _settle(health, world)
    assert manager.down == frozenset() and health.in_rotation() == 60
    names = [f"generator-{i}" for i in range(60)]
    assert trainers.calls == [("sync_new", sorted(names[10:]), 7, sorted(names))]
    assert world.clock.now - failed_at < 2 * (RESTART_S + START_S)  # one start, not 50
    assert world.blocked_s == 0.0 and health._below_min_since is None
    assert health._restarts == {i: 1 for i in down}
    faults = (tmp_path / "faults.jsonl").read_text().splitlines()
    assert len(faults) == 50


def test_the_attempts_and_backoff_are_counted_per_engine(tmp_path, loop, monkeypatch):
    """Item 5: restarts at once keep each engine's own accounting: one engine that never starts
    is given up after rollout.max_generator_restarts, with growing backoff, while the others of
    the same batch come back."""
    health, pool, manager, trainers, world = _run(tmp_path, loop, monkeypatch, 4,
                                                  "rollout.max_generator_restarts=3")
    world.failing_starts["generator-3"] = 99
    for index in (1, 2, 3):
        manager.mark_down(index, f"generator 'generator-{index}': gone")
    health.check()
    retries = []
    for _ in range(5):
        _settle(health, world, until=lambda: 3 in health._retry_at or 3 in health._given_up)
        if 3 in health._retry_at:
            retries.append(health._retry_at[3] - world.clock.now)
            world.clock.sleep(retries[-1])
            health.check()
    assert manager.down == {3} and health._given_up == {3}
    assert health._restarts[3] == 3 and retries == [2.0, 4.0]
    assert [c[1] for c in trainers.calls] == [["generator-1", "generator-2"]]
    faults = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [f["recovered_at"] is not None for f in faults] == [True, True, False]


def test_a_restarted_engine_starts_with_no_health_strikes(tmp_path, loop, monkeypatch):
    """Item 6: an engine that missed one health check, then failed a request and was restarted,
    needs two failed checks in a row again to be taken out (on main its old strike stayed)."""
    health, pool, manager, trainers, world = _run(tmp_path, loop, monkeypatch, 2,
                                                  durations={})
    world.sick = {"generator-0"}
    world.clock.sleep(30)
    health.check()  # strike 1: a busy engine may miss one
    assert manager.down == frozenset()
    world.sick = set()
    manager.mark_down(0, "generator 'generator-0': connection refused")
    health.check()
    health.check()
    health.check()  # restarted and taken back
    assert manager.down == frozenset()
    world.sick = {"generator-0"}
    world.clock.sleep(30)
    health.check()  # its first missed check since it came back
    assert manager.down == frozenset()
    world.clock.sleep(30)
    health.check()
    assert manager.down == {0}


def test_an_engine_back_after_a_train_step_holds_the_new_version(tmp_path, loop, monkeypatch):
    """Item 6: an engine that fails between the last check and a weight sync (the trainer then
    holds version 8's weights while the generators hold 7) is not brought back labelled 7 with
    version 8's weights: it comes back once the weights it gets are labelled with their version."""
    health, pool, manager, trainers, world = _run(tmp_path, loop, monkeypatch, 2,
                                                  durations={})
    manager.mark_down(0, "generator 'generator-0': connection refused")
    health.check(now=True)  # weights.push's check, after the train step
    world.version = 8  # the sync into the rotation published version 8
    health.check()
    health.check()
    assert manager.down == frozenset()
    assert [c for c in trainers.calls if c[0] == "sync_new"] == [
        ("sync_new", ["generator-0"], 8, ["generator-0", "generator-1"])]


def test_an_engine_started_by_a_sync_joins_that_sync(tmp_path, loop, monkeypatch):
    """Item 6, the engine already started when the sync comes: it joins the trainer's sync (no
    sync of its own under the older version) and enters the rotation holding the new version."""
    health, pool, manager, trainers, world = _run(tmp_path, loop, monkeypatch, 2)
    manager.mark_down(1, "generator 'generator-1': connection refused")
    health.check()
    world.clock.sleep(RESTART_S)
    health.check()
    world.clock.sleep(START_S)
    health.check(now=True)  # started: connected to the coming sync, not yet serving
    assert trainers.calls == [("connect", ["generator-0", "generator-1"])]
    assert manager.down == {1}
    world.version = 8  # that sync published version 8 into both engines
    health.check()
    assert manager.down == frozenset() and len(trainers.calls) == 1  # no sync of its own


@pytest.mark.parametrize("node_lost", [True, False])
def test_a_server_on_a_lost_node_counts_as_stopped_at_shutdown(tmp_path, loop, monkeypatch,
                                                              node_lost):
    """Issue 37 item 2: a run ended by a lost node that also held engines tears down without
    "could not confirm that these servers stopped" for the servers that went with that node (their
    actors' shutdown calls fail: the node is gone); a server whose actor failed on a node Ray still
    counts alive is still reported. Ray's node table is a stand-in (`lost_nodes`)."""
    health, pool, manager, trainers, world = _run(tmp_path, loop, monkeypatch, 2)
    pool._endpoints = [dataclasses.replace(e, node_id="node-b") for e in pool._endpoints]
    pool.actors[1].dead = True  # its node went: every call to its actor fails
    monkeypatch.setattr(generators_module, "lost_nodes",
                        lambda ids: {"node-b": "10.0.0.2"} if node_lost else {})
    if node_lost:
        pool.shutdown()
    else:
        with pytest.raises(GeneratorError, match="could not confirm.*generator-1"):
            pool.shutdown()


def test_engines_that_fail_to_start_at_launch_are_started_again_all_at_once(monkeypatch):
    """At a run's launch, engines whose first start fails (a port taken meanwhile) are started
    again in their actors, together, and the launch goes on: 2 of 8 fail once, and the wait is
    one start, one restart and one more start of modelled time (not one per failed engine)."""
    pool, world = _launched_pool(monkeypatch, 8)
    world.failing_starts.update({"generator-2": 1, "generator-5": 1})
    started = world.clock.now
    pool.wait_until_healthy(attempts=2)
    assert len(pool.endpoints) == 8 and world.actors_created == 8  # same actors, restarted
    assert len({e.url for e in pool.endpoints}) == 8
    assert world.clock.now - started == pytest.approx(START_S + RESTART_S + START_S)


def test_an_engine_that_never_starts_ends_the_launch_naming_it(monkeypatch):
    """Once an engine has spent its starts, the launch stops every server and the error names
    each engine that did not start, with its server's own error (one ClusterError the CLI prints
    as one line, not a traceback)."""
    from megatron_rl.cluster.generators import GeneratorStartError
    from megatron_rl.cluster.runtime import ClusterError

    pool, world = _launched_pool(monkeypatch, 4)
    world.failing_starts.update({"generator-1": 5, "generator-3": 1})
    stopped = []
    monkeypatch.setattr(pool, "shutdown", lambda *a, **k: stopped.append(True))
    with pytest.raises(GeneratorStartError) as raised:
        pool.wait_until_healthy(attempts=3)
    message = str(raised.value)
    assert isinstance(raised.value, ClusterError) and stopped == [True]
    assert message.startswith("1 of 4 generators did not start in 3 start(s) each")
    assert "'generator-1'" in message and "address already in use" in message
    assert "'generator-3'" not in message  # its second start succeeded
    assert world.failing_starts["generator-1"] == 2  # three starts spent, no more


def test_a_node_lost_while_its_engine_restarts_turns_the_restart_into_a_re_creation(
        tmp_path, loop, monkeypatch):
    """A request sees generator-1 fail before Ray declares its node dead: the driver restarts it
    in place (processes.json rewritten: it left the rotation). Once the node table says the
    node is lost, the restart becomes a re-creation (replace: a new actor Ray places when a node
    has room), and the fault names the lost node, first seen as the request's failure."""
    health, pool, manager, trainers, world = _run(tmp_path, loop, monkeypatch, 2,
                                                  "rollout.max_generator_restarts=3")
    left = []
    health._on_restarted = lambda: left.append(sorted(pool.serving()))
    lost: dict[str, str] = {}
    health.cluster.lost_nodes = lambda ids: {n: lost[n] for n in ids if n in lost}
    pool._endpoints[0] = dataclasses.replace(pool._endpoints[0], node_id="node-b")
    node = pool.endpoints[1].node_id
    manager.mark_down(1, "generator 'generator-1': Cannot connect to host")
    health.check()
    assert health._placing and pool._replacing[1].stage == "restart"
    assert left == [[0]]  # processes.json lists the one still serving
    lost[node] = "10.0.0.7"
    world.clock.sleep(31.0)  # the next timed check (every 30 s); the new server still starts
    health.check()
    # Re-created: a new actor (placed at once here: the stand-in has room), its server starting.
    assert world.actors_created == 3 and pool._replacing[1].stage == "healthy"
    assert health._restarting_on == {}
    assert manager.down == {1} and left[-1] == [0]
    # The in-place attempt the node loss defeated is not counted: the re-creation is the first
    # of a fresh sequence (a CI run gave up an engine killed twice soon after such a node loss).
    assert health._restarts == {1: 1}
    fault = health._placing[1]
    assert "generator 'generator-1': its node 10.0.0.7" in fault["what"]
    assert "was lost while it restarted (first seen as: generator 'generator-1': Cannot " \
        "connect to host)" in fault["what"]
