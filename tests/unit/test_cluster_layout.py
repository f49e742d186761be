"""The parts of megatron_rl.cluster that need neither Ray nor SGLang: the placement layout's
bundles and indices (disaggregated and colocated), ClusterSettings' validation, the
torchrun-style rank environments, and the process-group sweep that stops an SGLang server's
children after its leader died. The Ray + SGLang tests are in tests/integration/test_cluster_ray.py.
"""
from __future__ import annotations

import subprocess
import time

import pytest

pytestmark = pytest.mark.unit


def test_layout_bundles_disaggregated_and_colocated():
    from megatron_rl.cluster import ClusterLayout

    layout = ClusterLayout(num_trainer_ranks=2, num_generators=2, devices_per_generator=4,
                           device="gpu", cpus_per_generator=2.0)
    assert layout.bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 2 + [{"CPU": 2.0, "GPU": 4.0}] * 2
    assert [layout.trainer_bundle_index(r) for r in range(2)] == [0, 1]
    assert [layout.generator_bundle_index(g) for g in range(2)] == [2, 3]
    cpu = ClusterLayout(num_trainer_ranks=1, num_generators=1, cpus_per_trainer_rank=0.5)
    assert cpu.bundles() == [{"CPU": 0.5}, {"CPU": 1.0}]
    # Colocated: one shared bundle per trainer GPU; engine i sits in the bundle of its first
    # trainer rank, asks Ray for CPUs only and is given the GPUs of its ranks.
    shared = ClusterLayout(num_trainer_ranks=8, num_generators=2, devices_per_generator=4,
                           device="gpu", colocated=True)
    assert shared.bundles() == [{"CPU": 2.0, "GPU": 1.0}] * 8
    assert shared.generator_bundle_index(1) == 4
    assert list(shared.generator_trainer_ranks(1)) == [4, 5, 6, 7]
    assert shared.generator_resources() == {"CPU": 1.0}
    assert shared.trainer_resources() == {"CPU": 1.0, "GPU": 1.0}
    cpu_shared = ClusterLayout(num_trainer_ranks=1, num_generators=1, colocated=True)
    assert cpu_shared.bundles() == [{"CPU": 2.0}] and cpu_shared.generator_bundle_index(0) == 0
    with pytest.raises(ValueError, match="only colocated"):
        layout.generator_trainer_ranks(0)
    with pytest.raises(ValueError, match="num_trainer_ranks 6"):
        ClusterLayout(num_trainer_ranks=6, num_generators=2, devices_per_generator=4,
                      device="gpu", colocated=True)


def test_cluster_settings_refuse_local_fields_when_joining():
    from megatron_rl.cluster import ClusterSettings
    from megatron_rl.cluster.runtime import _is_loopback_address

    with pytest.raises(ValueError, match="num_cpus, temp_dir: only for a local cluster"):
        ClusterSettings(address="10.0.0.1:6379", num_cpus=4, temp_dir="/tmp/r")
    with pytest.raises(ValueError, match="below 108 bytes"):
        ClusterSettings(temp_dir="/tmp/" + "x" * 60)
    assert ClusterSettings().is_local and not ClusterSettings(address="auto").is_local
    assert _is_loopback_address("127.0.0.1:6379") and _is_loopback_address("localhost:1")
    assert not _is_loopback_address("10.0.0.1:6379") and not _is_loopback_address("auto")


def test_rank_environments_follow_torchrun():
    from megatron_rl.cluster import Rendezvous, WorkerNode, rank_environments

    nodes = [WorkerNode(node_id="a", node_ip="10.0.0.1", gpu_ids=("3",)),
             WorkerNode(node_id="b", node_ip="10.0.0.2", gpu_ids=("0",)),
             WorkerNode(node_id="a", node_ip="10.0.0.1", gpu_ids=("1",))]
    envs = rank_environments(nodes, Rendezvous(master_addr="10.0.0.1", master_port=23456))
    assert [(e.rank, e.local_rank, e.local_world_size) for e in envs] == \
        [(0, 0, 2), (1, 0, 1), (2, 1, 2)]
    assert envs[2].environment() == {
        "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456", "CUDA_VISIBLE_DEVICES": "3,1"}
    cpu = rank_environments([WorkerNode(node_id="a", node_ip="127.0.0.1", gpu_ids=())] * 2,
                            Rendezvous(master_addr="127.0.0.1", master_port=23456))
    assert [e.local_rank for e in cpu] == [0, 1] and "CUDA_VISIBLE_DEVICES" not in \
        cpu[0].environment()


def test_kill_process_group_reaches_members_whose_leader_died():
    """A group whose leader has exited (as an SGLang server whose main process died) still has
    members; the sweep finds them by group id and start time and stops them."""
    import psutil

    from megatron_rl.cluster.processes import kill_process_group, process_group_members

    leader = subprocess.Popen(["sh", "-c", "sleep 120 & sleep 120 & wait"],
                              start_new_session=True)
    started = psutil.Process(leader.pid).create_time()
    deadline = time.monotonic() + 10
    while len(process_group_members(leader.pid, started_after=started)) < 3:
        assert time.monotonic() < deadline, "the group's sleeps did not start"
        time.sleep(0.05)
    leader.kill()
    leader.wait()
    members = process_group_members(leader.pid, started_after=started)
    assert len(members) == 2  # the two sleeps, re-parented, same group
    assert sorted(kill_process_group(leader.pid, started_after=started, timeout_s=5)) == \
        sorted(members)
    assert process_group_members(leader.pid, started_after=started) == []
    # A group that started after the given time is not this one (pid reuse guard).
    assert kill_process_group(leader.pid, started_after=time.time() + 60) == []
