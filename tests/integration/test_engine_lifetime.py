"""No SGLang server outlives the process that launched it, and only holders of its API key
command it (issue 31, items 5 and 6): real GeneratorActors (Ray threaded actors, as
GeneratorPool makes them) on a local Ray cluster, each launching the tiny Llama with the SGLang
CPU engine; the actor's worker process is SIGKILLed at each point of an engine's life:

- launch: at once after `launch` returned (the server is still importing, before it could tie
  itself to the actor);
- restart: at once after `restart` returned (the old server stopped by it, the new one importing);
- wait_until_healthy: while that call is in flight and the server has forked its scheduler and
  detokenizer;
- crash with a serving engine: the server healthy, then SIGSTOPped (a hung engine cannot act on
  its own), and the actor killed.

Each time, the process table is searched for every process of the server's session (the server
leads one: its scheduler, detokenizer and anything they started share it), and none may be left
after 60 s. The serving engine also checks the key: without it, or with a wrong one, /generate,
/update_weights_from_disk and /pause_generation answer 401; with it they work, through both
clients and the actor's own health check; the key is in no process's command line, and the server
log has SGLang's start-up listing of its arguments with the key hidden.
"""
from __future__ import annotations

import os
import secrets
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

DEADLINE_S = 60.0


def _session_members(leader: int, started_at: float) -> list[str]:
    """The live (non-zombie) processes of the session `leader` started, as readable lines."""
    import psutil

    members = []
    for process in psutil.process_iter(["pid", "create_time", "status", "cmdline"]):
        try:
            if (process.info["status"] != psutil.STATUS_ZOMBIE
                    and process.info["create_time"] >= started_at - 1.0
                    and os.getsid(process.info["pid"]) == leader):
                members.append(f"{process.info['pid']} "
                               f"{' '.join(process.info['cmdline'] or [])[:120]}")
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _left_after(endpoints, timeout_s: float = DEADLINE_S) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = [m for e in endpoints for m in _session_members(e.pid, e.started_at)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _wait_for_children(endpoint, timeout_s: float = 600.0) -> None:
    """Until the server has forked its scheduler and detokenizer (>= 2 more processes)."""
    deadline = time.monotonic() + timeout_s
    while len(_session_members(endpoint.pid, endpoint.started_at)) < 3:
        assert time.monotonic() < deadline, "the server forked no children"
        time.sleep(0.5)


class _Actors:
    """GeneratorActors as GeneratorPool creates them (threaded: max_concurrency 2)."""

    def __init__(self, settings):
        self.settings = settings
        self.count = 0

    def new(self):
        from megatron_rl.cluster import GeneratorActor
        from megatron_rl.cluster.remote import actor_class

        self.count += 1
        settings = self.settings(self.count)
        return actor_class(GeneratorActor).options(
            max_concurrency=2, max_restarts=0, num_cpus=0).remote(f"g{self.count}", settings)


def _crash(actor) -> float:
    """SIGKILL the actor's worker process; when (time.monotonic())."""
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def test_engines_die_with_their_actor_and_answer_only_their_key(tmp_path):
    import ray
    from _hf_families import save_tiny_llama

    from megatron_rl.cluster import ClusterSettings, RayCluster
    from megatron_rl.rollout import SGLangServerSettings

    model_dir = save_tiny_llama(tmp_path / "model")
    key = secrets.token_urlsafe(32)
    temp_dir = tempfile.mkdtemp(prefix="mrl_life_", dir="/tmp")  # short: Unix socket paths
    actors = _Actors(lambda n: SGLangServerSettings(
        model_path=str(model_dir), dtype="float32", mem_fraction_static=0.001,
        max_total_tokens=8192, startup_timeout_s=600, request_timeout_s=120, api_key=key,
        log_path=str(tmp_path / f"server-{n}.log")))
    timings = []
    cluster = RayCluster.start(ClusterSettings(num_cpus=2, temp_dir=temp_dir))
    try:
        # launch: the server has not had the time to tie itself to the actor.
        actor = actors.new()
        endpoint = ray.get(actor.launch.remote(), timeout=600)
        killed = _crash(actor)
        assert not (left := _left_after([endpoint])), f"after a kill at launch:\n{left}"
        timings.append(("launch", time.monotonic() - killed))

        # restart: the old server is stopped by the restart, the new one dies with the actor.
        actor = actors.new()
        first = ray.get(actor.launch.remote(), timeout=600)
        second = ray.get(actor.restart.remote(), timeout=600)
        killed = _crash(actor)
        assert second.pid != first.pid
        assert not (left := _left_after([first, second])), f"after a kill at restart:\n{left}"
        timings.append(("restart", time.monotonic() - killed))

        # wait_until_healthy, in flight, the server's children forked.
        actor = actors.new()
        endpoint = ray.get(actor.launch.remote(), timeout=600)
        waiting = actor.wait_until_healthy.remote()
        _wait_for_children(endpoint)
        assert not ray.wait([waiting], timeout=0)[0], "healthy already: not the point tested"
        killed = _crash(actor)
        assert not (left := _left_after([endpoint])), \
            f"after a kill in wait_until_healthy:\n{left}"
        timings.append(("wait_until_healthy", time.monotonic() - killed))

        # a serving engine: the key, then a hung server and its actor's crash.
        actor = actors.new()
        ray.get(actor.launch.remote(), timeout=600)
        endpoint = ray.get(actor.wait_until_healthy.remote(), timeout=600)
        assert endpoint.api_key == key and key not in repr(endpoint)
        _check_the_key(endpoint, key, model_dir)
        ray.get(actor.check_health.remote(), timeout=60)  # /server_info: the key is sent
        assert len(_session_members(endpoint.pid, endpoint.started_at)) >= 3
        os.kill(endpoint.pid, signal.SIGSTOP)
        killed = _crash(actor)
        assert not (left := _left_after([endpoint])), \
            f"after a kill with a stopped server:\n{left}"
        timings.append(("serving, stopped", time.monotonic() - killed))
        log = Path(endpoint.log_path).read_text(errors="replace")
        assert "server_args=" in log and "'api_key': '<hidden>'" in log, log[-3000:]
        assert key not in log
    finally:
        cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    print("\nkill of the actor to no server process left: "
          + ", ".join(f"{name} {s:.1f} s" for name, s in timings))


def _check_the_key(endpoint, key: str, model_dir: Path) -> None:
    import asyncio

    import psutil
    import requests

    from megatron_rl.rollout import GeneratorError, SamplingParams, SGLangGenerator
    from megatron_rl.rollout.async_client import AsyncSGLangClient

    for process in psutil.process_iter(["cmdline"]):
        assert key not in " ".join(process.info["cmdline"] or []), process
    requests_ = {"/generate": {"input_ids": [5, 17, 42], "sampling_params": {
                     "max_new_tokens": 2, "temperature": 0.0}},
                 "/update_weights_from_disk": {"model_path": str(model_dir)},
                 "/pause_generation": {"mode": "abort"}}
    for path, payload in requests_.items():
        for headers in ({}, {"Authorization": f"Bearer {key}x"}):
            answer = requests.post(f"{endpoint.url}{path}", json=payload, headers=headers,
                                   timeout=60)
            assert answer.status_code == 401, (path, headers, answer.status_code, answer.text)
    with pytest.raises(GeneratorError, match="HTTP 401.*none was sent"):
        SGLangGenerator(endpoint.url).generate([[5, 17]], SamplingParams(max_new_tokens=2))
    keyed = SGLangGenerator(endpoint.url, api_key=key, request_timeout_s=120)
    keyed.pause(mode="abort")
    keyed.resume()
    keyed.update_weights_from_disk(str(model_dir), version=0)
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, purpose="eval")
    (result,) = keyed.generate([[5, 17, 42]], greedy)
    assert len(result.token_ids) == 3

    async def asynchronous() -> None:
        async with AsyncSGLangClient(endpoint.url, api_key=key) as client:
            again = await client.generate_one([5, 17, 42], 3, greedy)
            assert again.token_ids == result.token_ids
            assert await client.probe(timeout_s=60) is None
        async with AsyncSGLangClient(endpoint.url, api_key=key + "x") as wrong:
            with pytest.raises(GeneratorError, match="HTTP 401.*refused the API key"):
                await wrong.generate_one([5, 17, 42], 3, greedy)

    asyncio.run(asynchronous())
