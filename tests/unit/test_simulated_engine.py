"""The simulated SGLang engine (megatron_rl/simulation/engine.py) against the project's REAL
clients, unmodified: AsyncSGLangClient (the rollout manager's) and SGLangGenerator (the weight
sync's and the driver's, run in a thread: it blocks on `requests`). Scheduling (continuous
batching bound, KV retraction, priority queue), per-token versions across an in-flight update,
abort, health, the API key, faults, and a fleet of 128 engines in one process.

Timing: the paper's 8B model on H100 (scaling/cost.py PRESETS["paper-8b"]); a decode step of a
small batch is ~12 model ms, so time_scale 200 runs a 4000-token completion in ~0.25 wall s.
No client sends more than 100 requests to one engine at once (the client's connection cap).
"""
import asyncio
import math

import numpy as np
import pytest

from megatron_rl.rollout.async_client import AsyncSGLangClient
from megatron_rl.rollout.sglang_server import SGLangGenerator
from megatron_rl.rollout.types import GeneratorDeadError, GeneratorError, SamplingParams
from megatron_rl.scaling.cost import PRESETS
from megatron_rl.simulation import EngineTiming, SimClock, get_profile
from megatron_rl.simulation.engine import (CompletionLengths, EngineFleet, EngineSettings,
                                           SimulatedEngine)

pytestmark = pytest.mark.unit
PROMPT = list(range(10, 42))  # 32 tokens
PARAMS = SamplingParams(max_new_tokens=32768)


def _timing() -> EngineTiming:
    profile = get_profile("H100")
    return EngineTiming(model=profile.cost_config(PRESETS["paper-8b"]), profile=profile)


def _engine(time_scale: float = 200.0, **fields) -> SimulatedEngine:
    fields.setdefault("lengths", CompletionLengths(median_tokens=300, sigma=0.0))
    return SimulatedEngine(EngineSettings(**fields), _timing(), SimClock(time_scale))


def _run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), timeout=60))


async def _until_running(engine: SimulatedEngine, num_requests: int) -> None:
    """Wait until `num_requests` requests decode (the first connection of a client takes a
    while), a little longer so that they are mid-generation, then slow the engine to a crawl
    so that they still are when the control call sent from a thread arrives, however loaded
    the machine (the test restores the speed with slow_down(1.0))."""
    while engine.num_running < num_requests:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    engine.slow_down(1e6)


def test_generate_returns_what_the_real_client_parses_lengths_eos_and_seeds():
    """sigma 0: every completion is exactly median_tokens long and ends in EOS (finish stop);
    a max_new_tokens below it cuts it (finish length). A sampling seed fixes the tokens."""
    async def scenario():
        engine = _engine(eos_token_id=2)
        client = AsyncSGLangClient(await engine.start())
        try:
            full = await client.generate_one(PROMPT, 1000, PARAMS)
            cut = await client.generate_one(PROMPT, 50, PARAMS)
            seeded = [await client.generate_one(PROMPT, 1000,
                                                SamplingParams(max_new_tokens=1000, seed=7))
                      for _ in range(2)]
            other = await client.generate_one(PROMPT, 1000, SamplingParams(max_new_tokens=1000,
                                                                           seed=8))
            return full, cut, seeded, other
        finally:
            await client.close()
            await engine.kill()

    full, cut, seeded, other = _run(scenario)
    assert len(full.token_ids) == 300 and full.finish_reason == "stop"
    assert full.token_ids[-1] == 2 and 2 not in full.token_ids[:-1]
    assert len(full.logprobs) == 300 and all(lp <= 0 for lp in full.logprobs)
    assert full.versions == (0,) * 300 and full.prompt_token_ids == tuple(PROMPT)
    assert len(cut.token_ids) == 50 and cut.finish_reason == "length" and 2 not in cut.token_ids
    assert seeded[0].token_ids == seeded[1].token_ids and seeded[0].logprobs == seeded[1].logprobs
    assert other.token_ids != seeded[0].token_ids


def test_stop_token_ids_end_completions_and_never_come_before_the_end():
    """The rollout's end-of-thinking marker is a stop token (rollout/interruption.py): natural
    ends are EOS or one of the request's stop tokens, and no stop token appears earlier."""
    async def scenario():
        engine = _engine(eos_token_id=2, vocab_size=8)  # a tiny vocabulary: collisions abound
        client = AsyncSGLangClient(await engine.start())
        params = SamplingParams(max_new_tokens=1000, stop_token_ids=(0, 5))
        try:
            return await asyncio.gather(*(client.generate_one(PROMPT, 1000, params)
                                          for _ in range(6)))
        finally:
            await client.close()
            await engine.kill()

    results = _run(scenario)
    assert {r.token_ids[-1] for r in results} == {0, 2, 5}
    assert all(r.finish_reason == "stop" and not {0, 2, 5} & set(r.token_ids[:-1])
               for r in results)


def test_lengths_are_lognormal_with_the_configured_median_and_tail():
    rng = np.random.default_rng(0)
    lengths = CompletionLengths(median_tokens=1000, sigma=1.0)
    draws = np.array([lengths.draw(rng) for _ in range(20000)])
    assert np.median(draws) == pytest.approx(1000, rel=0.05)
    # p99 / median of a lognormal = exp(2.326 sigma) = 10.2
    assert np.percentile(draws, 99) / np.median(draws) == pytest.approx(math.exp(2.326), rel=0.15)


def test_versions_change_at_the_step_of_an_in_flight_update():
    """Pause in place, label version 1, continue (SGLangGenerator, as the weight sync does):
    every running completion's tokens are version 0 up to the step it was paused at and 1 from
    there; the request sent during the pause waits and is all version 1."""
    async def scenario():
        engine = _engine(lengths=CompletionLengths(median_tokens=4000, sigma=0.0))
        url = await engine.start()
        client, generator = AsyncSGLangClient(url), SGLangGenerator(url)
        await asyncio.to_thread(generator.check_health)  # imports requests: pauses are prompt
        try:
            tasks = [asyncio.create_task(client.generate_one(PROMPT, 8000, PARAMS))
                     for _ in range(8)]
            await _until_running(engine, 8)
            await asyncio.to_thread(generator.pause, "in_place")
            at_pause = sorted(engine._tokens_now(r) for r in engine._running.values())
            late = asyncio.create_task(client.generate_one(PROMPT, 8000, PARAMS))
            await asyncio.sleep(0.05)
            assert engine._tokens_now(next(iter(engine._running.values()))) == at_pause[0]
            await asyncio.to_thread(generator.set_weight_version, 1)
            engine.slow_down(1.0)
            await asyncio.to_thread(generator.resume)
            return await asyncio.gather(*tasks), await late, at_pause
        finally:
            await client.close()
            await engine.kill()

    results, late, at_pause = _run(scenario)
    assert 0 < at_pause[0] < 4000, "the pause must land mid-generation"
    switches = sorted(r.versions.index(1) for r in results)
    assert switches == at_pause
    for result in results:
        k = result.versions.index(1)
        assert result.versions == (0,) * k + (1,) * (4000 - k)
    assert late.versions == (1,) * 4000


def test_abort_ends_requests_with_their_tokens_so_far():
    async def scenario():
        engine = _engine(lengths=CompletionLengths(median_tokens=4000, sigma=0.0))
        url = await engine.start()
        client, generator = AsyncSGLangClient(url), SGLangGenerator(url)
        await asyncio.to_thread(generator.check_health)  # imports requests: pauses are prompt
        try:
            tasks = [asyncio.create_task(client.generate_one(PROMPT, 8000, PARAMS))
                     for _ in range(4)]
            await _until_running(engine, 4)
            await asyncio.to_thread(generator.abort)
            engine.slow_down(1.0)
            aborted = await asyncio.gather(*tasks)
            after = await client.generate_one(PROMPT, 10, PARAMS)  # the engine still serves
            return aborted, after, engine.stats
        finally:
            await client.close()
            await engine.kill()

    aborted, after, stats = _run(scenario)
    assert all(r.finish_reason == "abort" and 0 < len(r.token_ids) < 4000 for r in aborted)
    assert all(len(r.versions) == len(r.token_ids) for r in aborted)
    assert after.finish_reason == "length" and len(after.token_ids) == 10
    assert stats.aborted == 4


def test_pause_retract_requeues_and_pause_abort_ends_running_requests():
    async def scenario():
        engine = _engine(lengths=CompletionLengths(median_tokens=2000, sigma=0.0))
        url = await engine.start()
        client, generator = AsyncSGLangClient(url), SGLangGenerator(url)
        await asyncio.to_thread(generator.check_health)  # imports requests: pauses are prompt
        try:
            tasks = [asyncio.create_task(client.generate_one(PROMPT, 8000, PARAMS))
                     for _ in range(3)]
            await _until_running(engine, 3)
            await asyncio.to_thread(generator.pause, "retract")
            requeued = (engine.num_running, engine.stats.retractions)
            engine.slow_down(1.0)
            await asyncio.to_thread(generator.resume)
            retracted = await asyncio.gather(*tasks)
            tasks = [asyncio.create_task(client.generate_one(PROMPT, 8000, PARAMS))
                     for _ in range(3)]
            await _until_running(engine, 3)
            await asyncio.to_thread(generator.pause, "abort")
            engine.slow_down(1.0)
            ended = await asyncio.gather(*tasks)
            await asyncio.to_thread(generator.resume)
            return requeued, retracted, ended
        finally:
            await client.close()
            await engine.kill()

    requeued, retracted, ended = _run(scenario)
    assert requeued == (0, 3)
    assert all(len(r.token_ids) == 2000 and r.finish_reason == "stop" for r in retracted)
    assert all(r.finish_reason == "abort" and len(r.token_ids) < 2000 for r in ended)


def test_health_server_info_and_weight_update_calls():
    """The weight sync's call sequence over SGLangGenerator: health, a session, a group, a bucket
    with the version (timed by the link bandwidth), the version label, a stale session ended."""
    from megatron_rl.rollout.types import TensorSpec, WeightUpdateGroup
    import torch

    async def scenario():
        engine = _engine()
        url = await engine.start()
        generator = SGLangGenerator(url, num_ranks=None)
        try:
            await asyncio.to_thread(generator.check_health)
            ranks = await asyncio.to_thread(lambda: generator.num_ranks)
            await asyncio.to_thread(generator.begin_weight_update)
            await asyncio.to_thread(generator.begin_weight_update)  # a stale session: reopened
            await asyncio.to_thread(generator.init_weight_update_group, WeightUpdateGroup(
                master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2,
                group_name="g", backend="nccl"))
            busy_before = engine.stats.busy_model_s
            spec = TensorSpec(name="w", dtype=torch.bfloat16, shape=(1024, 1024))
            await asyncio.to_thread(generator.update_weights_from_distributed, [spec],
                                    group_name="g", version=3)
            loaded = engine.stats.busy_model_s - busy_before
            version = await asyncio.to_thread(generator.server_weight_version)
            await asyncio.to_thread(generator.set_weight_version, 4)
            await asyncio.to_thread(generator.end_weight_update)
            await asyncio.to_thread(generator.flush_cache)
            scores = await asyncio.to_thread(generator.score, [[5, 6, 7, 8]])
            return ranks, loaded, version, engine.weight_version, scores
        finally:
            await engine.kill()

    ranks, loaded, version, final, scores = _run(scenario)
    timing = _timing()
    assert ranks == 1 and version == "3" and final == 4
    assert scores[0].shape == (3,)  # prompt log-probs: placeholders of the right shape
    assert loaded == pytest.approx(2 * 1024 * 1024 / timing.profile.link_bytes_per_s(
        same_nvlink_domain=False))


def test_the_api_key_is_required_except_for_health():
    import requests

    async def scenario():
        engine = _engine(api_key="s3cret")
        url = await engine.start()
        without, wrong, right = (AsyncSGLangClient(url), AsyncSGLangClient(url, api_key="nope"),
                                 AsyncSGLangClient(url, api_key="s3cret"))
        try:
            errors = []
            for client in (without, wrong):
                with pytest.raises(GeneratorError, match="HTTP 401") as err:
                    await client.generate_one(PROMPT, 5, PARAMS)
                errors.append(str(err.value))
            ok = await right.generate_one(PROMPT, 5, PARAMS)
            health = await asyncio.to_thread(requests.get, f"{url}/health", timeout=5)
            probe = await without.probe(5.0)
            with pytest.raises(GeneratorError, match="HTTP 401"):
                await asyncio.to_thread(SGLangGenerator(url).pause)
            return errors, ok, health.status_code, probe
        finally:
            for client in (without, wrong, right):
                await client.close()
            await engine.kill()

    errors, ok, health, probe = _run(scenario)
    assert "none was sent" in errors[0] and "refused the API key sent" in errors[1]
    assert len(ok.token_ids) == 5 and health == 200 and probe is None


def test_batch_never_exceeds_max_running_requests():
    async def scenario():
        engine = _engine(max_running_requests=4)
        client = AsyncSGLangClient(await engine.start())
        try:
            results = await asyncio.gather(*(client.generate_one(PROMPT, 1000, PARAMS)
                                             for _ in range(20)))
            return results, engine.stats
        finally:
            await client.close()
            await engine.kill()

    results, stats = _run(scenario)
    assert all(len(r.token_ids) == 300 for r in results)
    assert stats.max_batch == 4 and stats.finished == 20
    # 20 requests of 300 tokens at 4 at a time: 5 waves of 300 steps.
    assert stats.decode_steps == 5 * 300


def test_kv_overflow_retracts_and_re_prefills_without_changing_the_completions():
    """A KV cache of 700 tokens cannot hold 4 sequences of 32 + 300 tokens: requests are
    retracted (fewest output tokens first) and re-prefilled from prompt + output; every
    completion is the one an unbounded cache gives (same seeds), whole."""
    async def run(max_total_tokens):
        engine = _engine(max_total_tokens=max_total_tokens)
        client = AsyncSGLangClient(await engine.start())
        try:
            results = await asyncio.gather(*(
                client.generate_one(PROMPT, 1000, SamplingParams(max_new_tokens=1000, seed=i))
                for i in range(4)))
            return results, engine.stats
        finally:
            await client.close()
            await engine.kill()

    (bounded, stats), (free, free_stats) = _run(lambda: run(700)), _run(lambda: run(None))
    assert stats.retractions > 0 and free_stats.retractions == 0
    assert [r.token_ids for r in bounded] == [r.token_ids for r in free]
    assert all(len(r.token_ids) == 300 for r in bounded)
    # Re-prefill: more prefilled tokens than the 4 prompts.
    assert stats.prefill_tokens > free_stats.prefill_tokens == 4 * len(PROMPT)


@pytest.mark.parametrize("priority_scheduling", [True, False])
def test_priority_queue_serves_higher_priority_first_and_fcfs_otherwise(priority_scheduling):
    """One running slot, held by a first request; the engine is paused while requests of
    priority 0, 1, 0, 1 queue. With priority scheduling the 1s go first (in arrival order), else
    arrival order."""
    async def scenario():
        engine = _engine(max_running_requests=1, enable_priority_scheduling=priority_scheduling)
        url = await engine.start()
        client, generator = AsyncSGLangClient(url), SGLangGenerator(url)
        await asyncio.to_thread(generator.check_health)
        try:
            first = asyncio.create_task(client.generate_one(PROMPT, 1000, PARAMS))
            while engine.num_running == 0:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(generator.pause, "in_place")  # the queue fills meanwhile
            tasks = []
            for priority in (0, 1, 0, 1):
                tasks.append(asyncio.create_task(
                    client.generate_one([100 + len(tasks)], 1000, PARAMS, priority=priority)))
                while engine.num_queued < len(tasks):
                    await asyncio.sleep(0.005)
            await asyncio.to_thread(generator.resume)
            await asyncio.gather(first, *tasks)
            return engine.stats.admission_order
        finally:
            await client.close()
            await engine.kill()

    order = [int(rid.rsplit("-", 1)[1]) for rid in _run(scenario)]  # arrival numbers
    assert order == ([0, 2, 4, 1, 3] if priority_scheduling else [0, 1, 2, 3, 4])


def test_decode_time_follows_the_cost_model_step_by_step():
    """One request alone: busy model time = prefill(prompt) + sum over its steps of the cost
    model's decode step at batch 1 and the context it has then (the chunks use the mean
    context, exact for a memory-bound step)."""
    async def scenario():
        engine = _engine(time_scale=2000.0)
        client = AsyncSGLangClient(await engine.start())
        try:
            await client.generate_one(PROMPT, 1000, PARAMS)
            return engine.stats.busy_model_s
        finally:
            await client.close()
            await engine.kill()

    busy = _run(scenario)
    timing = _timing()
    expected = timing.prefill_seconds(len(PROMPT)) + sum(
        timing.decode_step_seconds(1, len(PROMPT) + t) for t in range(300))
    assert busy == pytest.approx(expected, rel=1e-6)


def test_coarse_tokens_take_the_time_of_the_model_tokens_they_stand_for():
    """token_granularity 4: 300 returned tokens of a 32-token prompt are timed as 1200 model
    tokens of a 128-token prompt (within the discretisation of the context: 0.1 %)."""
    async def busy(granularity, prompt, lengths):
        engine = _engine(time_scale=4000.0, token_granularity=granularity,
                         lengths=CompletionLengths(median_tokens=lengths, sigma=0.0))
        client = AsyncSGLangClient(await engine.start())
        try:
            result = await client.generate_one(prompt, 10_000, PARAMS)
            return engine.stats.busy_model_s, len(result.token_ids), engine.kv_capacity
        finally:
            await client.close()
            await engine.kill()

    coarse, coarse_tokens, coarse_kv = _run(lambda: busy(4, PROMPT, 300))
    fine, fine_tokens, fine_kv = _run(lambda: busy(1, PROMPT * 4, 1200))
    assert (coarse_tokens, fine_tokens) == (300, 1200) and coarse_kv == fine_kv // 4
    assert coarse == pytest.approx(fine, rel=1e-3)


def test_faults_kill_hang_slow_down_and_node_loss():
    async def scenario():
        settings = EngineSettings(lengths=CompletionLengths(median_tokens=300, sigma=0.0))
        fleet = EngineFleet(16, settings, _timing(), SimClock(200.0), engines_per_node=8)
        await fleet.start()
        clients = [AsyncSGLangClient(url, connection_retries=1, backoff_s=0.01)
                   for url in fleet.urls]
        try:
            victim, hung, slow = fleet.engines[0], clients[1], fleet.engines[2]
            await victim.kill()
            with pytest.raises(GeneratorDeadError, match="does not answer"):
                await clients[0].generate_one(PROMPT, 10, PARAMS)
            fleet.engines[1].hang()
            probe = await hung.probe(0.3)
            fleet.engines[1].unhang()
            assert await hung.probe(5.0) is None
            await clients[3].generate_one(PROMPT, 1000, PARAMS)
            slow.slow_down(2.0)
            await clients[2].generate_one(PROMPT, 1000, PARAMS)
            lost = await fleet.lose_node(1)
            dead = []
            for client in clients[8:]:
                with pytest.raises(GeneratorDeadError):
                    await client.generate_one(PROMPT, 10, PARAMS)
                dead.append(client)
            alive = await clients[4].generate_one(PROMPT, 10, PARAMS)
            return (probe, fleet.engines[3].stats.busy_model_s, slow.stats.busy_model_s,
                    [e.name for e in lost], len(dead), alive)
        finally:
            for client in clients:
                await client.close()
            await fleet.close()

    probe, normal, slowed, lost, num_dead, alive = _run(scenario)
    assert "did not answer within 0.3 s" in probe
    assert slowed == pytest.approx(2 * normal)
    assert lost == [f"engine{i}" for i in range(8, 16)] and num_dead == 8
    assert len(alive.token_ids) == 10


def test_kill_drops_the_connections_of_requests_in_flight_at_once():
    """A killed engine does not wait for its clients to give up (aiohttp's shutdown_timeout=0
    means no limit): a client with no timeout of its own sees the connection drop, and the
    engine counts the requests it dropped."""
    import aiohttp

    async def scenario():
        engine = _engine(lengths=CompletionLengths(median_tokens=30000, sigma=0.0))
        await engine.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            async def generate():
                async with session.post(f"{engine.url}/generate", json={
                        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30000}}) as r:
                    return r.status, await r.text()

            request = asyncio.create_task(generate())
            await _until_running(engine, 1)
            engine.hang()  # nothing answers: only the kill can end the request
            killed = asyncio.create_task(engine.kill())
            # The guard only stops a hang of the test; the kill returns within milliseconds.
            done, _ = await asyncio.wait({killed, request}, timeout=30,
                                         return_when=asyncio.ALL_COMPLETED)
            return killed in done, request in done and (request.exception()
                                                        or request.result()), engine.stats

    killed, error, stats = _run(scenario)
    assert killed and isinstance(error, aiohttp.ClientError)
    assert stats.dropped == 1


def test_a_hundred_and_twenty_eight_engines_in_one_process_serve():
    async def scenario():
        settings = EngineSettings(lengths=CompletionLengths(median_tokens=50, sigma=1.0))
        async with EngineFleet(128, settings, _timing(), SimClock(2000.0)) as fleet:
            clients = [AsyncSGLangClient(url) for url in fleet.urls]
            try:
                results = await asyncio.gather(*(client.generate_one(PROMPT, 4000, PARAMS)
                                                 for client in clients))
            finally:
                for client in clients:
                    await client.close()
            return results, len(set(fleet.urls)), [e.stats.finished for e in fleet.engines]

    results, num_urls, finished = _run(scenario)
    assert num_urls == 128 and finished == [1] * 128 and len(results) == 128
    assert len({r.token_ids for r in results}) == 128  # every engine samples its own stream
