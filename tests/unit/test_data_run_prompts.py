"""A run's prompts (megatron_rl/data/run_prompts.py) and `megatron-rl train` on bad input: every
data problem is one line `megatron-rl train: error: WHERE: ...` with the fix, exit status 2, and
nothing written to output_dir (the contract of config errors). The checkpoint here is only what
the driver reads before it starts anything: config.json and a tokenizer."""
import json
import re
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data import PromptRecord, save_prompts, split_heldout
from megatron_rl.data.tokenizer import train_tokenizer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples/configs/tiny_pipeline.yaml"  # max_prompt_tokens 80, 8 held out
CONTEXT = 16384  # the tiny Llama's max_position_embeddings


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig

    directory = tmp_path_factory.mktemp("checkpoint")
    tokenizer = train_tokenizer(["What is 12 + 7? The answer is 19. System: be brief."] * 8,
                                vocab_size=160)
    tokenizer.save_pretrained(directory)
    LlamaConfig(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=CONTEXT).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def registry():
    from megatron_rl.rewards import MathVerifier, Sandbox, default_registry

    math_verifier, sandbox = MathVerifier(), Sandbox()  # their workers start lazily: never here
    yield default_registry(math_verifier=math_verifier, sandbox=sandbox)
    math_verifier.close()
    sandbox.close()


def _math(index: int, prompt: str | None = None, **fields) -> dict:
    return {"id": f"m{index}", "task": "math", "prompt": prompt or f"What is {index} + 1?",
            "answer": str(index + 1), **fields}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                            for row in rows))
    return path


def _twelve(path: Path, *, replace: dict[int, object] | None = None) -> Path:
    rows = [_math(i) for i in range(12)]
    for index, row in (replace or {}).items():
        rows[index] = row
    return _jsonl(path, rows)


# (name, write the prompt file into tmp_path -> data.prompts, extra overrides, what the error
# says after "megatron-rl train: error: ")
BAD_INPUTS = [
    ("math row without answer",
     lambda d: _twelve(d / "p.jsonl", replace={4: {"id": "m4", "task": "math", "prompt": "q"}}),
     [], r"{file}:5: prompt 'm4' \(task 'math'\) has no 'answer', which its reward needs; add "
         r"it or remove the prompt$"),
    ("unknown task tag",
     lambda d: _twelve(d / "p.jsonl", replace={2: _math(2, task="algebra")}),
     [], r"{file}:3: no environment for task 'algebra': environments are registered for "
         r"\['tool/\*'\] and rewards for \['code', 'math', 'rg/\*'\]\. Fix the prompt's 'task' "
         r"field or register one"),
    ("broken JSON line",
     lambda d: _twelve(d / "p.jsonl", replace={6: '{"id": "m6", "task": "math",'}),
     [], r"{file}:7: not valid JSON \(.*\); each line must be one complete JSON object$"),
    ("duplicate ids",
     lambda d: _twelve(d / "p.jsonl", replace={9: _math(3)}),
     [], r"{file}:10: prompt id 'm3' is already the id of {file}:4; ids must be unique .*give "
         r"every prompt its own 'id'$"),
    ("empty file",
     lambda d: _jsonl(d / "p.jsonl", []),
     [], r"{file}: no prompts \(the file is empty\); give a file with at least one prompt"),
    ("fewer prompts than held out",
     lambda d: _jsonl(d / "p.jsonl", [_math(i) for i in range(5)]),
     [], r"eval.num_heldout_prompts: 8 held-out prompts leave none of the 5 prompts of {file} "
         r"to train on; set it below 5 or give more prompts$"),
    ("verl row of a task we do not grade",
     lambda d: _jsonl(d / "verl.jsonl", [{
         "data_source": "apps", "ability": "code", "prompt": [{"role": "user", "content": "x"}],
         "reward_model": {"style": "rule", "ground_truth": "{}"}}]),
     [], r"{file}:1: verl data_source 'apps' \(ability 'code'\) is not one we grade.*set ability "
         r"to 'math'"),
    ("a conversation and no chat template",
     lambda d: _twelve(d / "p.jsonl", replace={0: _math(0, prompt=[
         {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}])}),
     [], r"{file}:1: prompt 'm0': the prompt is a conversation \(system, user\) and the "
         r"tokenizer has no chat template to render it; use a tokenizer with one"),
    ("a prompt over max_prompt_tokens",
     lambda d: _twelve(d / "p.jsonl", replace={5: _math(5, prompt="What is 12 + 7? " * 40)}),
     [], r"{file}:6: prompt 'm5' is \d+ tokens long, more than rollout.max_prompt_tokens = 80; "
         r"raise it \(and train.micro_batch_max_tokens\) or remove the long prompts$"),
    ("budgets over the model's context",
     lambda d: _twelve(d / "p.jsonl"),
     ["rollout.thinking_budget=16300", "train.micro_batch_max_tokens=20000"],
     r"rollout.max_prompt_tokens \+ rollout.thinking_budget \+ rollout.solution_budget = 80 \+ "
     r"16300 \+ 40 = 16420 tokens, more than the model's context of 16384 "
     r"\(max_position_embeddings in .*config.json\).*; lower them to fit$"),
    ("no such file",
     lambda d: d / "missing.jsonl",
     [], r"{file}: no such file; check data.prompts$"),
]


@pytest.mark.parametrize("name,write,overrides,expected", BAD_INPUTS,
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, checkpoint, name,
                                                          write, overrides, expected):
    from megatron_rl.train import main

    prompts = write(tmp_path)
    out = tmp_path / "run"
    code = main([str(RECIPE), f"output_dir={out}", f"model.hf_checkpoint={checkpoint}",
                 f"data.prompts={prompts}", *overrides])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    pattern = "megatron-rl train: error: " + expected.format(file=re.escape(str(prompts)))
    assert re.match(pattern, lines[0]), (lines[0], pattern)
    assert not out.exists(), sorted(out.rglob("*"))


def _config(prompts, checkpoint, *overrides):
    return load_config(RECIPE, [f"data.prompts={prompts}", f"model.hf_checkpoint={checkpoint}",
                                *overrides])


def test_run_prompts_are_split_and_tokenized_in_step(tmp_path, checkpoint, registry):
    from transformers import AutoTokenizer

    from megatron_rl.data.run_prompts import load_run_prompts

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = _twelve(tmp_path / "p.jsonl")
    run = load_run_prompts(_config(prompts, checkpoint), tokenizer, registry)
    train, heldout = split_heldout([PromptRecord.from_json(_math(i)) for i in range(12)],
                                   num_heldout=8, seed=1234)  # the recipe's seed and count
    assert run.train_records == train and run.heldout_records == heldout
    for records, ids in ((run.train_records, run.train_prompt_ids),
                         (run.heldout_records, run.heldout_prompt_ids)):
        assert ids == [tokenizer.encode(r.prompt) for r in records]


def test_the_long_prompt_error_names_the_long_prompt(tmp_path, checkpoint, registry):
    """The held-out prompts come after the training ones in the token-id lists, not in file
    order: the error must name the prompt that is too long, and where it is."""
    from transformers import AutoTokenizer

    from megatron_rl.data.run_prompts import load_run_prompts

    records = [PromptRecord.from_json(_math(i)) for i in range(12)]
    train, heldout = split_heldout(records, num_heldout=8, seed=1234)
    # A held-out prompt whose place in train + heldout is not its place in the file.
    long_index = next(records.index(r) for j, r in enumerate(heldout)
                      if records.index(r) != len(train) + j)
    long_id = records[long_index].prompt_id
    prompts = _twelve(tmp_path / "p.jsonl", replace={long_index: _math(
        long_index, prompt="What is 12 + 7? " * 40)})
    with pytest.raises(ConfigError) as raised:
        load_run_prompts(_config(prompts, checkpoint), AutoTokenizer.from_pretrained(checkpoint),
                         registry)
    assert str(raised.value).startswith(f"{prompts}:{long_index + 1}: prompt {long_id!r} is ")


def test_a_conversation_prompt_reaches_the_policy_through_the_chat_template(
        tmp_path, checkpoint, registry):
    from transformers import AutoTokenizer

    from megatron_rl.data.run_prompts import load_run_prompts

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                               "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    verl = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"What is {i} + 7?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 7)},
             "extra_info": {"split": "train", "index": i}} for i in range(12)]
    run = load_run_prompts(_config(_jsonl(tmp_path / "verl.jsonl", verl), checkpoint),
                           tokenizer, registry)
    record, ids = run.train_records[0], run.train_prompt_ids[0]
    number = int(record.prompt_id.rsplit("/", 1)[1])
    assert ids == tokenizer.encode(f"[system] Be brief.\n[user] What is {number} + 7?\n"
                                   "[assistant]", add_special_tokens=False)
    assert record.answer == str(number + 7) and record.task == "math"


def test_generated_prompts_and_saved_files_in_our_layout(tmp_path, checkpoint, registry):
    from transformers import AutoTokenizer

    from megatron_rl.data.run_prompts import load_run_prompts

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    longer = "rollout.max_prompt_tokens=400"  # reasoning-gym's text, in this small vocabulary
    run = load_run_prompts(_config("rg/basic_arithmetic", checkpoint, longer,
                                   "data.num_generated_prompts=12"), tokenizer, registry)
    assert len(run.train_records) == 4 and len(run.heldout_records) == 8
    assert {r.task for r in run.train_records} == {"rg/basic_arithmetic"}
    parquet = tmp_path / "p.parquet"
    save_prompts(run.train_records + run.heldout_records, parquet)
    again = load_run_prompts(_config(parquet, checkpoint, longer), tokenizer, registry)
    assert again == run
    with pytest.raises(ConfigError, match=r"data.prompts: unknown reasoning-gym dataset 'nope'"):
        load_run_prompts(_config("rg/nope", checkpoint), tokenizer, registry)


class _ToolEnvironment:
    """Stand-in of a multi-turn Environment (environments/base.py): its first messages put a
    system message before the record's conversation."""

    multi_turn = True

    def initial_messages(self, record):
        return [{"role": "system", "content": "Be brief."}, *record.conversation]


class _Environments:
    """Stand-in of environments/registry.py EnvironmentRegistry: "tool/..." tasks are
    multi-turn, the others their (single-turn) verifier; `check` records what it was given."""

    def __init__(self, problem: str | None = None):
        self.checked, self.problem = [], problem

    def for_task(self, task):
        if task.startswith("tool/"):
            return _ToolEnvironment()
        return type("Verifier", (), {"multi_turn": False})()

    def check(self, records):
        self.checked += records
        if self.problem:
            raise ValueError(self.problem)


def test_multi_turn_prompts_start_from_their_environments_first_messages(
        tmp_path, checkpoint, registry):
    from transformers import AutoTokenizer

    from megatron_rl.data.run_prompts import load_run_prompts

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                               "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    rows = [_math(i, task="tool/math" if i % 2 else "math") for i in range(12)]
    prompts = _jsonl(tmp_path / "p.jsonl", rows)
    environments = _Environments()
    # A prompt and its longest trajectory (80 + 8 turns x (24 + 40) = 592) is one sequence.
    with pytest.raises(ConfigError, match=r"train.micro_batch_max_tokens: 512 cannot hold a "
                       r"multi-turn trajectory: .* = 80 \+ 512 = 592 tokens; raise it to >= 592"):
        load_run_prompts(_config(prompts, checkpoint), tokenizer, registry, environments)
    run = load_run_prompts(_config(prompts, checkpoint, "environment.max_turns=3"), tokenizer,
                           registry, environments)
    tool_records = [r for r in run.train_records + run.heldout_records if r.task == "tool/math"]
    assert len(tool_records) == 6 and all(r in environments.checked for r in tool_records)
    assert not [r for r in environments.checked if r.task == "math"]  # the reward checks those
    for records, ids in ((run.train_records, run.train_prompt_ids),
                         (run.heldout_records, run.heldout_prompt_ids)):
        for record, prompt_ids in zip(records, ids):
            system = "[system] Be brief.\n" if record.task == "tool/math" else ""
            assert prompt_ids == tokenizer.encode(f"{system}[user] {record.prompt}\n[assistant]",
                                                  add_special_tokens=False), record.prompt_id
    # Without environments (or a run of single-turn tasks) every prompt is its conversation.
    plain = load_run_prompts(_config(_twelve(tmp_path / "q.jsonl"), checkpoint), tokenizer,
                             registry, _Environments())
    assert plain == load_run_prompts(_config(tmp_path / "q.jsonl", checkpoint), tokenizer,
                                     registry)
    with pytest.raises(ConfigError, match=r"^data.prompts: 1 prompt\(s\) lack their answer$"):
        load_run_prompts(_config(prompts, checkpoint, "environment.max_turns=3"), tokenizer,
                         registry, _Environments("1 prompt(s) lack their answer"))


def test_the_ids_that_close_a_turn_are_every_eos_sglang_stops_on(tmp_path, checkpoint):
    """config.json's eos_token_id and generation_config.json's (an int or a list), as SGLang
    unions them (srt/configs/model_config.py _get_hf_eos_token_id), and the tokenizer's."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    from megatron_rl.run_setup import end_of_turn_ids

    model = shutil.copytree(checkpoint, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.eos_token_id == 2  # "</s>"
    config = LlamaConfig.from_pretrained(model)
    config.eos_token_id = 7
    config.save_pretrained(model)
    assert end_of_turn_ids(tokenizer, model) == (2, 7)
    GenerationConfig(eos_token_id=[7, 150]).save_pretrained(model)
    assert end_of_turn_ids(tokenizer, model) == (2, 7, 150)
