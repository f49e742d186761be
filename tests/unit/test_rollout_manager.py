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


def test_a_dead_generator_stops_the_manager_with_its_name():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    record = PromptRecord(prompt_id="p0", task="rg/x", prompt="1 + 1 =", answer="2")

    async def run():
        async with AsyncSGLangClient(url, request_timeout_s=30) as client:
            manager = RolloutManager(
                clients=[client], prompt_token_ids=[[5, 6]], records=[record],
                sampler=NoPositiveResamplingSampler(1, seed=0),
                gate=AdmissionGate(StalenessSettings(max_off_policyness=0, prompts_per_step=1)),
                params=SamplingParams(max_new_tokens=1, num_samples=2),
                interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                                  thinking_budget=4, solution_budget=4),
                score=lambda texts, records: pytest.fail("nothing to score"),
                decode=str, max_finished_groups=4)
            manager.start()
            try:
                await asyncio.wait_for(manager.take(1), timeout=60)
            finally:
                await manager.stop()

    with pytest.raises(RolloutError, match=f"rollouts stopped: SGLang server {url} does not "
                                           "answer /generate"):
        asyncio.run(run())
