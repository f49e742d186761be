"""The tool-use demo's warm-up data (megatron_rl/data/tool_solutions.py): trajectories whose tokens
are exactly what the multi-turn rollout produces (the model's turns, then the observation the real
sandbox's stdout renders to, joined without a BPE merge across a boundary), graded correct by
reasoning-gym's own `products` scorer, and SFT problems that never include an RL pool prompt."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.data.loading import load_prompts, save_prompts
from megatron_rl.data.sources import PROCEDURAL_TASK_PREFIX
from megatron_rl.data.tokenizer import train_tokenizer
from megatron_rl.data.tool_solutions import (DATASET, OBSERVATION_TEMPLATE, TOOL_CLOSE, TOOL_OPEN,
                                             TOOL_TAG_TOKENS, TOOL_TASK, tool_prompts,
                                             tool_solution_examples, tool_trajectory)
from megatron_rl.rewards.procedural import ProceduralReward

pytestmark = pytest.mark.unit

CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3}  # the demo's task


@pytest.fixture(scope="module")
def records():
    return tool_prompts(num_prompts=24, seed=7, config=CONFIG)


@pytest.fixture(scope="module")
def tokenizer(records):
    texts = [text for r in records for use_tool in (False, True)
             for text in (r.prompt, "".join(s.text for s in tool_trajectory(r, use_tool=use_tool)))]
    return train_tokenizer(texts, vocab_size=256, added_tokens=TOOL_TAG_TOKENS)


def test_records_keep_what_the_inner_scorer_needs(records, tmp_path):
    save_prompts(records, tmp_path / "prompts.jsonl")
    loaded = load_prompts(tmp_path / "prompts.jsonl")
    assert loaded == records
    assert {r.task for r in loaded} == {TOOL_TASK}
    for record in loaded:
        terms = record.metadata["expression"].split(" * ")
        assert len(terms) == 2 and all(2 <= len(t) <= 3 for t in terms)
        assert record.prompt.startswith(f"Solve the following multiplication: "
                                        f"{record.metadata['expression']}.")


def test_trajectories_are_graded_by_reasoning_gyms_scorer(records):
    reward = ProceduralReward()
    for record in records[:6]:
        inner = dataclasses.replace(record, task=PROCEDURAL_TASK_PREFIX + DATASET)
        for use_tool in (False, True):
            segments = tool_trajectory(record, use_tool=use_tool)
            # the environment grades the model's turns joined, observations excluded
            model_text = "".join(s.text for s in segments if not s.observation)
            assert reward(model_text, inner).passed, model_text
            wrong = model_text.replace(f"<answer>{record.answer}<", f"<answer>{record.answer}1<")
            assert not reward(wrong, inner).passed


def test_tool_trajectory_tokens_join_as_the_rollout_joins_them(records, tokenizer):
    from megatron_rl.rewards.sandbox import Sandbox, SandboxConfig

    for tag in (TOOL_OPEN, TOOL_CLOSE, "<output>", "</output>"):
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1, tag
    with Sandbox(SandboxConfig(isolation="auto", num_workers=1)) as sandbox:
        for record in records[:4]:
            first, observation, last = tool_trajectory(record, use_tool=True)
            assert first.text.endswith(TOOL_CLOSE) and observation.observation
            code = first.text[first.text.index(TOOL_OPEN) + len(TOOL_OPEN):-len(TOOL_CLOSE)]
            result = sandbox.run(code)  # the observation is what the real sandbox prints
            assert result.ok, result
            assert observation.text == OBSERVATION_TEMPLATE.format(content=result.stdout)
            # The rollout concatenates the model's turn, the rendered observation (encoded
            # without special tokens) and the next turn, as SFT tokenizes the example's pieces;
            # no merge crosses a boundary, so the whole text tokenizes the same
            whole = tokenizer.encode(first.text + observation.text + last.text,
                                     add_special_tokens=False)
            pieces = [t for s in (first, observation, last)
                      for t in tokenizer.encode(s.text, add_special_tokens=False)]
            assert whole == pieces


def test_sft_problems_exclude_the_pool_by_text_and_are_deterministic(records):
    pool = {r.prompt for r in records}
    # the pool's own seed: without the exclusion the first 24 problems would be the pool's
    examples = tool_solution_examples(num_examples=40, seed=7, config=CONFIG,
                                      exclude_prompts=pool, tool_fraction=0.4)
    assert len({e.prompt for e in examples}) == 40
    assert not pool & {e.prompt for e in examples}
    assert sum(TOOL_CLOSE in e.response for e in examples) == 16  # 40 % call the tool
    # The observation is a piece of its own (not trained on), the tool's output in the template.
    for example in examples:
        observed = [text for text, observation in example.pieces() if observation]
        if TOOL_CLOSE in example.response:
            value = example.response.split("<answer>")[1].split("</answer>")[0]
            assert observed == [OBSERVATION_TEMPLATE.format(content=f"{value}\n")], example
        else:
            assert observed == [] and example.observations == (), example
    again = tool_solution_examples(num_examples=40, seed=7, config=CONFIG,
                                   exclude_prompts=pool, tool_fraction=0.4)
    assert again == examples
