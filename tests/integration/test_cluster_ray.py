"""The Ray layer of the Pipeline-RL loop (megatron_rl.cluster) on a real local Ray cluster
(loopback only, 2 CPUs): one GeneratorActor serving the tiny dense Llama with the SGLang CPU
engine, one TrainerWorker (a world-size-1 Megatron trainer built from a RunConfig), in one
placement group.

The parity check: after a weight sync the generator holds the trainer's weights, so the
trainer's log-probs of the generator's own samples equal the recorded ones: StepMetrics.
logp_mismatch < 1e-4 (both fp32; the weight-sync tests measured ~1e-6). Hygiene: after
`RayCluster.shutdown()` no process this test started (Ray's GCS, raylet, workers; the SGLang
server and its children) is left: the test's descendants are snapshotted before shutdown and
looked up afterwards, plus any process whose command line names the test's model or Ray
directories. Other engineers' Ray clusters and SGLang servers on the machine are not looked at.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LOGPROB_TOLERANCE = 1e-4
PROMPTS = [[5, 17, 42, 99], [200, 4, 31], [2, 300, 45, 61, 19]]
SEQUENCES = [[5, 17, 42, 99, 7, 250, 3, 64, 128, 11], [200, 4, 4, 31, 77, 150, 9, 18]]


def _run_config(tmp_path: Path):
    from megatron_rl.config import load_config

    return load_config(None, [
        "model.name=llama", "model.size=tiny", "model.params_dtype=float32",
        "parallelism.world_size=1", "rollout.num_generators=1", "rollout.dtype=float32",
        "rollout.mem_fraction_static=0.05", "rollout.samples_per_prompt=2",
        "train.global_batch_size=6", "train.lr=0.03", "train.lr_warmup_steps=0",
        "train.clip_grad=0", f"output_dir={tmp_path / 'run'}"])


def _server_settings(run, model_dir: Path, log_path: Path):
    from megatron_rl.rollout import SGLangServerSettings

    return SGLangServerSettings.from_rollout_config(
        run.rollout, str(model_dir), max_total_tokens=8192, startup_timeout_s=240,
        request_timeout_s=120, log_path=str(log_path))


def _cluster_settings():
    from megatron_rl.cluster import ClusterSettings

    # Short (Unix socket paths) and unique: the hygiene check looks for it in command lines.
    return ClusterSettings(num_cpus=2, temp_dir=tempfile.mkdtemp(prefix="mrl_ray_", dir="/tmp"))


class _Clock:
    """Seconds per phase, printed at the end (pytest -s shows them)."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self.last))
        self.last = now

    def report(self, name: str) -> None:
        laps = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in self.phases)
        print(f"\n{name}: {time.perf_counter() - self.start:.1f} s ({laps})")


# ---------------------------------------------------------------------------- process hygiene

def _descendants() -> dict[int, tuple[float, str]]:
    """{pid: (start time, name)} of every live process below this one."""
    import psutil

    found = {}
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                found[process.pid] = (process.create_time(), process.name())
        except psutil.Error:
            continue
    return found


def _survivors(snapshot: dict[int, tuple[float, str]], markers: list[str]) -> list[str]:
    """Processes of `snapshot` still alive (same pid and start time), and any process whose
    command line contains one of `markers`."""
    import psutil

    alive = []
    for pid, (started, name) in snapshot.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {name} {' '.join(process.cmdline())[:160]}")
        except psutil.Error:
            continue
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if (process.info["pid"] not in snapshot and process.info["status"] != psutil.STATUS_ZOMBIE
                and any(marker in cmdline for marker in markers)):
            alive.append(f"{process.info['pid']} {cmdline[:160]}")
    return alive


def _assert_nothing_left(snapshot, markers, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := _survivors(snapshot, markers)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, "processes left after shutdown:\n" + "\n".join(left)


def _snapshot_of_running_cluster(endpoint) -> dict[int, tuple[float, str]]:
    """The test's process tree while everything runs; checks that it holds what must be
    stopped (else the hygiene check below would prove nothing)."""
    snapshot = _descendants()
    names = {name for _, name in snapshot.values()}
    assert {"raylet", "gcs_server"} <= names, names
    assert endpoint.pid in snapshot, "the SGLang server is not below this process"
    import psutil

    server_children = psutil.Process(endpoint.pid).children(recursive=True)
    assert server_children, "the SGLang server has no scheduler / detokenizer processes"
    assert all(child.pid in snapshot for child in server_children)
    _assert_loopback_only(snapshot, endpoint)
    return snapshot


def _assert_loopback_only(snapshot, endpoint) -> None:
    """Ray's own processes and the SGLang HTTP server listen on 127.0.0.1 only. (Not checked:
    torch.distributed's TCPStores in the trainer and the SGLang scheduler, which torch binds
    to every interface whatever MASTER_ADDR says.)"""
    import psutil

    checked = 0
    for pid, (_, name) in snapshot.items():
        ray_daemon = name in ("gcs_server", "raylet") or (
            name.startswith("ray::") and name not in ("ray::TrainerWorker",
                                                      "ray::GeneratorActor"))
        if not (ray_daemon or pid == endpoint.pid):
            continue
        try:
            listening = [c.laddr.ip for c in psutil.Process(pid).net_connections("inet")
                         if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
        assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in listening), (name, listening)
        checked += len(listening)
    assert checked >= 4, "no listening sockets found to check"


# ---------------------------------------------------------------------------- Ray + SGLang

def test_pipeline_step_on_ray_with_weight_sync_parity(tmp_path):
    """Local Ray cluster -> placement group -> GeneratorActor (SGLang) + TrainerWorker ->
    sync (v1) -> generate -> train step (logp_mismatch ~0) -> sync (v2) -> generate -> train
    step (~0 again, the generator follows) -> checkpoint round trip -> the SGLang server is
    killed: the health check raises GeneratorDeadError naming the generator, its URL, the exit
    code and the server's log -> shutdown, nothing left. (One cluster for both halves: a Ray
    cluster and an SGLang server take a minute to start on 2 cores.)"""
    from _hf_families import family_for, save_tiny_llama

    from megatron_rl.cluster import ClusterLayout, GeneratorPool, RayCluster, TrainerGroup
    from megatron_rl.platform.environment import shared_environment
    from megatron_rl.rollout import SamplingParams, SGLangGenerator
    from megatron_rl.rollout.samples import Segment, assemble_sample
    from megatron_rl.trainer import CheckpointState, StepMetrics, TrainBatch
    from megatron_rl.weight_sync import SyncReport

    clock = _Clock()
    model_dir = save_tiny_llama(tmp_path / "model")
    run = _run_config(tmp_path)
    settings = _cluster_settings()
    cluster = RayCluster.start(settings)
    try:
        clock.lap("ray start")
        assert cluster.node_ip == "127.0.0.1"
        placement = cluster.reserve(ClusterLayout.from_run_config(run, device="cpu"))
        generators = GeneratorPool.launch(
            placement, [_server_settings(run, model_dir, tmp_path / "server.log")],
            names=["rollout-east"])
        (endpoint,) = generators.endpoints
        assert endpoint.url.startswith("http://127.0.0.1:") and endpoint.num_ranks == 1
        clock.lap("generator up")
        trainers = TrainerGroup.create(placement, run, family=family_for(model_dir))
        clock.lap("trainer up")
        # One set of NCCL settings (the job's runtime_env) in the trainer rank's process and
        # the SGLang server's, as they were started (megatron_rl.platform.environment).
        shared = shared_environment()
        started_with = [_environ(pid) for pid in (trainers.nodes[0].pid, endpoint.pid)]
        assert [{k: env.get(k) for k in shared} for env in started_with] == [shared] * 2
        trainers.connect_generators(generators.endpoints, hf_config_dir=str(model_dir))
        generator = SGLangGenerator(endpoint.url, request_timeout_s=120)

        def rollout_batch(version: int, seed: int) -> TrainBatch:
            results = generator.generate(PROMPTS, SamplingParams(
                max_new_tokens=8, num_samples=2, seed=seed, ignore_eos=True,
                temperature=run.rollout.temperature))
            assert all(set(r.versions) == {version} for r in results)
            groups = [[assemble_sample(
                group_id=p, sample_index=r.sample_index, prompt_token_ids=r.prompt_token_ids,
                segments=[Segment(token_ids=r.token_ids, logprobs=r.logprobs,
                                  versions=r.versions)], finish_reason=r.finish_reason)
                for r in results if r.prompt_index == p] for p in range(len(PROMPTS))]
            return TrainBatch.from_groups(groups, [[1.0, -1.0]] * len(PROMPTS))

        before_sync = generator.score(SEQUENCES)
        for version in (1, 2):
            report = trainers.sync_weights()
            assert isinstance(report, SyncReport) and report.version == version
            assert generator.server_weight_version() == str(version)
            metrics = trainers.train_step(rollout_batch(version, seed=version))
            assert isinstance(metrics, StepMetrics)
            assert not metrics.skipped and metrics.step == version
            # The numerical-parity check: the generator held the trainer's weights.
            assert metrics.logp_mismatch < LOGPROB_TOLERANCE, metrics
            clock.lap(f"sync v{version} + rollout + step")
            print(f"\nv{version}: sync {report.seconds:.3f} s, logp_mismatch "
                  f"{metrics.logp_mismatch:.2e} over {metrics.num_loss_tokens} tokens")
            if version == 1:
                after_sync_1 = generator.score(SEQUENCES)
        # Each sync moved the generator: to the trainer's init, then to its weights after step 1.
        assert max(float((a - b).abs().max()) for a, b in zip(before_sync, after_sync_1)) > 0.1
        after_sync_2 = generator.score(SEQUENCES)
        assert max(float((a - b).abs().max()) for a, b in zip(after_sync_1, after_sync_2)) > 0.01

        trainers.save_checkpoint(str(tmp_path / "checkpoint"), {"sampler": [3, 1, 2]})
        state = trainers.load_checkpoint(str(tmp_path / "checkpoint"))
        assert isinstance(state, CheckpointState) and state.step == 2
        assert state.extra_state == {"sampler": [3, 1, 2]}
        clock.lap("checkpoint")
        snapshot = _snapshot_of_running_cluster(endpoint)
        _kill_and_check_the_generator_is_named(generators, endpoint)
        clock.lap("death noticed")
    finally:
        cluster.shutdown()
    clock.lap("shutdown")
    _assert_nothing_left(snapshot, [settings.temp_dir, str(model_dir)])
    shutil.rmtree(settings.temp_dir, ignore_errors=True)  # Ray's logs, kept when a test fails
    clock.report("pipeline step on Ray")


def _environ(pid: int) -> dict[str, str]:
    """The environment process `pid` was started with."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def _kill_and_check_the_generator_is_named(pool, endpoint) -> None:
    from megatron_rl.rollout import GeneratorDeadError

    pool.check_health()
    os.killpg(endpoint.pid, signal.SIGKILL)  # the server and its children die
    error, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:  # until the actor has seen its server exit
        try:
            pool.check_health()
        except GeneratorDeadError as exc:
            error = exc
            if "exited with code" in str(exc):
                break
        time.sleep(0.2)
    assert error is not None, "the health check passed after the server was killed"
    message = str(error)
    assert "generator 'rollout-east'" in message and endpoint.url in message, message
    assert "exited with code -9" in message and str(endpoint.log_path) in message, message
    print("\n" + message.splitlines()[0])
