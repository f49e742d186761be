"""The seam (cluster/backend.py) and the simulated cluster behind it (simulation/cluster.py): the
real driver's default is the real cluster; resilience/, rollout/ and validation import nothing of
cluster/ or simulation/; the simulated pool and trainer group do what GeneratorHealth and the
driver rely on (health over HTTP, non-blocking restarts, the weight push advancing every engine's
version, the node table, checkpoints). The engines are the simulated SGLang servers themselves,
in this process."""
from __future__ import annotations

import ast
import contextlib
import time
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.scaling.cost import PRESETS

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_layers_above_the_seam_import_neither_cluster_nor_simulation():
    """resilience/, rollout/ and validation.py talk to the cluster object they are handed:
    importing cluster/ (Ray's node table, as recovery.py did) or simulation/ would tie them to
    one backend, and make an import point up."""
    files = [*(PACKAGE / "resilience").glob("*.py"), *(PACKAGE / "rollout").glob("*.py"),
             PACKAGE / "validation.py"]
    reaching = {f"{path.parent.name}/{path.name}": sorted(
        m for m in _imports(path) if m.startswith(("megatron_rl.cluster",
                                                   "megatron_rl.simulation")))
                for path in files}
    assert {name: found for name, found in reaching.items() if found} == {}


def test_train_and_the_demo_get_the_real_cluster_by_default():
    from megatron_rl.cluster.backend import RayBackend
    from megatron_rl.run_setup import RunSetup

    assert type(RunSetup(load_config("examples/configs/tiny_pipeline.yaml", [])).backend) \
        is RayBackend


@pytest.fixture
def cluster(tmp_path):
    from megatron_rl.simulation.cluster import SimulatedCluster, SimulationSettings
    from megatron_rl.simulation.simulate import stand_in_model

    model = stand_in_model(tmp_path / "model", context=4096)
    cfg = load_config("examples/configs/tiny_pipeline.yaml", [
        f"output_dir={tmp_path}", f"model.hf_checkpoint={model}", "rollout.num_generators=3",
        "rollout.health_check_timeout_s=2", "weight_sync.timeout_s=1"])
    with contextlib.ExitStack() as stack:
        yield SimulatedCluster.start(cfg, tmp_path, stack, SimulationSettings(
            hardware="H100", model=PRESETS["paper-8b"], time_scale=1000.0,
            engines_per_node=2))


def test_the_weight_push_sets_every_engines_version_over_its_http_api(cluster):
    engines = cluster.generators.engines
    assert {e.weight_version for e in engines} == {0}
    report = cluster.trainers.sync_weights()
    assert report.version == 1 and {e.weight_version for e in engines} == {1}
    assert cluster.trainers.sync_weights().version == 2
    assert {e.weight_version for e in engines} == {2}
    # Each engine timed the bucket of the generator weights (bytes / its link).
    expected = cluster.engine_timing.weight_load_seconds(report.num_bytes)
    assert all(e.stats.busy_model_s >= 2 * expected * 0.99 for e in engines)


def test_a_dead_engine_is_seen_restarted_without_waiting_and_caught_up(cluster):
    from megatron_rl.rollout import GeneratorDeadError

    pool = cluster.generators
    assert pool.unhealthy() == {}
    old_url = pool.engines[1].url
    cluster.loop.call(pool.engines[1].kill())
    problems = pool.unhealthy()
    assert list(problems) == [1] and isinstance(problems[1], GeneratorDeadError)
    pool.restart(1)
    assert 1 not in pool.serving()  # out of the rotation while it starts
    deadline, back = time.monotonic() + 30, {}
    while not back and time.monotonic() < deadline:
        back = pool.poll_replacements()
        time.sleep(0.01)
    assert list(back) == [1] and back[1].url != old_url and pool.serving()[1] == back[1]
    assert pool.unhealthy() == {}
    cluster.trainers.sync_new_generators([back[1]], cluster.model_dir, 5,
                                         connect=pool.endpoints)
    assert pool.engines[1].weight_version == 5


def test_the_node_table_and_a_lost_trainer_node(cluster, tmp_path):
    from megatron_rl.resilience.recovery import NodeLost

    nodes = [e.node_id for e in cluster.generators.endpoints]
    assert nodes[0] == nodes[1] != nodes[2]  # two engines a node
    assert cluster.lost_nodes(nodes) == {}
    cluster.lose_node(nodes[0])
    assert cluster.lost_nodes(nodes) == {nodes[0]: cluster.generators.endpoints[0].node_ip}
    assert not cluster.generators.engines[0].alive and not cluster.generators.engines[1].alive
    cluster.generators.restart(0)  # re-created on a spare node
    while not cluster.generators.poll_replacements():
        time.sleep(0.01)
    assert cluster.generators.serving()[0].node_id not in nodes
    cluster.stop_if_trainer_node_lost(cluster.cfg)  # the trainer's node is fine
    cluster.lose_node(cluster.trainers.nodes[0].node_id)
    with pytest.raises(NodeLost, match="trainer rank 0"):
        cluster.stop_if_trainer_node_lost(cluster.cfg)


def test_trainer_checkpoints_round_trip(cluster, tmp_path):
    trainers = cluster.trainers
    trainers.sync_weights()
    assert trainers.save_checkpoint(str(tmp_path / "ckpt"), {"step": 3}) is False  # synchronous
    trainers.sync_weights()
    state = trainers.load_checkpoint(str(tmp_path / "ckpt"))
    assert state["extra_state"] == {"step": 3} and trainers.version == 1
    assert trainers.modelled_s["checkpoint"] == pytest.approx(
        2 * cluster.trainer_timing.checkpoint_seconds())


def test_a_restart_takes_the_modelled_start_time(cluster):
    """Not instant: the engine serves EngineTiming.start_seconds (launch + the weights from
    disk) of model time after the restart was asked for."""
    pool = cluster.generators
    pool.restart(0)
    while not pool.poll_replacements():
        time.sleep(0.01)
    [record] = pool.restarts
    expected = cluster.engine_timing.launch_seconds + cluster.engine_timing.disk_load_seconds()
    assert cluster.engine_timing.start_seconds() == expected
    assert record["up_model_s"] - record["asked_model_s"] >= expected
    assert record["index"] == 0 and pool.engines[0].alive


def test_a_hung_engine_fails_the_sync_as_a_weight_sync_error_and_the_others_go_on(cluster):
    """The real WeightPusher restarts a generator that failed a sync only on WeightSyncError;
    the engines that answered leave the failed sync (session ended, generation continued), so
    that the retry over the others succeeds."""
    from megatron_rl.weight_sync.sync import WeightSyncError

    pool, trainers = cluster.generators, cluster.trainers
    cluster.loop.run(pool.engines[2].hang)
    with pytest.raises(WeightSyncError, match=r"1 of 3 engine\(s\) failed at /pause_generation"):
        trainers.sync_weights()
    healthy = pool.engines[:2]
    assert not any(e.paused for e in healthy)
    trainers.connect_generators(pool.endpoints[:2], hf_config_dir=cluster.model_dir)
    assert trainers.sync_weights().version == 1
    assert [e.weight_version for e in pool.engines] == [1, 1, 0]


def test_a_trainer_call_fails_when_its_node_is_lost(cluster, tmp_path):
    """As a Ray actor's death fails the real group's call: TrainerFailure, which the driver
    turns into NodeLost once the node table says the node is gone."""
    from megatron_rl.resilience.recovery import TrainerFailure

    trainers = cluster.trainers
    cluster.lose_node(trainers.nodes[0].node_id)
    with pytest.raises(TrainerFailure, match="lost node"):
        trainers.save_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(TrainerFailure, match="lost node"):
        trainers.sync_weights()

