"""The demo's cold-start data (tools/make_demo_base.py): worked solutions that reasoning-gym's own
scorer grades correct, SFT prompts disjoint from the RL prompt pool and so from any held-out split
of it, the task tokenizer (digits one token each, tags one token, lossless, deterministic), and
the Llama-4 layout SGLang serves."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.data import PromptRecord, reasoning_gym_prompts, split_heldout
from megatron_rl.data.worked_solutions import (unique_reasoning_gym_prompts, worked_solution,
                                               worked_solution_examples)
from megatron_rl.rewards.procedural import ProceduralReward
from megatron_rl.rewards.types import Reason

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _demo_tool():
    spec = importlib.util.spec_from_file_location("make_demo_base",
                                                  ROOT / "tools/make_demo_base.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_data():
    """The RL prompt pool and the SFT problems exactly as the demo build makes them."""
    tool = _demo_tool()
    settings = tool.BuildSettings()
    pool = unique_reasoning_gym_prompts(tool.DATASET, num_prompts=settings.num_rl_prompts,
                                        seed=settings.rl_prompt_seed, config=tool.TASK_CONFIG)
    sft_records = unique_reasoning_gym_prompts(
        tool.DATASET, num_prompts=settings.num_sft_examples, seed=settings.sft_data_seed,
        config=tool.TASK_CONFIG, exclude_prompts={r.prompt for r in pool})
    return tool, settings, pool, sft_records


def test_worked_solution_by_hand():
    record = PromptRecord(prompt_id="x", task="rg/chain_sum", prompt="8 - 5 + 2 =", answer="5",
                          metadata={"expression": "8 - 5 + 2"})
    assert worked_solution(record) == "<think>8 - 5 + 2 : 8 - 5 = 3 , 3 + 2 = 5</think> " \
                                      "<answer>5</answer>"
    assert worked_solution(record, long=True) == \
        "<think>8 - 5 + 2 : 8 - 5 + 2 : 8 - 5 = 3 , 3 + 2 = 5</think> <answer>5</answer>"
    with pytest.raises(ValueError, match="differs from the dataset's answer '4'"):
        worked_solution(PromptRecord(prompt_id="y", task="rg/chain_sum", prompt="p", answer="4",
                                     metadata={"expression": "8 - 5 + 2"}))
    with pytest.raises(ValueError, match="no worked solutions for task 'rg/leg_counting'"):
        worked_solution(PromptRecord(prompt_id="z", task="rg/leg_counting", prompt="p"))


def test_every_worked_solution_is_graded_correct_by_reasoning_gym(demo_data):
    _, _, pool, sft_records = demo_data
    # Also negative operands, more terms and digits than the demo uses.
    wider = reasoning_gym_prompts("chain_sum", num_prompts=200, seed=5, config={
        "min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 3,
        "allow_negation": True})
    reward = ProceduralReward()
    for record in [*sft_records, *pool, *wider]:
        for long in (False, True):
            text = worked_solution(record, long=long)
            result = reward(text, record)
            assert result.reason is Reason.CORRECT, (record.prompt, text, result)
    # A wrong result in the same format is graded wrong (the scorer reads this format).
    record = sft_records[0]
    wrong = worked_solution(record).replace(f"<answer>{record.answer}<",
                                            f"<answer>{int(record.answer) + 1}<")
    assert reward(wrong, record).reason is Reason.WRONG


def test_sft_prompts_never_include_a_pool_or_heldout_prompt(demo_data):
    tool, settings, pool, sft_records = demo_data
    sft_prompts = [r.prompt for r in sft_records]
    assert len(sft_records) == settings.num_sft_examples == len(set(sft_prompts))
    assert len({r.prompt for r in pool}) == len(pool) == settings.num_rl_prompts
    assert not set(sft_prompts) & {r.prompt for r in pool}
    # Whatever held-out size and run seed the RL run picks.
    for num_heldout, seed in ((8, 1234), (64, 1234), (100, 7)):
        train, heldout = split_heldout(pool, num_heldout=num_heldout, seed=seed)
        assert len(heldout) == num_heldout
        assert not {r.prompt for r in heldout} & set(sft_prompts)
        assert not {r.prompt for r in heldout} & {r.prompt for r in train}
    # The examples written for SFT are these records' worked solutions, deterministically.
    # The demo mixes the two styles evenly: every second example is long.
    examples = worked_solution_examples(
        tool.DATASET, num_examples=50, seed=settings.sft_data_seed, config=tool.TASK_CONFIG,
        exclude_prompts={r.prompt for r in pool}, long_fraction=settings.long_fraction)
    assert settings.long_fraction == 0.5
    assert [(e.prompt, e.response) for e in examples] == \
        [(r.prompt, worked_solution(r, long=i % 2 == 1)) for i, r in enumerate(sft_records[:50])]
    plain = worked_solution_examples(
        tool.DATASET, num_examples=4, seed=settings.sft_data_seed, config=tool.TASK_CONFIG,
        exclude_prompts={r.prompt for r in pool})
    assert [e.response for e in plain] == [worked_solution(r) for r in sft_records[:4]]
    with pytest.raises(ValueError, match="rg/chain_sum refuses the config.*max_term"):
        unique_reasoning_gym_prompts("chain_sum", num_prompts=3, seed=0, config={"max_term": 3})
    with pytest.raises(ValueError, match="too few distinct problems"):
        unique_reasoning_gym_prompts("chain_sum", num_prompts=300, seed=0, config={
            "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})


def test_task_tokenizer_spells_digits_keeps_tags_and_is_deterministic(demo_data):
    from megatron_rl.config import INTERRUPTION_PHRASE
    from megatron_rl.data.tokenizer import TAG_TOKENS, train_tokenizer

    _, _, pool, sft_records = demo_data
    texts = [t for r in sft_records[:500] for t in (r.prompt, worked_solution(r))]
    tokenizer = train_tokenizer(texts + [INTERRUPTION_PHRASE] * 50, vocab_size=256)
    assert len(tokenizer) <= 256
    assert all(sum(c.isdigit() for c in token) <= 1 for token in tokenizer.get_vocab())
    for tag in TAG_TOKENS:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    record = pool[0]
    for text in (record.prompt, worked_solution(record), INTERRUPTION_PHRASE, "7 - -12 = 19"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    prompt_ids = tokenizer.encode(record.prompt)
    assert prompt_ids[0] == tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    again = train_tokenizer(texts + [INTERRUPTION_PHRASE] * 50, vocab_size=256)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    with pytest.raises(ValueError, match="cannot hold"):
        train_tokenizer(texts, vocab_size=64)


def test_sglang_layout_holds_the_same_tensors_under_language_model(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from models import get_model_family, model_family_for_hf_config
    from models.llama4.convert import write_sglang_layout

    config_dict = dict(get_model_family("llama4").hf_config("demo"))
    model_type = config_dict.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config_dict))
    model.save_pretrained(tmp_path / "text")
    (tmp_path / "text/tokenizer.json").write_text("{}")
    served = write_sglang_layout(tmp_path / "text", tmp_path / "served", dtype=torch.bfloat16)
    config = json.loads((served / "config.json").read_text())
    assert config["architectures"] == ["Llama4ForConditionalGeneration"]
    assert (served / "tokenizer.json").read_text() == "{}"
    tensors = load_file(str(served / "model.safetensors"))
    state = model.state_dict()
    assert sorted(tensors) == sorted(f"language_model.{n}" for n in state)
    for name, tensor in state.items():
        assert torch.equal(tensors[f"language_model.{name}"], tensor.to(torch.bfloat16))
    # The converter's family lookup binds the same text config (chunk 48, NoPE every 4th layer).
    text = model_family_for_hf_config(config).hf_config
    assert (text.attention_chunk_size, text.no_rope_layers, text.hidden_size) == \
        (48, [1, 1, 1, 0], 128)
    with pytest.raises(ValueError, match="not a text-only Llama4ForCausalLM"):
        write_sglang_layout(served, tmp_path / "again")
