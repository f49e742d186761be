"""The in-flight weight update (megatron_rl.weight_sync.sync, docs/generators.md): the order of the
generator calls, retries while the generators stay paused, never continuing after a partial
load, the prefix-cache flush per pause mode; and the SGLang client's side of it (no version on a
bucket, /update_weight_version without aborting, extra_key, the overlap-schedule flag, a failed
generator refusing calls); the version a retry publishes; the colocated transport never writing
memory it handed over; the distributed transport's time split. One process: a world of one gloo
rank, a recording generator behind the real colocated-tensor transport, the real bucket plan, and
a stand-in for the Megatron gather."""
import http.server
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_rl.rollout import (GenerationResult, GeneratorDeadError, GeneratorError,
                                 SamplingParams, SGLangGenerator, SGLangServerSettings, TensorSpec)
from megatron_rl.rollout.generator import Generator
from megatron_rl.weight_sync import (Arena, TensorTransport, WeightSync, WeightSyncError,
                                     WeightSyncGroups, WeightSyncSettings, plan_buckets)
from models.convert_common import fused_qkv, renamed

pytestmark = pytest.mark.unit

SHAPES = {"emb": (10, 4), "qkv": (16, 4), "norm": (4,), "head": (10, 4)}


class Recorder(Generator):
    """Records every call, as a generator engine would see them. `fail_bucket(n)` may return an
    exception to raise on the n-th bucket it receives (0-based, over the whole test); `busy`:
    requests are paused in place, so a flush is refused (as SGLang does) unless the pause mode
    retracted or aborted them."""

    def __init__(self, *, fail_bucket=lambda n: None, busy=False, fail_flush=False):
        self.calls: list[tuple] = []
        self.fail_bucket = fail_bucket
        self.busy = busy
        self.fail_flush = fail_flush
        self.num_buckets = 0
        self._version = 0
        self._mode = None

    num_ranks = property(lambda self: 1)
    weight_version = property(lambda self: self._version)
    url = "http://generator-a:30000"

    def check_health(self):
        if self.failure is not None:
            raise GeneratorDeadError(f"{self.url} was failed: {self.failure}")
        self.calls.append(("health",))

    def pause(self, mode="in_place"):
        self._mode = mode
        self.calls.append(("pause", mode))

    def begin_weight_update(self):
        self.calls.append(("begin",))

    def update_weights_from_tensors(self, named_tensors, *, version=None, flush_cache=True):
        index, self.num_buckets = self.num_buckets, self.num_buckets + 1
        self.calls.append(("bucket", version, flush_cache))
        error = self.fail_bucket(index)
        if error is not None:
            raise error

    def set_weight_version(self, version):
        self._version = version
        self.calls.append(("version", version))

    def end_weight_update(self):
        self.calls.append(("end",))

    def flush_cache(self):
        self.calls.append(("flush",))
        if self.fail_flush or (self.busy and self._mode not in ("retract", "abort")):
            raise GeneratorError("Cache not flushed because there are pending requests")

    def resume(self):
        self.calls.append(("resume",))

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]

    def _unused(self, *args, **kwargs):
        raise AssertionError("not part of a colocated sync")

    generate = score = abort = init_weight_update_group = destroy_weight_update_group = _unused
    update_weights_from_distributed = update_weights_from_disk = _unused


class _Gatherer:
    """Stands in for StageGatherer on a single rank: full tensors of known values."""

    device = torch.device("cpu")

    def participates(self, names) -> bool:
        return True

    def gather(self, names, *, into=None, arena=None):
        full = {name: torch.full(SHAPES[name], float(i)) for i, name in enumerate(names)}
        for name, slot in (into or {}).items():
            slot.copy_(full[name])
            full[name] = slot
        return full


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("world") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sync(generators, **settings) -> WeightSync:
    """A WeightSync over the real bucket plan (4 buckets) and the colocated-tensor transport;
    only the Megatron gather is a stand-in."""
    groups = [renamed("embed", "emb"),
              fused_qkv("q", "k", "v", "qkv", num_attention_heads=2, num_query_groups=1),
              renamed("norm_w", "norm"), renamed("lm_head", "head")]
    sync = object.__new__(WeightSync)
    sync.settings = WeightSyncSettings(transport="tensor", bucket_bytes=160, timeout_s=10,
                                       **settings)
    sync.generators = list(generators)
    sync.groups = WeightSyncGroups(pp_rank=0, tp_rank=0, tp_size=1, etp_rank=0, etp_size=1,
                                   sender_rank=0)
    sync.gatherer = _Gatherer()
    sync.mapping = groups
    sync.plan = plan_buckets(groups, lambda n: torch.empty(SHAPES[n], device="meta"),
                             bucket_bytes=160)
    sync.arena = Arena()
    sync._buffers = []
    sync.version = 0
    sync._make_transport = lambda: TensorTransport(sync.generators, timeout_s=10)
    sync.transport = sync._make_transport()
    assert len(sync.plan) == 4
    return sync


BUCKETS = [("bucket", None, False)] * 4


def test_in_place_update_order_no_bucket_version_no_flush_while_requests_run(world):
    """health -> pause in place -> begin -> buckets (flush_cache false, no version) -> version
    -> end -> continue; the flush is refused while requests are paused in place."""
    generator = Recorder(busy=True)
    sync = _sync([generator])
    report = sync.sync()
    assert generator.calls == [("health",), ("pause", "in_place"), ("begin",), *BUCKETS,
                               ("version", 1), ("end",), ("flush",), ("resume",)]
    assert report.version == sync.version == generator.weight_version == 1
    assert not report.cache_flushed and report.attempts == 1 and report.num_buckets == 4
    # An idle generator's prefix cache is dropped (nothing runs on it).
    idle = Recorder()
    assert _sync([idle]).sync().cache_flushed


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_retract_and_abort_flush_before_continuing(world, mode):
    """Their requests re-prefill after the update: the cache of the old weights must go first
    (SGLang accepts the flush then: nothing is running)."""
    generator = Recorder(busy=True)
    report = _sync([generator], pause_mode=mode).sync()
    assert generator.calls[-4:] == [("version", 1), ("end",), ("flush",), ("resume",)]
    assert generator.calls[1] == ("pause", mode) and report.cache_flushed
    # A flush that keeps failing: resuming would reuse KV of the old weights, so the generator
    # is failed instead, paused, and named.
    stuck = Recorder(fail_flush=True)
    with pytest.raises(WeightSyncError, match="generator-a:30000 could not finish the update"):
        _sync([stuck], pause_mode=mode).sync()
    assert "resume" not in stuck.names() and stuck.names().count("flush") == 3
    assert stuck.failure is not None


def test_a_failed_load_is_retried_while_the_generators_stay_paused(world):
    # The second bucket fails once: two buckets of version 1 are half loaded.
    generator = Recorder(fail_bucket=lambda n: GeneratorError("receive failed") if n == 1
                         else None)
    sync = _sync([generator])
    report = sync.sync()
    names = generator.names()
    # Paused throughout: one pause, one begin, no continue before every bucket has loaded.
    assert names.count("pause") == 1 and names.count("begin") == 1
    assert names == ["health", "pause", "begin"] + ["bucket"] * 2 + ["bucket"] * 4 + \
        ["version", "end", "flush", "resume"]
    assert report.attempts == 2 and report.version == 1 and report.num_buckets == 4


def test_a_load_that_keeps_failing_fails_the_generator_and_never_continues(world):
    # Two buckets load, then every bucket fails: a partial load that no retry completes.
    generator = Recorder(fail_bucket=lambda n: GeneratorError("receive failed") if n >= 2
                         else None)
    sync = _sync([generator])
    with pytest.raises(WeightSyncError) as raised:
        sync.sync()
    message = str(raised.value)
    assert "attempt 1" in message and "attempt 3" in message and "receive failed" in message
    assert "generator-a:30000" in message and "partially loaded" in message
    names = generator.names()
    # Three attempts (3 + 1 + 1 buckets); the session is closed (a full update may begin
    # later) but the generator is never continued, never relabelled.
    assert names.count("bucket") == 5 and "resume" not in names and "version" not in names
    assert names[-1] == "end" and sync.version == 0 and generator.weight_version == 0
    assert "receive failed" in generator.failure
    with pytest.raises(WeightSyncError, match="was failed"):
        sync.sync()  # the next sync's health check names the failed generator


def test_a_dead_generator_is_not_retried(world):
    generator = Recorder(fail_bucket=lambda n: GeneratorDeadError("http://generator-a:30000 "
                                                                  "does not answer"))
    with pytest.raises(WeightSyncError, match="a generator is dead"):
        _sync([generator]).sync()
    assert generator.names().count("bucket") == 1 and "resume" not in generator.names()


def test_a_failure_before_any_bucket_continues_on_the_old_weights(world):
    """Nothing reached the generator: close the session and continue; version unchanged."""
    generator = Recorder()
    sync = _sync([generator])

    def refuse():
        raise ConnectionError("no route to the generator")

    sync.transport.connect = refuse
    sync._make_transport = lambda: sync.transport
    with pytest.raises(WeightSyncError, match="nothing reached the generators; they stay at "
                                              "version 0"):
        sync.sync()
    assert generator.names() == ["health", "pause", "begin", "end", "resume"]
    assert generator.failure is None and sync.version == 0


class _EndRefused(Recorder):
    """Loads every bucket, then refuses `end_weight_update` the first `times` times."""

    def __init__(self, times: int):
        super().__init__()
        self.refusals = times

    def end_weight_update(self):
        super().end_weight_update()
        if self.refusals:
            self.refusals -= 1
            raise GeneratorError("end_weight_update refused")


def test_a_retry_after_a_failed_end_publishes_the_next_version_once(world):
    """Issue 29.7a. Every bucket loaded but the generator could not end the update: the sync
    fails without advancing the version (as every failed sync), and the retry (after the driver
    restarted the failed generator) labels the same new weights v + 1 again, not v + 2, which the
    admission gate would refuse (it has seen one optimizer step, not two)."""
    generator = _EndRefused(times=3)  # update_attempts = 3: every attempt at ending fails
    sync = _sync([generator])
    with pytest.raises(WeightSyncError, match="ending the update"):
        sync.sync()
    assert generator.failure is not None and generator.names().count("end") == 3
    assert sync.version == 0
    generator._failure = None  # restarted: the same client reaches a fresh engine
    report = sync.sync()
    assert report.version == sync.version == generator.weight_version == 1
    assert sync.sync().version == 2


class _Keeper(Recorder):
    """Keeps every tensor it was handed with its value at hand-over, as an engine does whose
    copies from that memory may still be queued on the GPU when it replies."""

    def __init__(self):
        super().__init__()
        self.kept: list[list[tuple[str, torch.Tensor, torch.Tensor]]] = []

    def update_weights_from_tensors(self, named_tensors, *, version=None, flush_cache=True):
        super().update_weights_from_tensors(named_tensors, version=version,
                                            flush_cache=flush_cache)
        self.kept.append([(name, t, t.clone()) for name, t in named_tensors])


class _NewValues(_Gatherer):
    """Every gather gives new values, so a bucket written over another one shows."""

    def __init__(self):
        self.num_gathers = 0

    def gather(self, names, *, into=None, arena=None):
        self.num_gathers += 1
        full = {name: torch.full(SHAPES[name], 10.0 * self.num_gathers + i)
                for i, name in enumerate(names)}
        for name, slot in (into or {}).items():
            slot.copy_(full[name])
            full[name] = slot
        return full


def test_tensor_transport_never_writes_memory_it_handed_to_the_engine(world):
    """Issue 30.7: SGLang replies to /update_weights_from_tensor after a CPU barrier, so the
    engine may still read a bucket after its reply; no later bucket (of this sync or the next)
    may be written into memory already handed over."""
    generator = _Keeper()
    sync = _sync([generator])
    sync.gatherer = _NewValues()
    sync.sync()
    sync.sync()  # bucket memory kept from the first sync must not come back either
    assert len(generator.kept) == 8
    for bucket in generator.kept:
        for name, tensor, at_hand_over in bucket:
            assert torch.equal(tensor, at_hand_over), f"{name} was overwritten after hand-over"
    storages = {tensor.untyped_storage().data_ptr()
                for bucket in generator.kept for _, tensor, _ in bucket}
    assert len(storages) == len(generator.kept)  # one memory block per bucket


def test_distributed_transfer_time_waits_for_the_device(monkeypatch):
    """Minor of issue 30: an NCCL broadcast returns once queued, so the sender waits for the
    device before reading the clock; otherwise the transfer shows ~0 s and the generators' load
    time absorbs it. The GPU's queue is simulated: the broadcast returns at once and the wait
    for the device takes the transfer's time (gloo on CPU has no queue to show it)."""
    from megatron_rl.weight_sync import DistributedTransport, transport
    from megatron_rl.weight_sync.buckets import Bucket

    transfer_s = 0.5
    queued = []
    monkeypatch.setattr(transport.dist, "broadcast",
                        lambda tensor, src, group: queued.append(tensor.numel()))

    def wait_for_device(device):
        if queued:
            queued.clear()
            time.sleep(transfer_s)

    monkeypatch.setattr(transport, "_wait_for_device", wait_for_device, raising=False)

    class Receiver:
        num_ranks = 1

        def update_weights_from_distributed(self, specs, **kwargs):
            pass

    sender = DistributedTransport([Receiver()], master_address="127.0.0.1", master_port=1,
                                  group_name="g", backend="gloo", timeout_s=10)
    spec = TensorSpec(name="w", dtype=torch.float32, shape=(4,))
    sender.send(Bucket(specs=(spec,), data=torch.zeros(16, dtype=torch.uint8)), version=None,
                flush_cache=False)
    assert sender.times.transfer >= transfer_s
    assert sender.times.load < transfer_s


# ---------------------------------------------------------------------- the SGLang client

class _Recording(http.server.BaseHTTPRequestHandler):
    requests: list = []
    open_session = False  # an engine left with an open weight-update session (SGLang's state)

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        self.requests.append((self.path, body))
        answer = {"success": True, "message": "ok"}
        if self.path in ("/begin_weight_update", "/end_weight_update"):
            begin = self.path == "/begin_weight_update"
            if begin == type(self).open_session:  # SGLang 0.5.23's refusals, HTTP 400
                answer = {"success": False, "message": (
                    "a weight-update session is already open; call end_weight_update() first"
                    if begin else "no weight-update session is open; call "
                    "begin_weight_update() first")}
                return self._answer(answer, status=400)
            type(self).open_session = begin
        if self.path == "/generate":
            answer = [{"output_ids": [7], "meta_info": {
                "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None]],
                "weight_versions": [{"version": "3", "start": 0, "end": 1}]}}
                for _ in body["input_ids"]]
        self._answer(answer)

    def _answer(self, answer, status=200):
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def recording_server():
    _Recording.requests, _Recording.open_session = [], False
    server = http.server.HTTPServer(("127.0.0.1", 0), _Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Recording.requests
    server.shutdown()


def test_a_session_left_open_by_a_dead_sender_is_ended_before_the_next_update(
        recording_server):
    """The chaos e2e's trainer SIGKILL landed mid-sync: the engine kept the dead sender's open
    weight-update session, and SGLang refused the restored trainer's sync (HTTP 400, "a
    weight-update session is already open"), stopping the run. The next begin ends it first."""
    url, requests = recording_server
    _Recording.open_session = True  # what the dead sender left
    client = SGLangGenerator(url)
    client.begin_weight_update()
    client.end_weight_update()
    assert [path for path, _ in requests] == ["/begin_weight_update", "/end_weight_update",
                                              "/begin_weight_update", "/end_weight_update"]
    with pytest.raises(GeneratorError, match="no weight-update session is open"):
        client.end_weight_update()  # other refusals still raise


def test_client_tensor_payload_is_one_serialisation_per_engine_rank(recording_server,
                                                                     monkeypatch):
    """Issue 30.7: SGLang's /update_weights_from_tensor takes one serialisation per engine rank
    (each rank deserialises only its own, and a CUDA tensor's IPC reference is given back once
    per payload); the old client sent one payload copied to every rank."""
    from sglang.srt.utils import MultiprocessingSerializer

    url, requests = recording_server
    calls, serialize = [], MultiprocessingSerializer.serialize
    monkeypatch.setattr(MultiprocessingSerializer, "serialize", staticmethod(
        lambda obj, output_str=False: calls.append(1) or serialize(obj, output_str=output_str)))
    tensor = torch.arange(4.0)
    SGLangGenerator(url, num_ranks=2).update_weights_from_tensors(
        [("model.norm.weight", tensor)], flush_cache=False)
    (path, body), = requests
    assert path == "/update_weights_from_tensor" and len(calls) == 2
    assert len(body["serialized_named_tensors"]) == 2
    for payload in body["serialized_named_tensors"]:
        (name, got), = MultiprocessingSerializer.deserialize(payload)
        assert name == "model.norm.weight" and torch.equal(got, tensor)


def test_client_buckets_carry_no_version_and_the_label_aborts_nothing(recording_server):
    url, requests = recording_server
    client = SGLangGenerator(url)
    spec = TensorSpec(name="model.norm.weight", dtype=torch.float32, shape=(4,))
    client.update_weights_from_distributed([spec], group_name="g", flush_cache=False)
    client.set_weight_version(4)
    (bucket_path, bucket), (label_path, label) = requests
    assert bucket_path == "/update_weights_from_distributed"
    assert "weight_version" not in bucket and bucket["flush_cache"] is False
    assert label_path == "/update_weight_version"
    assert label == {"new_version": "4", "abort_all_requests": False}
    assert client.weight_version == 4
    # A standalone one-bucket update may still label itself.
    client.update_weights_from_distributed([spec], group_name="g", version=5)
    assert requests[-1][1]["weight_version"] == "5" and client.weight_version == 5


def test_client_generate_namespaces_the_prefix_cache(recording_server):
    url, requests = recording_server
    client = SGLangGenerator(url)
    params = SamplingParams(max_new_tokens=1, num_samples=2)
    results = client.generate([[1, 2], [3]], params, extra_key="v3")
    assert all(isinstance(r, GenerationResult) and r.versions == (3,) for r in results)
    assert requests[-1][1]["extra_key"] == "v3" and len(requests[-1][1]["input_ids"]) == 4
    client.generate([[1, 2]], params)
    assert "extra_key" not in requests[-1][1]
    with pytest.raises(ValueError, match="extra_key"):
        client.generate([[1, 2]], params, extra_key="")  # SGLang would read it as no key


def test_a_failed_generator_refuses_every_call_naming_itself(recording_server):
    url, requests = recording_server
    client = SGLangGenerator(url)
    client.mark_failed("weight sync to version 7 failed after it had started loading")
    for call in (client.check_health, client.resume,
                 lambda: client.generate([[1]], SamplingParams(max_new_tokens=1))):
        with pytest.raises(GeneratorDeadError, match=f"{url} was failed by the weight sync"
                                                     ".*version 7"):
            call()
    assert not client.is_healthy() and requests == []


def test_overlap_schedule_is_off_by_default(tmp_path):
    """Hazard 1: with SGLang's overlap schedule the decode step launched before a pause is
    labelled with the new version though the old weights produced it."""
    assert "--disable-overlap-schedule" in SGLangServerSettings(
        model_path=str(tmp_path)).server_args(port=1)
    assert "--disable-overlap-schedule" not in SGLangServerSettings(
        model_path=str(tmp_path), disable_overlap_schedule=False).server_args(port=1)
