"""Elastic generators and lost nodes in the driver's health check (megatron_rl/resilience/
recovery.py GeneratorHealth, docs/fault_tolerance.md "Node failures"): the engines of a lost node
leave the rotation without a restart in place and come back when Ray places them again (the
trainer's weight sync follows the rotation); below rollout.min_generators the run goes on for at
most rollout.engine_start_timeout_s and then stops with exit status 75, naming the checkpoint a
`--resume` loads. The control logic runs for real on a real RolloutLoop; the generator pool, the
rollout manager, the trainer group and Ray's node table are recording stand-ins (the real ones
run in tests/e2e/test_fault_tolerance.py's node-loss test)."""
import dataclasses
import json
import re

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.resilience import checkpoint as run_checkpoint
from megatron_rl.resilience.recovery import (GeneratorHealth, NodeLost, RunStopped,
                                             node_lost_message)
from megatron_rl.rollout.event_loop import RolloutLoop

pytestmark = pytest.mark.unit


@dataclasses.dataclass
class Endpoint:
    name: str
    url: str
    node_id: str
    node_ip: str = "10.0.0.1"

    def describe(self):
        return f"generator {self.name!r} ({self.url})"


class Pool:
    def __init__(self, endpoints):
        self.names = [e.name for e in endpoints]
        self._endpoints = list(endpoints)
        self.connected = set(self.names)
        self.calls, self.placed = [], {}

    def serving(self):
        return {i: e for i, e in enumerate(self._endpoints) if e is not None}

    def unhealthy(self, indices, *, timeout_s):
        return {}

    def restart(self, index):
        self.calls.append(("restart", index))
        raise AssertionError("no restart in place for an engine whose node is gone")

    def replace(self, index):
        self.calls.append(("replace", index))
        self._endpoints[index] = None

    def poll_replacements(self):
        done, self.placed = self.placed, {}
        for index, endpoint in done.items():
            self._endpoints[index] = endpoint
        return done


class Manager:
    def __init__(self, count):
        self.down, self.failures, self.clients = frozenset(), [], [None] * count

    def raise_if_failed(self):
        pass

    def mark_down(self, index, reason):
        if index not in self.down:
            self.down |= {index}
            self.failures.append(dataclasses.make_dataclass(
                "Failure", ["index", "reason", "detected_at", "requeued_groups"])(
                index, reason, 1.0, 3))

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
        self.calls.append(("sync_new", [e.name for e in endpoints], version))
        if connect is not None:  # the main sync rebuilt over the new rotation, in the same call
            self.calls.append(("connect", sorted(e.name for e in connect)))


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


def _health(tmp_path, loop, monkeypatch, lost, *overrides):
    cfg = load_config("examples/configs/tiny_pipeline.yaml", [
        f"output_dir={tmp_path}", "rollout.num_generators=2", *overrides])
    pool = Pool([Endpoint("generator-0", "http://a:1", "node-a"),
                 Endpoint("generator-1", "http://b:1", "node-b")])
    cluster = type("Cluster", (), {})()
    cluster.generators, cluster.trainers, cluster.model_dir = pool, Trainers(), "/model"
    cluster.stop_if_trainer_node_lost = lambda cfg: None
    cluster.lost_nodes = lambda ids: {i: "10.0.0.9" for i in ids if i in lost}
    manager = Manager(2)
    health = GeneratorHealth(cfg, tmp_path, cluster=cluster, loop=loop, manager=manager,
                             clients=[Client("http://a:1"), Client("http://b:1")],
                             math_verifier=None, version=lambda: 7, new_client=Client,
                             on_restarted=lambda: None)
    return health, pool, manager, cluster.trainers


def test_a_lost_generator_node_leaves_the_rotation_and_its_engine_comes_back(tmp_path, loop,
                                                                             monkeypatch):
    lost = {"node-a"}
    health, pool, manager, trainers = _health(tmp_path, loop, monkeypatch, lost,
                                              "rollout.min_generators=1")
    health.check()
    assert manager.down == {0} and pool.calls == [("replace", 0)]  # not restarted in place
    assert health.metrics() == {"rollout/engines_in_rotation": 1.0}
    health.check(now=True)  # before a weight sync: the trainer's sync follows the rotation
    assert trainers.calls == [("connect", ["generator-1"])]
    health.check(now=True)
    assert len(trainers.calls) == 1  # unchanged rotation: no reconnect

    lost.clear()  # Ray placed the bundle on a new node, the new engine started
    pool.placed = {0: Endpoint("generator-0", "http://c:1", "node-c")}
    health.check()
    assert trainers.calls[1:] == [("sync_new", ["generator-0"], 7),
                                  ("connect", ["generator-0", "generator-1"])]
    assert manager.down == frozenset() and manager.clients[0].url == "http://c:1"
    assert health.metrics() == {"rollout/engines_in_rotation": 2.0}
    (fault,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert fault["kind"] == "generator" and "node 10.0.0.9" in fault["what"]
    assert "was lost" in fault["what"] and fault["requeued_groups"] == 3
    assert fault["recovered_at"] >= fault["detected_at"]


def test_a_wait_that_ends_at_once_still_takes_a_placed_engine_back(tmp_path, loop,
                                                                   monkeypatch):
    """The pipeline runs ahead of the trainer: every take finds its groups ready and ends at
    once. The re-created engine still comes back (the node-loss e2e waited 600 s for it while
    the run went on at one step a second on the other engine)."""
    lost = {"node-a"}
    health, pool, manager, trainers = _health(tmp_path, loop, monkeypatch, lost,
                                              "rollout.min_generators=1")
    health.check()
    assert manager.down == {0}
    lost.clear()
    pool.placed = {0: Endpoint("generator-0", "http://c:1", "node-c")}

    async def ready():
        return "groups"

    assert health.wait(ready()) == "groups"
    assert manager.down == frozenset() and ("sync_new", ["generator-0"], 7) in trainers.calls


def test_below_min_generators_the_run_waits_bounded_then_stops_for_a_requeue(tmp_path, loop,
                                                                          monkeypatch):
    health, _, manager, _ = _health(tmp_path, loop, monkeypatch, {"node-b"},
                                    "rollout.engine_start_timeout_s=60",
                                    "rollout.min_generators=2")  # min = num = 2
    health.check()  # 1 of 2: goes on, waiting
    assert manager.down == {1}
    health._below_min_since -= 61  # (the bound has passed)
    with pytest.raises(NodeLost) as stopped:
        health.check()
    assert stopped.value.exit_status == 75 and isinstance(stopped.value, RunStopped)
    message = str(stopped.value)
    assert "only 1 of 2 generator engines" in message and "rollout.min_generators=2" in message
    assert "'generator-1'" in message and "no checkpoint yet" in message


def test_min_generators_is_validated():
    for value, problem in (("0", "must be >= 1"), ("3", "exceeds rollout.num_generators (2)")):
        with pytest.raises(ConfigError, match=f"rollout.min_generators: .*{re.escape(problem)}"):
            load_config("examples/configs/tiny_pipeline.yaml",
                        ["rollout.num_generators=2", f"rollout.min_generators={value}"])
    cfg = load_config("examples/configs/tiny_pipeline.yaml", ["rollout.num_generators=2"])
    assert cfg.rollout.min_engines == 1  # by default the run goes on while one engine serves
    cfg = load_config("examples/configs/tiny_pipeline.yaml",
                      ["rollout.num_generators=2", "rollout.min_generators=null"])
    assert cfg.rollout.min_engines == 2  # null: all of them (no elasticity)


def test_the_node_lost_message_names_the_node_and_the_checkpoint_to_resume(tmp_path):
    cfg = load_config("examples/configs/tiny_pipeline.yaml", [f"output_dir={tmp_path}"])
    staging = tmp_path / "checkpoints" / ".step_000004.partial"
    staging.mkdir(parents=True)
    (staging / "run_state.pkl").write_bytes(b"state")
    run_checkpoint.commit(staging, run_checkpoint.checkpoint_path(tmp_path / "checkpoints", 4),
                          step=4)
    message = node_lost_message(cfg, {"0123456789abcdef": "10.1.2.3"},
                                {"0123456789abcdef": ["trainer rank 0", "the driver"]})
    assert message.startswith("lost node 10.1.2.3 (Ray node id 0123456789ab) with trainer "
                              "rank 0, the driver")
    assert "exit status 75" in message
    assert message.endswith(f"continues from {tmp_path / 'checkpoints' / 'step_000004'}")
