"""The simulated engine's statistics that the scale tier asserts on (megatron_rl/simulation/
engine.py EngineStats): the priority-admission counters and the record of version changes, on a
real engine driven by the project's real clients (AsyncSGLangClient, SGLangGenerator)."""
import asyncio

import pytest

from megatron_rl.rollout.async_client import AsyncSGLangClient
from megatron_rl.rollout.sglang_server import SGLangGenerator
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.scaling.cost import PRESETS
from megatron_rl.simulation import EngineTiming, SimClock, get_profile
from megatron_rl.simulation.engine import CompletionLengths, EngineSettings, SimulatedEngine

pytestmark = pytest.mark.unit
PROMPT = list(range(10, 42))
PARAMS = SamplingParams(max_new_tokens=32768)


def _engine(**fields) -> SimulatedEngine:
    profile = get_profile("H100")
    timing = EngineTiming(model=profile.cost_config(PRESETS["paper-8b"]), profile=profile)
    fields.setdefault("lengths", CompletionLengths(median_tokens=300, sigma=0.0))
    return SimulatedEngine(EngineSettings(**fields), timing, SimClock(200.0))


@pytest.mark.parametrize("priority_scheduling", [True, False])
def test_priority_counters_count_the_fresh_requests_a_continuation_went_ahead_of(
        priority_scheduling):
    """One slot, held; priorities 0, 1, 0, 1 queue (arrivals 1..4), then the engine continues.
    With priority scheduling arrival 2 goes ahead of 1, and arrival 4 ahead of 1 and 3: 3
    overtaken by 2 priority admissions; without it priorities are ignored (SGLang's default)."""
    async def scenario():
        engine = _engine(max_running_requests=1, enable_priority_scheduling=priority_scheduling)
        url = await engine.start()
        client, generator = AsyncSGLangClient(url), SGLangGenerator(url)
        try:
            first = asyncio.create_task(client.generate_one(PROMPT, 1000, PARAMS))
            while engine.num_running == 0:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(generator.pause, "in_place")
            tasks = []
            for priority in (0, 1, 0, 1):
                tasks.append(asyncio.create_task(
                    client.generate_one([100 + len(tasks)], 1000, PARAMS, priority=priority)))
                while engine.num_queued < len(tasks):
                    await asyncio.sleep(0.005)
            await asyncio.to_thread(generator.resume)
            await asyncio.gather(first, *tasks)
            return engine.stats
        finally:
            await client.close()
            await engine.kill()

    stats = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert stats.max_queued == 4 and stats.admitted_past_priority == 0
    if priority_scheduling:
        assert (stats.priority_admissions, stats.priority_overtaken) == (2, 3)
    else:
        assert (stats.priority_admissions, stats.priority_overtaken) == (0, 0)


def test_version_steps_record_each_change_once_and_requests_their_segments():
    """A version set twice (as a sync does: with the bucket, then /update_weight_version) is one
    change, at the engine step it happened; with record_requests each answered request keeps
    (first output token, engine step) of its running segments, so its tokens' versions follow."""
    async def scenario():
        engine = _engine(record_requests=True,
                         lengths=CompletionLengths(median_tokens=4000, sigma=0.0))
        url = await engine.start()
        client, generator = AsyncSGLangClient(url), SGLangGenerator(url)
        await asyncio.to_thread(generator.check_health)  # imports requests: pauses are prompt
        try:
            task = asyncio.create_task(client.generate_one(PROMPT, 8000, PARAMS))
            while engine.num_running == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            await asyncio.to_thread(generator.pause, "in_place")  # mid-generation
            for _ in range(2):
                await asyncio.to_thread(generator.set_weight_version, 1)
            await asyncio.to_thread(generator.resume)
            return engine.stats, await task
        finally:
            await client.close()
            await engine.kill()

    stats, result = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    [(step, version)] = stats.version_steps
    [(key, starts)] = stats.requests.items()
    assert version == 1 and key == (len(PROMPT), result.token_ids[:16])
    assert starts[0][0] == 0
    switch = step - starts[0][1]  # the first token decoded at or after the change
    assert 0 < switch < len(result.token_ids)
    assert result.versions == (0,) * switch + (1,) * (len(result.token_ids) - switch)
