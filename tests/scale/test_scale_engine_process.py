"""Simulated engines served by a child process (megatron_rl/simulation/engine_process.py), as
the scale tier's large runs use them: the real client generates against one, the faults reach
it over the pipe (hang: health stops answering; kill: the connection is refused), and its
statistics outlive the child. Marked integration: the child is a fresh interpreter (spawn)."""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.rollout.async_client import AsyncSGLangClient
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.scaling.cost import PRESETS
from megatron_rl.simulation import EngineTiming, SimClock, get_profile
from megatron_rl.simulation.engine import CompletionLengths, EngineSettings

pytestmark = pytest.mark.integration


def test_an_engine_in_a_child_process_serves_the_real_client_and_takes_faults():
    import aiohttp

    from megatron_rl.simulation.engine_process import EngineHost, RemoteEngine

    profile = get_profile("H100")
    timing = EngineTiming(model=profile.cost_config(PRESETS["paper-8b"]), profile=profile)
    settings = EngineSettings(lengths=CompletionLengths(median_tokens=50, sigma=0.0))
    host = EngineHost()

    async def health(url, timeout_s=1.0):
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url}/health",
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    return r.status
        except asyncio.TimeoutError:
            return "timeout"
        except aiohttp.ClientConnectionError:
            return "refused"

    async def scenario():
        engine = RemoteEngine(host, settings, timing, SimClock(200.0), name="remote", node=3)
        url = await engine.start()
        client = AsyncSGLangClient(url)
        try:
            results = await asyncio.gather(*(client.generate_one(
                [1, 2, 3], 100, SamplingParams(max_new_tokens=100)) for _ in range(5)))
            healthy = await health(url)
            engine.hang()
            hung = await health(url)
            engine.unhang()
            again = await health(url)
        finally:
            await client.close()
        await engine.kill()
        return engine, results, (healthy, hung, again, await health(url))

    try:
        engine, results, statuses = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    finally:
        host.close()
    assert [len(r.token_ids) for r in results] == [50] * 5
    assert statuses == (200, "timeout", 200, "refused")
    assert not host.process.is_alive()
    stats = engine.stats  # kept on this side: the child is gone
    assert stats.finished == 5 and len(stats.admission_order) == 5 and stats.max_batch >= 1
