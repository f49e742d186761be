"""Prompt records, JSON Lines / Parquet loading, the deterministic held-out split, and the
reasoning-gym / HumanEval prompt sources."""
import json

import pytest

from megatron_rl.data import (
    CodeTests,
    PromptRecord,
    StdioTest,
    humaneval_prompts,
    load_prompts,
    reasoning_gym_prompts,
    save_prompts,
    split_heldout,
)

pytestmark = pytest.mark.unit


def _mixed_records() -> list[PromptRecord]:
    return [
        PromptRecord(prompt_id="m0", task="math", prompt="1/2 as a decimal?", answer="0.5"),
        PromptRecord(prompt_id="c0", task="code", prompt="add two ints",
                     tests=CodeTests(stdio=(StdioTest(stdin="1 2\n", expected_stdout="3"),),
                                     function_calls=("assert f(1) == 2",), prelude="import os")),
        PromptRecord(prompt_id="r0", task="rg/leg_counting", prompt="legs?", answer="8",
                     metadata={"animals": {"spider": 1}, "nested": [1, [2, 3]]}),
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    records = _mixed_records()
    path = tmp_path / f"prompts{suffix}"
    save_prompts(records, path)
    assert load_prompts(path) == records


def test_jsonl_errors_name_the_line_and_the_fix(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"id": "a", "task": "math", "prompt": "p", "answer": "1"})
    path.write_text(good + "\n\n" + json.dumps({"id": "b", "prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: missing field\(s\) \['task'\]"):
        load_prompts(path)
    path.write_text(good + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_prompts(path)
    path.write_text(good + "\n" + good + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: prompt id 'a' is already the id of "
                                         r".*bad.jsonl:1; ids must be unique"):
        load_prompts(path)
    path.write_text(json.dumps({"id": "c", "task": "code", "prompt": "p",
                                "tests": {"stdio": [{"stdin": ""}]}}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: each 'tests.stdio' entry needs"):
        load_prompts(path)
    with pytest.raises(ValueError, match="must end in one of"):
        load_prompts(tmp_path / "prompts.csv")


def test_reserved_task_name():
    with pytest.raises(ValueError, match="reserved"):
        PromptRecord(prompt_id="x", task="all", prompt="p")


def _many(num_math: int, num_code: int) -> list[PromptRecord]:
    return ([PromptRecord(prompt_id=f"m{i}", task="math", prompt="p", answer="1")
             for i in range(num_math)] +
            [PromptRecord(prompt_id=f"c{i}", task="code", prompt="p",
                          tests=CodeTests(function_calls=("pass",))) for i in range(num_code)])


def test_split_is_deterministic_stratified_and_order_free():
    records = _many(60, 30)
    train, held = split_heldout(records, num_heldout=10, seed=7)
    # 10 held out of 90 in proportion 60:30 -> 6.67 : 3.33 -> largest remainder gives 7 : 3
    assert sum(r.task == "math" for r in held) == 7 and sum(r.task == "code" for r in held) == 3
    assert len(train) == 80 and not {r.prompt_id for r in train} & {r.prompt_id for r in held}
    assert [r.prompt_id for r in held] == [r.prompt_id for r in records if r in held]  # order
    again = split_heldout(list(reversed(records)), num_heldout=10, seed=7)[1]
    assert {r.prompt_id for r in again} == {r.prompt_id for r in held}
    other_seed = split_heldout(records, num_heldout=10, seed=8)[1]
    assert {r.prompt_id for r in other_seed} != {r.prompt_id for r in held}


def test_split_barely_moves_when_prompts_are_added():
    held = {r.prompt_id for r in split_heldout(_many(100, 0), num_heldout=20, seed=0)[1]}
    grown = {r.prompt_id for r in split_heldout(_many(110, 0), num_heldout=20, seed=0)[1]}
    # Old prompts keep their ranks: the old ones still held out were held out before, and the
    # 10 new prompts can displace at most 10 of the 20.
    assert {p for p in grown if int(p[1:]) < 100} <= held
    assert len(held & grown) >= 10


def test_split_unstratified_and_errors():
    train, held = split_heldout(_many(5, 5), num_heldout=4, seed=1, stratify=False)
    assert len(held) == 4 and len(train) == 6
    with pytest.raises(ValueError, match="num_heldout"):
        split_heldout(_many(2, 0), num_heldout=3, seed=0)
    with pytest.raises(ValueError, match="duplicate"):
        split_heldout(_many(2, 0) + _many(1, 0), num_heldout=1, seed=0)


def test_reasoning_gym_source_is_deterministic_in_seed():
    first = reasoning_gym_prompts("basic_arithmetic", num_prompts=3, seed=11)
    assert first == reasoning_gym_prompts("basic_arithmetic", num_prompts=3, seed=11)
    assert first != reasoning_gym_prompts("basic_arithmetic", num_prompts=3, seed=12)
    assert {r.task for r in first} == {"rg/basic_arithmetic"}
    assert first[0].prompt_id == "rg/basic_arithmetic/11/0" and "<answer>" in first[0].prompt
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'nope'.*leg_counting"):
        reasoning_gym_prompts("nope", num_prompts=1, seed=0)


def test_humaneval_source():
    records = humaneval_prompts()
    assert len(records) == 164 and {r.task for r in records} == {"code"}
    first = records[0]
    assert first.prompt_id == "HumanEval/0" and "def has_close_elements" in first.prompt
    assert first.tests.function_calls[0].rstrip().endswith("check(has_close_elements)")
    assert first.tests.prelude == "from typing import List"
    with pytest.raises(ValueError, match="HumanEval/999"):
        humaneval_prompts(["HumanEval/999"])
