"""The rollout manager's failure path without a server: a generator that is gone stops the
manager with an error naming it (the live-server behaviour is in
tests/integration/test_rollout_live.py)."""
import asyncio

import pytest

from megatron_rl.algorithms import NoPositiveResamplingSampler
from megatron_rl.data.records import PromptRecord
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.async_client import AsyncSGLangClient
from megatron_rl.rollout.interruption import InterruptionSettings
from megatron_rl.rollout.manager import RolloutError, RolloutManager
from megatron_rl.rollout.sglang_server import free_port
from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings

pytestmark = pytest.mark.unit


def _manager(client, record, *, params, prompts_per_step, score):
    """A manager over one prompt (tokens [5, 6]) and one client, no forced interruption."""
    return RolloutManager(
        clients=[client], prompt_token_ids=[[5, 6]], records=[record],
        sampler=NoPositiveResamplingSampler(1, seed=0),
        gate=AdmissionGate(StalenessSettings(max_off_policyness=0,
                                             prompts_per_step=prompts_per_step)),
        params=params,
        interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                          thinking_budget=4, solution_budget=4),
        score=score, decode=str, max_finished_groups=2 * prompts_per_step)


def test_a_dead_generator_stops_the_manager_with_its_name():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    record = PromptRecord(prompt_id="p0", task="rg/x", prompt="1 + 1 =", answer="2")

    async def run():
        async with AsyncSGLangClient(url, request_timeout_s=30) as client:
            manager = _manager(client, record, params=SamplingParams(max_new_tokens=1,
                                                                     num_samples=2),
                               prompts_per_step=1,
                               score=lambda texts, records: pytest.fail("nothing to score"))
            manager.start()
            try:
                await asyncio.wait_for(manager.take(1), timeout=60)
            finally:
                await manager.stop()

    with pytest.raises(RolloutError, match=f"rollouts stopped: SGLang server {url} does not "
                                           "answer /generate"):
        asyncio.run(run())


def test_every_sample_of_a_group_gets_its_own_sampling_seed():
    """SGLang samples a seeded request with noise drawn from (seed, position, token) alone, so
    G requests of one prompt under one seed return the same completion (a group with no
    exploration, and a mean@k that is mean@1). The manager gives each sample its own seed,
    derived from the run's seed, the group and the sample, so a rerun draws the same ones. The
    client is a scripted stand-in that records the seeds (scheduling logic only; the live
    server is in tests/integration/test_rollout_live.py)."""
    from megatron_rl.rewards.types import Reason, RewardResult
    from megatron_rl.rollout import GenerationResult
    from megatron_rl.rollout.types import derive_seed

    record = PromptRecord(prompt_id="p0", task="rg/x", prompt="1 + 1 =", answer="2")

    class RecordingClient:
        def __init__(self):
            self.seeds = []

        async def generate_one(self, input_ids, max_new_tokens, params, *, extra_key=None):
            self.seeds.append(params.seed)
            return GenerationResult(prompt_index=0, sample_index=0,
                                    prompt_token_ids=tuple(input_ids), token_ids=(9,),
                                    logprobs=(-0.1,), versions=(0,), finish_reason="stop")

    async def run(seed):
        client = RecordingClient()
        manager = _manager(
            client, record, params=SamplingParams(max_new_tokens=1, num_samples=4, seed=seed),
            prompts_per_step=2, score=lambda texts, records: [
                RewardResult(reward=0.0, reason=Reason.WRONG, pass_fraction=0.0)] * len(texts))
        manager.start()
        try:
            await asyncio.wait_for(manager.take(2), timeout=60)
        finally:
            await manager.stop()
        return client.seeds

    seeds = asyncio.run(run(1234))
    assert len(seeds) == 8 and len(set(seeds)) == 8  # 2 groups x 4 samples, all different
    assert sorted(seeds) == sorted(derive_seed(1234, "train", g, k)
                                   for g in range(2) for k in range(4))
    assert asyncio.run(run(1234)) == seeds  # reproducible
    assert set(asyncio.run(run(99))).isdisjoint(seeds)
    unseeded = SamplingParams(max_new_tokens=1)
    assert unseeded.for_sample("train", 0, 1) is unseeded  # SGLang's own stream: already differs
