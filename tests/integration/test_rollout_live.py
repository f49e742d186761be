"""Forced interruption against a live SGLang CPU server (the shared tiny Llama, fp32, reset to its
launch state: tests/integration/conftest.py): completions cut at their drawn thinking budget get
the interruption phrase (tokenized once by the model's own tokenizer) and are continued by a
second request from prompt + output + phrase, concurrently from one event loop through the async
client.

Independent reference: transformers' forward pass over the whole assembled sequence; every
sampled token's recorded behaviour log-prob must equal log softmax(logits / T) there (so the
continuation really was conditioned on the phrase), the phrase tokens carry loss mask 0 and no
version, and every sampled token carries the server's version.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_sglang_weight_sync import LOGPROB_TOLERANCE  # noqa: E402

TEMPERATURE = 0.8


def test_forced_interruption_on_a_live_server(llama_generator):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.config import load_config
    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.async_client import AsyncSGLangClient
    from megatron_rl.rollout.interruption import (InterruptionSettings, bind_generate,
                                                   generate_completion)
    from megatron_rl.rollout.samples import NOT_SAMPLED

    model_dir = llama_generator.server.settings.model_path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollout = load_config(None, [
        f"rollout.temperature={TEMPERATURE}", "rollout.thinking_budget_min=6",
        "rollout.thinking_budget=10", "rollout.solution_budget=120"]).rollout
    settings = InterruptionSettings.from_rollout_config(
        rollout, lambda text: tokenizer.encode(text, add_special_tokens=False),
        decode=tokenizer.decode)
    # Sampling runs to the length limit (ignore_eos), so the thinking part is always cut unless
    # the model happens to write "</think>" itself.
    params = SamplingParams.for_training(rollout, max_new_tokens=1, ignore_eos=True, seed=5)
    prompts = [(5, 6, 7), (9, 10, 11, 12), (20, 21), (30, 31, 32, 33, 34)]

    async def rollouts():
        async with AsyncSGLangClient(llama_generator.url, request_timeout_s=120,
                                     api_key=llama_generator.server.settings.api_key) as client:
            async def one(group_id, prompt):
                bound = bind_generate(client, params, extra_key="v0")

                async def generate_one(input_ids, *args, **kwargs):
                    result = await bound(input_ids, *args, **kwargs)
                    requests.append((tuple(input_ids), result.cached_tokens))
                    return result

                return await generate_completion(generate_one, prompt, settings=settings,
                                                 rng=random.Random(group_id),
                                                 group_id=group_id, sample_index=0)
            return await asyncio.gather(*(one(g, p) for g, p in enumerate(prompts)))

    requests = []  # (input ids, cached tokens the server reported)
    samples = asyncio.run(rollouts())
    # SGLang's meta_info["cached_tokens"] (GenerationResult.cached_tokens): the prompts share no
    # prefix (the cache was flushed at the reset), and a continuation's input begins with what
    # its first request computed, which the prefix cache serves.
    firsts = [cached for ids, cached in requests if ids in prompts]
    continuations = [(ids, cached) for ids, cached in requests if ids not in prompts]
    assert firsts == [0] * len(prompts) and continuations
    # More than any prompt: the thinking (6-10 tokens, all but its last token computed) too.
    assert all(5 < cached < len(ids) for ids, cached in continuations), \
        [(len(ids), cached) for ids, cached in continuations]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    version = int(llama_generator.server_weight_version())
    interrupted = [s for s in samples if s.interrupted]
    assert len(interrupted) >= 3, [s.token_ids for s in samples]
    for sample in interrupted:
        budget = sample.thinking_budget
        # After a space unless the thinking ends in whitespace (never "-3Okay, time is up.").
        phrase = settings.phrase_after(sample.token_ids[:budget])
        text = tokenizer.decode(sample.token_ids[:budget + len(phrase)])
        assert text.endswith(rollout.interruption_phrase)
        assert text[-len(rollout.interruption_phrase) - 1].isspace()
        assert 6 <= budget <= 10 and sample.segment_offsets == (0, budget, budget + len(phrase))
        assert sample.token_ids[budget:budget + len(phrase)] == phrase
        assert len(sample.token_ids) == budget + settings.solution_budget  # ran to the limit
        assert sample.loss_mask == (1,) * budget + (0,) * len(phrase) + \
            (1,) * (settings.solution_budget - len(phrase))
        assert set(sample.versions[budget:budget + len(phrase)]) == {NOT_SAMPLED}
        assert set(sample.sampled_versions) == {version}
        sequence = torch.tensor([sample.prompt_token_ids + sample.token_ids])
        with torch.no_grad():
            logits = reference(sequence).logits[0].double()
        start = len(sample.prompt_token_ids)
        expected = torch.log_softmax(logits[start - 1:-1] / TEMPERATURE, dim=-1).gather(
            -1, sequence[0, start:, None]).squeeze(-1)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        recorded = torch.tensor(sample.logprobs, dtype=torch.float64)
        diff = (recorded - expected)[mask].abs().max().item()
        assert diff < LOGPROB_TOLERANCE, f"max |logp diff| {diff} at T={TEMPERATURE}"


def test_rollout_manager_admits_under_the_bound_and_scores_with_the_verifier(llama_generator):
    """The manager on a live server with reasoning-gym prompts and their own scorer: groups of
    G forced-interruption completions, scored by the real verifier, handed out under the
    staleness bound (k = 1, 2 prompts per step: at most 4 groups started before version 1)."""
    from transformers import AutoTokenizer

    from megatron_rl.algorithms import NoPositiveResamplingSampler
    from megatron_rl.config import load_config
    from megatron_rl.data.sources import PROCEDURAL_TASK_PREFIX, reasoning_gym_prompts
    from megatron_rl.rewards import ProceduralReward, ProceduralRewardConfig, RewardRegistry
    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.async_client import AsyncSGLangClient
    from megatron_rl.rollout.interruption import InterruptionSettings
    from megatron_rl.rollout.manager import RolloutManager
    from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings

    tokenizer = AutoTokenizer.from_pretrained(llama_generator.server.settings.model_path)
    records = reasoning_gym_prompts("basic_arithmetic", num_prompts=6, seed=0, instruction="",
                                    config={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                            "max_digits": 1})
    registry = RewardRegistry()
    registry.register(PROCEDURAL_TASK_PREFIX, ProceduralReward(ProceduralRewardConfig()),
                      requires=("answer",))
    rollout = load_config(None, ["rollout.samples_per_prompt=3", "rollout.thinking_budget_min=4",
                                 "rollout.thinking_budget=8",
                                 "rollout.solution_budget=100"]).rollout
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    gate = AdmissionGate(StalenessSettings(max_off_policyness=1, prompts_per_step=2))

    async def run():
        async with AsyncSGLangClient(llama_generator.url, request_timeout_s=120,
                                     api_key=llama_generator.server.settings.api_key) as client:
            manager = RolloutManager(
                clients=[client], prompt_token_ids=[encode(r.prompt) for r in records],
                records=records, sampler=NoPositiveResamplingSampler(len(records), seed=0),
                gate=gate, params=SamplingParams.for_training(rollout, max_new_tokens=1,
                                                              seed=1),
                interruption=InterruptionSettings.from_rollout_config(rollout, encode),
                score=registry.score_many, decode=tokenizer.decode, max_finished_groups=16)
            manager.start()
            try:
                first = await manager.take(2)
                second = await manager.take(2)
                # Version 0 allows (k + 1 + 0) x 2 = 4 groups: nothing more starts, so a fifth
                # group never arrives until the trainer publishes version 1.
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(manager.take(1), timeout=5)
                return first + second, manager.num_in_flight
            finally:
                await manager.stop()

    groups, in_flight = asyncio.run(run())
    assert gate.num_admitted == 4 and in_flight == 0
    assert len({g.group_id for g in groups}) == 4
    for group in groups:
        assert len(group.samples) == 3 and len(group.results) == 3
        assert group.oldest_version == 0 and group.admission_version == 0
        # Seeded sampling, each sample its own seed: the random tiny model's near-flat
        # distribution gives three different completions (one seed for all gave three copies).
        assert len({sample.token_ids for sample in group.samples}) == 3, group.samples
        for sample, result in zip(group.samples, group.results):
            assert sample.group_id == group.group_id and sample.num_loss_tokens > 0
            assert result.reward is not None and not result.verifier_failed
            assert result.reason in ("correct", "wrong", "no_answer", "parse_error")


def test_a_thousand_requests_in_flight_on_one_generator_and_no_false_death(llama_generator):
    """Big validation (issue 29) on the real CPU engine: 1000 one-token requests in flight at once
    on one SGLang server through the manager's run_anywhere (validation's path), while the
    driver's liveness check runs (the shortest window the recipe allows, 30 s): every request is
    answered and the generator is never taken out. SGLang's /health_generate, the liveness
    probe, passes both while the engine is busy with them and when it is idle. And a stop token
    (how the thinking request ends at "</think>", rollout/interruption.py) ends a completion as
    its last token, with finish reason "stop"."""
    import time

    from megatron_rl.algorithms import NoPositiveResamplingSampler
    from megatron_rl.data.records import PromptRecord
    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.async_client import AsyncSGLangClient
    from megatron_rl.rollout.interruption import InterruptionSettings
    from megatron_rl.rollout.manager import RolloutManager
    from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings

    num_requests, window_s = 1000, 30.0
    record = PromptRecord(prompt_id="p0", task="rg/x", prompt="1 + 1 =", answer="2")
    params = SamplingParams(max_new_tokens=1, purpose="eval", seed=3)

    async def run():
        async with AsyncSGLangClient(llama_generator.url,
                                     api_key=llama_generator.server.settings.api_key) as client:
            manager = RolloutManager(
                clients=[client], prompt_token_ids=[[5, 6]], records=[record],
                sampler=NoPositiveResamplingSampler(1, seed=0),
                gate=AdmissionGate(StalenessSettings(max_off_policyness=0, prompts_per_step=1)),
                params=SamplingParams(max_new_tokens=1, num_samples=2),
                interruption=InterruptionSettings(enabled=False, thinking_budget_min=4,
                                                  thinking_budget=4, solution_budget=4),
                score=lambda texts, records: [], decode=str, max_finished_groups=1)
            taken_out: dict[int, str] = {}

            async def driver_health_check():  # returns on a (false) death: fails at once
                while not taken_out:
                    taken_out.update(await manager.check_liveness(window_s))
                    await asyncio.sleep(0.5)

            async def request(key, c):
                result = await c.generate_one([5 + key % 300, 6, 7], 1,
                                              params.for_sample("eval", key))
                return result.token_ids

            started = time.monotonic()
            watcher = asyncio.create_task(driver_health_check())
            requests = asyncio.gather(*(manager.run_anywhere(i, lambda c, i=i: request(i, c))
                                        for i in range(num_requests)))
            for _ in range(3):  # every request sent; none can have been answered yet
                await asyncio.sleep(0)
            in_flight = client.progress().in_flight
            probing = asyncio.ensure_future(client.probe(60.0))
            try:
                await asyncio.wait({watcher, requests}, timeout=300,
                                   return_when=asyncio.FIRST_COMPLETED)
                assert not taken_out, (taken_out, client.progress())
                answers = requests.result()
                busy_probe = await probing
            finally:
                for task in (watcher, requests, probing):
                    task.cancel()
                await asyncio.gather(watcher, requests, probing, return_exceptions=True)
            elapsed = time.monotonic() - started
            idle_probe = await client.probe(30.0)
            # A stop token ends the completion as its last token (what the thinking request's
            # end-of-thinking stop relies on): greedy, then stopped at its third token.
            greedy = SamplingParams(max_new_tokens=8, purpose="eval", temperature=0.0,
                                    ignore_eos=True)
            free = await client.generate_one([5, 6, 7], 8, greedy)
            stop = free.token_ids[2]
            stopped = await client.generate_one(
                [5, 6, 7], 8, dataclasses.replace(greedy, ignore_eos=False,
                                                  stop_token_ids=(stop,)))
            return (answers, in_flight, manager.take_failures(), manager.down, busy_probe,
                    idle_probe, elapsed, free, stopped, stop)

    (answers, in_flight, failures, down, busy_probe, idle_probe, elapsed, free, stopped,
     stop) = asyncio.run(run())
    assert len(answers) == num_requests and all(len(a) == 1 for a in answers)
    assert in_flight == num_requests  # all of them in flight at once
    assert not failures and down == frozenset(), (failures, elapsed)
    assert busy_probe is None  # busy: a forward step completed
    assert idle_probe is None  # idle: SGLang's one-token health generation
    first_stop = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[:first_stop + 1]
    assert stopped.finish_reason == "stop"
