"""The dataset layouts a prompt file may come in (megatron_rl/data/layouts.py, docs/data.md):
verl's RL parquet written with pyarrow, a Hugging Face `datasets` split saved to disk and JSON
Lines with question / answer columns (GSM8K's "#### N"), and conversation prompts, which reach
the policy through the tokenizer's chat template as the whole conversation."""
import json

import pytest

from megatron_rl.data import PromptFileError, PromptRecord, load_prompts, save_prompts
from megatron_rl.data.tokenizer import prompt_token_ids, train_tokenizer

pytestmark = pytest.mark.unit

SYSTEM = "You are a careful mathematician."
# A template of the usual shape (role headers, a generation prompt), rendered by transformers.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _verl_row(data_source, question, truth, *, index, system=None, ability="math"):
    """A row as verl's examples/data_preprocess scripts write them."""
    prompt = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]
    return {"data_source": data_source, "prompt": prompt, "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": index}}


def _write_parquet(rows, path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_parquet(tmp_path):
    path = _write_parquet([
        _verl_row("openai/gsm8k", "Natalia sold 48 clips ...", "72", index=0, system=SYSTEM),
        _verl_row("DigitalLearningGmbH/MATH-lighteval", "Compute $1+1$.", "2", index=5),
        _verl_row("aime2024", "Find n.", "204", index=1),
        _verl_row("my_lab/arith", "2*3?", "6", index=9),  # unknown source, ability math
    ], tmp_path / "train.parquet")
    gsm8k, math, aime, own = load_prompts(path)
    assert [r.prompt_id for r in (gsm8k, math, aime, own)] == [
        "openai/gsm8k/train/0", "DigitalLearningGmbH/MATH-lighteval/train/5",
        "aime2024/train/1", "my_lab/arith/train/9"]
    assert {r.task for r in (gsm8k, math, aime, own)} == {"math"}
    assert [r.answer for r in (gsm8k, math, aime, own)] == ["72", "2", "204", "6"]
    assert gsm8k.metadata == {"data_source": "openai/gsm8k"}
    # The system prompt is kept: the policy sees the conversation, the question is `prompt`.
    assert gsm8k.prompt == "Natalia sold 48 clips ..."
    assert gsm8k.conversation == [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Natalia sold 48 clips ..."}]
    # A single user turn is a plain text prompt.
    assert math.messages == () and math.conversation == [
        {"role": "user", "content": "Compute $1+1$."}]


def test_verl_rows_that_cannot_be_graded_say_why(tmp_path):
    path = _write_parquet([_verl_row("openai/gsm8k", "q", "1", index=0),
                           _verl_row("apps", "Write a program.", "{}", index=1, ability="code")],
                          tmp_path / "mixed.parquet")
    with pytest.raises(PromptFileError, match=r"mixed.parquet row 1: verl data_source 'apps' "
                                              r"\(ability 'code'\) is not one we grade.*set "
                                              r"ability to 'math'.*convert"):
        load_prompts(path)
    row = _verl_row("openai/gsm8k", "q", "1", index=0)
    row["reward_model"] = {"style": "rule", "ground_truth": ""}
    with pytest.raises(PromptFileError, match=r"row 0: no reward_model.ground_truth"):
        load_prompts(_write_parquet([row], tmp_path / "no_truth.parquet"))
    twice = [_verl_row("openai/gsm8k", "q", "1", index=3)] * 2
    with pytest.raises(PromptFileError, match=r"twice.parquet row 1: prompt id "
                                              r"'openai/gsm8k/train/3' is already the id of "
                                              r".*row 0.*extra_info.index"):
        load_prompts(_write_parquet(twice, tmp_path / "twice.parquet"))


GSM8K = {"question": ["Tom has 3 apples and buys 4 more. How many?",
                      "A farm sells 1,000 eggs a day for 2 days. How many eggs?"],
         "answer": ["3 + 4 = <<3+4=7>>7\n#### 7", "1,000 * 2 = 2,000\n#### 2,000"]}


def test_datasets_split_saved_to_disk(tmp_path):
    import datasets

    split = tmp_path / "gsm8k_train"
    datasets.Dataset.from_dict(GSM8K).save_to_disk(str(split))
    first, second = load_prompts(split)
    assert (first.prompt_id, first.task, first.answer) == ("gsm8k_train/0", "math", "7")
    assert first.prompt == GSM8K["question"][0]
    assert (second.prompt_id, second.answer) == ("gsm8k_train/1", "2000")  # commas dropped
    both = tmp_path / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(GSM8K),
                          "test": datasets.Dataset.from_dict(GSM8K)}).save_to_disk(str(both))
    with pytest.raises(PromptFileError, match=r"several splits; point data.prompts at one of "
                                              r"them: .*gsm8k/train, .*gsm8k/test"):
        load_prompts(both)
    (tmp_path / "not_a_dataset").mkdir()
    with pytest.raises(PromptFileError, match="not one datasets' save_to_disk wrote"):
        load_prompts(tmp_path / "not_a_dataset")


def test_question_answer_jsonl(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": q, "answer": a} for q, a in zip(GSM8K["question"], GSM8K["answer"])]
    rows.append({"id": "own-id", "question": "1 + 1?", "answer": "2"})  # no "####": whole
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    records = load_prompts(path)
    assert [(r.prompt_id, r.answer) for r in records] == [
        ("qa/0", "7"), ("qa/1", "2000"), ("own-id", "2")]
    path.write_text(json.dumps({"question": "q", "answer": "  "}) + "\n")
    with pytest.raises(PromptFileError, match=r"qa.jsonl:1: 'answer' must be a non-empty text"):
        load_prompts(path)
    path.write_text(json.dumps({"query": "q", "response": "1"}) + "\n")
    with pytest.raises(PromptFileError, match=r"qa.jsonl:1: the columns \['query', 'response'\] "
                                              r"match no accepted layout.*verl.*question"):
        load_prompts(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_conversation_prompts_round_trip(tmp_path, suffix):
    conversation = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What is 2 + 2?"},
                    {"role": "assistant", "content": "4."},
                    {"role": "user", "content": "And 3 + 3?"}]
    records = [PromptRecord.with_prompt(conversation, prompt_id="c", task="math", answer="6"),
               PromptRecord(prompt_id="t", task="math", prompt="1 + 1?", answer="2")]
    assert records[0].prompt == "And 3 + 3?" and records[0].conversation == conversation
    path = tmp_path / f"prompts{suffix}"
    save_prompts(records, path)
    assert load_prompts(path) == records
    bad = [*conversation[:2], {"role": "assistant", "content": "4."}]
    with pytest.raises(ValueError, match="must end with the user's turn"):
        PromptRecord.with_prompt(bad, prompt_id="c", task="math", answer="6")
    with pytest.raises(ValueError, match="role 'tool' is not one of"):
        PromptRecord.with_prompt([{"role": "tool", "content": "x"}, conversation[1]],
                                 prompt_id="c", task="math")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([SYSTEM, "What is 2 + 2? <|user|> <|system|> <|assistant|>"] * 4,
                           vocab_size=160)


def test_a_conversation_goes_through_the_chat_template(tokenizer):
    conversation = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What is 2 + 2?"}]
    # Without a chat template a single user turn is its text with the BOS; a conversation has
    # no faithful rendering and is refused rather than flattened.
    assert prompt_token_ids(tokenizer, "What is 2 + 2?") == tokenizer.encode("What is 2 + 2?")
    assert prompt_token_ids(tokenizer, conversation[1:]) == tokenizer.encode("What is 2 + 2?")
    with pytest.raises(ValueError, match=r"conversation \(system, user\).*no chat template"):
        prompt_token_ids(tokenizer, conversation)
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        rendered = f"<|system|>{SYSTEM}\n<|user|>What is 2 + 2?\n<|assistant|>"
        ids = prompt_token_ids(tokenizer, conversation)
        assert ids == tokenizer.encode(rendered, add_special_tokens=False)
        assert all(isinstance(i, int) for i in ids)  # token ids, not a BatchEncoding's keys
        assert prompt_token_ids(tokenizer, "What is 2 + 2?") == tokenizer.encode(
            "<|user|>What is 2 + 2?\n<|assistant|>", add_special_tokens=False)
    finally:
        tokenizer.chat_template = None
