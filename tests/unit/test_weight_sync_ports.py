"""Each pipeline stage's weight-sync sender listens on a port picked on its own host (issue 39.5).

Stages sit on different hosts; a port rank 0 found free on its host, plus the stage number, is a
port nobody checked on the stage's host. The transport is built as WeightSync builds it
(`_make_transport`, a real one-rank gloo world and its store); only the port picker records which
host it was asked about, standing in for two hosts on one machine.
"""
import pytest
import torch.distributed as dist

from megatron_rl.rollout import sglang_server
from megatron_rl.weight_sync import WeightSync, WeightSyncGroups, WeightSyncSettings
from megatron_rl.weight_sync.sync import sender_port
from megatron_rl.weight_sync.transport import sender_store

pytestmark = pytest.mark.unit

# The port each (pretend) host finds free: 10.0.0.1 runs stage 0, 10.0.0.2 stage 1.
HOST_PORTS = {"10.0.0.1": 21000, "10.0.0.2": 23000}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("world") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _groups(pp_rank: int, *, sender_rank: int = 0, pp_size: int = 2) -> WeightSyncGroups:
    return WeightSyncGroups(pp_rank=pp_rank, tp_rank=0, tp_size=1, etp_rank=0, etp_size=1,
                            sender_rank=sender_rank, pp_size=pp_size)


def _transport(settings: WeightSyncSettings, groups: WeightSyncGroups):
    sync = object.__new__(WeightSync)
    sync.settings, sync.groups, sync.generators = settings, groups, []
    return sync._make_transport()


def test_a_stage_sender_listens_on_the_port_free_on_its_own_host(world, monkeypatch):
    asked = []

    def listen_port(host="127.0.0.1", **_):
        asked.append(host)
        return HOST_PORTS[host]

    monkeypatch.setattr(sglang_server, "listen_port", listen_port)
    # Stage 1's sender runs on 10.0.0.2 (master_address is its own node's address,
    # cluster/trainers.py); this process is its global rank 0 (a one-rank world).
    transport = _transport(WeightSyncSettings(master_address="10.0.0.2", backend="gloo"),
                           _groups(pp_rank=1))
    assert asked == ["10.0.0.2"]
    # The port its host said was free, not that port + the stage number (main's 23001).
    assert transport.group.master_port == HOST_PORTS["10.0.0.2"]
    assert transport.group.master_address == "10.0.0.2"
    # Published in the trainer world's store under the group's name.
    store = dist.distributed_c10d._get_default_store()
    assert int(store.get(f"{transport.group.group_name}/master_port")) == 23000


def test_the_stages_other_ranks_read_the_senders_port_from_the_store(monkeypatch):
    monkeypatch.setattr(sglang_server, "listen_port", lambda host="127.0.0.1", **_: 24567)
    store = dist.HashStore()
    settings = WeightSyncSettings(master_address="10.0.0.2")

    class _Rank:  # stands for dist.get_rank() on two ranks of stage 1
        rank = 0

    monkeypatch.setattr(dist, "get_rank", lambda: _Rank.rank)
    assert sender_port(settings, _groups(1, sender_rank=0), name="w_pp1", store=store) == 24567
    _Rank.rank = 1  # a tensor-parallel peer of the sender: picks nothing, reads the store
    monkeypatch.setattr(sglang_server, "listen_port", lambda *a, **k: pytest.fail("picked"))
    assert sender_port(settings, _groups(1, sender_rank=0), name="w_pp1", store=store) == 24567


def test_a_given_port_is_taken_per_stage():
    settings = WeightSyncSettings(master_port=29600)
    store = dist.HashStore()
    assert [sender_port(settings, _groups(p), name="w", store=store) for p in (0, 1, 2)] \
        == [29600, 29601, 29602]


def test_the_picked_port_binds_on_the_senders_host(world):
    """With the real picker: the sender's rendezvous store binds the port (loopback host)."""
    transport = _transport(WeightSyncSettings(master_address="127.0.0.1", backend="gloo",
                                              timeout_s=5), _groups(pp_rank=1))
    store = sender_store(transport.group, timeout_s=5)
    store.set("probe", "1")
    assert store.get("probe") == b"1"
