"""A lost node ends the run with exit status 75 and one line naming it, whatever the driver was
doing (issue 37 items 2 and 7; docs/fault_tolerance.md "Node failures"):

- a teardown failure while the NodeLost unwinds (a lost node's engines cannot confirm their
  stop: ClusterError) is reported, and the run still exits 75 with its one line;
- a trainer failure whose node is lost is checked for the loss before a restart is counted, so
  an exhausted train.max_trainer_restarts does not turn it into "restarted N times already";
  a trainer node whose raylet is gone, not yet declared dead, gets Ray's verdict awaited;
- the weight sync's wait for an engine to sync into checks the nodes (it used to wait out
  rollout.engine_start_timeout_s, 15 minutes, with the trainer's node gone);
- a start-up step that fails because a node of the run was lost (ActorDiedError) stops with
  NodeLost naming the node and what it held, not with the actor's traceback.

The control logic runs for real (RunSetup, TrainerRestarts, GeneratorHealth on a real
RolloutLoop, RunCluster.start, train.main); Ray's node table, the cluster's actors, the rollout
manager and the generator pool are recording stand-ins (the real ones run in
tests/e2e/test_fault_tolerance.py's node-loss test).
"""
import dataclasses
import time

import pytest

from megatron_rl.cluster.runtime import ClusterError, node_verdict_s
from megatron_rl.config import load_config
from megatron_rl.resilience.recovery import (GeneratorHealth, NodeLost, RunStopped,
                                             TrainerFailure, TrainerRestarts, node_lost_message)
from megatron_rl.rollout.event_loop import RolloutLoop

pytestmark = pytest.mark.unit

RECIPE = "examples/configs/tiny_pipeline.yaml"
QUIET = ["eval.at_step_zero=false", "eval.interval_steps=0", "logging.progress_bar=false"]


def _cfg(tmp_path, *overrides):
    return load_config(RECIPE, [f"output_dir={tmp_path}", *QUIET, *overrides])


def _lost_message(cfg, held):
    return node_lost_message(cfg, {"feedc0ffee0123456789": "10.0.0.5"},
                             {"feedc0ffee0123456789": held})


# ---------------------------------------------------------------- a failing teardown (2a)

def _train_main(tmp_path, monkeypatch, capsys, *, fail_in: str):
    """`megatron-rl train` whose run registers a teardown that fails as RayCluster.shutdown
    does after a lost node (ClusterError), then loses the trainer's node in its start or in its
    steps. -> (exit status, stderr lines)."""
    from megatron_rl import train
    from megatron_rl.run_setup import RunSetup

    cfg = _cfg(tmp_path)
    lost = NodeLost(_lost_message(cfg, ["trainer rank 0", "generator-1"]))

    def shutdown():
        raise ClusterError("shutdown finished with errors:\n  stopping generators: "
                           "GeneratorError: could not confirm that these servers stopped")

    def start(run):
        run._stack.callback(shutdown)
        if fail_in == "start":
            raise lost

    def steps(run, cfg, stop):
        raise lost

    monkeypatch.setattr(RunSetup, "_start", start)
    monkeypatch.setattr(train, "run_steps", steps)
    status = train.main([RECIPE, f"output_dir={tmp_path}", *QUIET])
    return status, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("fail_in", ["start", "steps"])
def test_a_failing_teardown_does_not_replace_the_node_loss(tmp_path, monkeypatch, capsys,
                                                           fail_in):
    status, lines = _train_main(tmp_path, monkeypatch, capsys, fail_in=fail_in)
    assert status == 75, lines
    stopped = [line for line in lines if line.startswith("megatron-rl train: stopped:")]
    assert len(stopped) == 1 and "lost node 10.0.0.5" in stopped[0], lines
    assert "trainer rank 0, generator-1" in stopped[0]
    # The teardown's failure is one line of its own, after NodeLost, not a traceback.
    teardown = [line for line in lines if "stopping the run's processes after NodeLost" in line]
    assert len(teardown) == 1 and "could not confirm" in teardown[0], lines
    assert not any("Traceback" in line for line in lines)


def test_a_teardown_failure_of_a_finished_run_is_one_line_and_exit_1(tmp_path, monkeypatch,
                                                                      capsys):
    from megatron_rl import train

    def failing_train(cfg):
        raise ClusterError("shutdown finished with errors:\n  ray.shutdown(): boom")

    monkeypatch.setattr(train, "train", failing_train)
    assert train.main([RECIPE, f"output_dir={tmp_path}"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "megatron-rl train: error: shutdown finished with errors: ray.shutdown(): boom"]


# ---------------------------------------------------------------- trainer restarts (2b)

class LostTrainerCluster:
    """RunCluster's node check, with the trainer's node lost (`lost`) or not."""

    def __init__(self, cfg, lost: bool):
        self.cfg, self.lost, self.checks = cfg, lost, 0

    def stop_if_trainer_node_lost(self, cfg):
        self.checks += 1
        if self.lost:
            raise NodeLost(_lost_message(cfg, ["trainer rank 0"]))

    def restart_trainers(self, cfg):
        raise AssertionError("a restart was attempted")


@pytest.mark.parametrize("limit", [0, 3])
def test_a_lost_trainer_node_is_checked_before_a_restart_is_counted(tmp_path, limit):
    from megatron_rl.run_setup import RunSetup

    cfg = _cfg(tmp_path, f"train.max_trainer_restarts={limit}")
    run = RunSetup(cfg)
    run.cluster = LostTrainerCluster(cfg, lost=True)
    run.trainer_restarts = TrainerRestarts(cfg, tmp_path)
    with pytest.raises(NodeLost) as stopped:
        run.recover_trainers(TrainerFailure("ActorDiedError: the actor died"))
    assert stopped.value.exit_status == 75 and "lost node 10.0.0.5" in str(stopped.value)
    assert run.trainer_restarts.count == 0 and run.cluster.checks == 1  # no restart used up


def test_past_the_restart_limit_a_live_node_stops_the_run_as_before(tmp_path):
    cfg = _cfg(tmp_path, "train.max_trainer_restarts=1")
    restarts, cluster = TrainerRestarts(cfg, tmp_path), LostTrainerCluster(cfg, lost=False)

    def begin():
        return restarts.begin(TrainerFailure("ActorDiedError"), failed_step=3,
                              stop_if_node_lost=lambda: cluster.stop_if_trainer_node_lost(cfg))

    begin()
    assert restarts.count == 1
    with pytest.raises(RunStopped, match="restarted 1 time"):
        begin()
    assert cluster.checks == 2


class RayNodes:
    """Ray's node table (ray.nodes()) for the real RunCluster.stop_if_trainer_node_lost: the
    trainer's node alive to the GCS until `declared` calls from now, its raylet refusing
    connections (a closed port) meanwhile."""

    def __init__(self, declared: int):
        import socket

        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            self.closed_port = probe.getsockname()[1]
        self.declared, self.asked = declared, 0

    def __call__(self):
        self.asked += 1
        alive = self.asked <= self.declared
        return [{"NodeID": "trainer-node-0123", "Alive": alive,
                 "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": self.closed_port},
                {"NodeID": "head-node", "Alive": True, "NodeManagerAddress": "127.0.0.1",
                 "NodeManagerPort": self.closed_port + 0}]


def test_a_trainer_node_whose_raylet_is_gone_is_waited_for_until_ray_declares_it(
        tmp_path, monkeypatch):
    """The rank's death arrived first; the GCS declares the node dead a few checks later. The
    node check waits for that verdict (a closed raylet port) instead of letting a restart be
    counted; the head's raylet answers (a listening socket)."""
    import socket

    import ray

    from megatron_rl.cluster.launch import RunCluster

    monkeypatch.setattr("megatron_rl.resilience.stop.WAIT_SLICE_S", 0.01)
    table = RayNodes(declared=3)
    with socket.socket() as head_raylet:
        head_raylet.bind(("127.0.0.1", 0))
        head_raylet.listen()
        head_port = head_raylet.getsockname()[1]

        def nodes():
            rows = table()
            rows[1]["NodeManagerPort"] = head_port
            return rows

        monkeypatch.setattr(ray, "nodes", nodes)
        monkeypatch.setattr(ray, "get_runtime_context", lambda: type(
            "Context", (), {"get_node_id": lambda self: "head-node"})())
        rank = type("Rank", (), {"node_id": "trainer-node-0123", "node_ip": "127.0.0.1"})()
        cluster = RunCluster.__new__(RunCluster)
        cluster.trainers = type("Trainers", (), {"nodes": [rank]})()
        cluster.generators = type("Pool", (), {"endpoints": []})()
        cluster.placement = type("Placement", (), {
            "bundle_nodes": lambda self: {0: "trainer-node-0123"}})()
        cluster.layout = type("Layout", (), {"trainer_bundle_index": lambda self, r: r})()
        cfg = _cfg(tmp_path)
        with pytest.raises(NodeLost, match="with trainer rank 0"):
            cluster.stop_if_trainer_node_lost(cfg)
    assert table.asked > 3  # asked again until the GCS's verdict


# ---------------------------------------------------------------- the sync wait (7)

@dataclasses.dataclass
class Endpoint:
    name: str
    url: str
    node_id: str
    node_ip: str = "10.0.0.1"

    def describe(self):
        return f"generator {self.name!r} ({self.url})"


class Pool:
    """Generator pool whose engines wait to be placed again; polling them is where the
    trainer's node goes (`on_poll`)."""

    def __init__(self, endpoints, on_poll):
        self.names = [e.name for e in endpoints]
        self._endpoints, self.on_poll = list(endpoints), on_poll
        self.connected = set(self.names)

    def serving(self):
        return {i: e for i, e in enumerate(self._endpoints) if e is not None}

    def unhealthy(self, indices, *, timeout_s):
        return {}

    def replace(self, index):
        self._endpoints[index] = None

    def poll_replacements(self):
        self.on_poll()
        return {}


class Manager:
    def __init__(self, count):
        self.down, self.failures = frozenset(), []

    def raise_if_failed(self):
        pass

    def mark_down(self, index, reason):
        if index not in self.down:
            self.down |= {index}
            self.failures.append(dataclasses.make_dataclass(
                "Failure", ["index", "reason", "detected_at", "requeued_groups"])(
                index, reason, 1.0, 0))

    def take_failures(self):
        failures, self.failures = self.failures, []
        return failures

    async def check_liveness(self, timeout_s):
        return {}


class Client:
    def __init__(self, url):
        self.url = url

    async def close(self):
        pass


def test_the_sync_wait_for_an_engine_stops_at_once_when_the_trainer_node_is_lost(
        tmp_path, monkeypatch):
    """Both engines' nodes are gone, so the weight sync waits for one to come back; meanwhile
    the trainer's node goes too. The wait ends with NodeLost naming the trainer's node, long
    before rollout.engine_start_timeout_s (which used to be the only way out)."""
    monkeypatch.setattr("megatron_rl.resilience.stop.WAIT_SLICE_S", 0.01)
    cfg = _cfg(tmp_path, "rollout.num_generators=2", "rollout.min_generators=1",
               "rollout.engine_start_timeout_s=20")
    lost = {"node-a", "node-b"}
    trainer_lost, syncing = [], []

    def stop_if_trainer_node_lost(cfg):
        if trainer_lost:
            raise NodeLost(_lost_message(cfg, ["trainer rank 0", "the driver"]))

    pool = Pool([Endpoint("generator-0", "http://a:1", "node-a"),
                 Endpoint("generator-1", "http://b:1", "node-b")],
                on_poll=lambda: trainer_lost.extend(syncing))  # lost while the sync waits
    cluster = type("Cluster", (), {})()
    cluster.generators, cluster.model_dir = pool, "/model"
    cluster.stop_if_trainer_node_lost = stop_if_trainer_node_lost
    cluster.lost_nodes = lambda ids, within_s=0.0: {i: "10.0.0.9" for i in ids if i in lost}
    loop = RolloutLoop()
    try:
        health = GeneratorHealth(cfg, tmp_path, cluster=cluster, loop=loop,
                                 manager=Manager(2),
                                 clients=[Client("http://a:1"), Client("http://b:1")],
                                 math_verifier=None, version=lambda: 3, new_client=Client,
                                 on_restarted=lambda: None)
        health.check()  # both engines leave the rotation, to be placed again
        assert health.in_rotation() == 0 and not trainer_lost
        started = time.monotonic()
        syncing.append(True)
        with pytest.raises(NodeLost) as stopped:
            health.check(now=True)  # before a weight sync: waits for an engine
        assert time.monotonic() - started < 10  # not rollout.engine_start_timeout_s (20 s)
    finally:
        loop.stop()
    assert "lost node 10.0.0.5" in str(stopped.value) and "trainer rank 0" in str(stopped.value)


# ---------------------------------------------------------------- start-up (7)

class StartCluster:
    """RayCluster.start's stand-in: a placement whose bundles were reserved on `placed`."""

    def __init__(self, placed):
        self.placed, self.stopped = placed, False

    def reserve(self, layout, *, name=""):
        placement = type("Placement", (), {})()
        placement.layout, placement.bundle_nodes = layout, lambda: dict(self.placed)
        return placement

    def shutdown(self):
        self.stopped = True


def _start_cluster(tmp_path, monkeypatch, *, failure, lost, placed):
    """RunCluster.start on stand-ins whose engines' start fails with `failure` while the nodes
    `lost` are gone. -> (what it raised, the waits for Ray's verdict)."""
    import contextlib

    import ray

    from megatron_rl import cluster as cluster_package
    from megatron_rl.cluster.launch import RunCluster

    cfg = _cfg(tmp_path, "rollout.num_generators=2", "model.hf_checkpoint=/model")
    ray_cluster = StartCluster(placed)
    waits = []

    def lost_nodes(ids, within_s=0.0):
        waits.append(within_s)
        return {i: "10.0.0.7" for i in ids if i in lost}

    def unreachable_nodes(ids):  # a lost node's raylet refuses connections
        return {i for i in ids if i in lost}

    def engines_start(placement, settings, **waits):
        raise failure

    monkeypatch.setattr(cluster_package.RayCluster, "start", lambda settings: ray_cluster)
    monkeypatch.setattr(cluster_package.GeneratorPool, "start", engines_start)
    monkeypatch.setattr("megatron_rl.cluster.launch.server_settings", lambda *a: [])
    monkeypatch.setattr("megatron_rl.cluster.runtime.lost_nodes", lost_nodes)
    monkeypatch.setattr("megatron_rl.cluster.runtime.unreachable_nodes", unreachable_nodes)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type(
        "Context", (), {"get_node_id": lambda self: "head-node-id"})())
    with contextlib.ExitStack() as stack, pytest.raises(Exception) as raised:
        RunCluster.start(cfg, tmp_path, stack, start_checkpoint=lambda model_dir: "/ckpt")
    assert ray_cluster.stopped  # the teardown ran
    return raised.value, waits


def test_a_node_lost_during_the_start_stops_with_node_lost_naming_what_it_held(tmp_path,
                                                                               monkeypatch):
    import ray

    died = ray.exceptions.ActorDiedError()
    mixed = "mixed-node-0123456789"
    stopped, waits = _start_cluster(tmp_path, monkeypatch, failure=died, lost={mixed},
                                    placed={0: mixed, 1: "gen-node", 2: mixed})
    assert isinstance(stopped, NodeLost) and stopped.exit_status == 75, stopped
    assert stopped.__cause__ is died
    message = str(stopped)
    assert "\n" not in message
    assert f"lost node 10.0.0.7 (Ray node id {mixed[:12]}) with trainer rank 0, generator-1" \
        in message and "no checkpoint yet" in message
    assert waits == [node_verdict_s()]  # its raylet is gone: Ray's verdict awaited


def test_a_start_failure_without_a_lost_node_is_left_as_it_was(tmp_path, monkeypatch):
    failure = ValueError("a bad model")
    raised, waits = _start_cluster(tmp_path, monkeypatch, failure=failure, lost=set(),
                                   placed={0: "a", 1: "b", 2: "c"})
    assert raised is failure
    assert waits == [0.0]  # every raylet answers: checked once, no wait
