"""How a run wires its environments (run_setup.py `_environments`, `_multi_turn`): the
environment section reaches the tool environment, environment.modules register the user's own
with the run's context, and the multi-turn rollout exists only when a prompt's environment is
multi-turn, with each environment's stop texts as token ids of the policy tokenizer and the
model's end-of-sequence ids. The real registries and tokenizer; no server starts (the sandbox and
the math workers start lazily)."""
import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data import PromptRecord
from megatron_rl.data.run_prompts import RunPrompts
from megatron_rl.data.tokenizer import TAG_TOKENS, train_tokenizer

pytestmark = pytest.mark.unit

USER_MODULE = '''
from megatron_rl.environments import Environment

class Counting(Environment):
    stop_texts = ("</tool>",)

    async def start(self, record):
        raise NotImplementedError

CONTEXT = {}

def register_environments(registry, **context):
    CONTEXT.update(context)
    registry.register("count/", Counting())
'''


def _setup(tmp_path, tags, *overrides):
    from transformers import AutoTokenizer, LlamaConfig

    from megatron_rl.rewards import MathVerifier, Sandbox, default_registry
    from megatron_rl.run_setup import RunSetup

    model = tmp_path / "model"
    train_tokenizer(["Call <tool>print(1)</tool> then answer."] * 4, vocab_size=160,
                    added_tokens=(*TAG_TOKENS, *tags)).save_pretrained(model)
    LlamaConfig(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, eos_token_id=2).save_pretrained(model)
    cfg = load_config("examples/configs/tiny_pipeline.yaml",
                      [f"model.hf_checkpoint={model}", "environment.max_turns=3", *overrides])
    run = RunSetup(cfg, backend=object())  # nothing here reaches the cluster
    run.tokenizer = AutoTokenizer.from_pretrained(model)
    sandbox = Sandbox()
    run.registry = default_registry(math_verifier=MathVerifier(), sandbox=sandbox)
    return run, sandbox


def _records(*tasks):
    return [PromptRecord.from_json({"id": f"p{i}", "task": task, "prompt": "1 + 1?",
                                    "answer": "2"}) for i, task in enumerate(tasks)]


def test_user_modules_register_with_the_runs_context(tmp_path, monkeypatch):
    (tmp_path / "b2_user_envs.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    run, sandbox = _setup(tmp_path, ("<tool>", "</tool>"), "environment.modules=[b2_user_envs]",
                          "environment.tool_wall_time_s=2.5")
    environments = run._environments(sandbox)
    import b2_user_envs

    assert type(environments.for_task("count/a")).__name__ == "Counting"
    assert b2_user_envs.CONTEXT == {"sandbox": sandbox, "reward_registry": run.registry,
                                    "tokenizer": run.tokenizer, "cfg": run.cfg}
    tool = environments.for_task("tool/math")
    assert tool.multi_turn and tool.stop_texts == ("</tool>",)
    assert tool.settings.wall_time_s == 2.5
    assert not environments.for_task("math").multi_turn  # the verifier, as before
    run, sandbox = _setup(tmp_path, (), "environment.modules=[b2_no_such_module]")
    with pytest.raises(ConfigError, match=r"^environment.modules: .*b2_no_such_module"):
        run._environments(sandbox)


def test_the_multi_turn_rollout_only_for_multi_turn_prompts(tmp_path):
    run, sandbox = _setup(tmp_path, ("<tool>", "</tool>"), "environment.step_timeout_s=90")
    run.environments = run._environments(sandbox)
    run.data = RunPrompts(train_records=_records("math", "rg/gcd"), heldout_records=_records(
        "math"), train_prompt_ids=[[1], [1]], heldout_prompt_ids=[[1]])
    assert run._multi_turn() is None  # single-turn run: the loop as before environments
    run.data = RunPrompts(train_records=_records("math"), heldout_records=_records("tool/math"),
                          train_prompt_ids=[[1]], heldout_prompt_ids=[[1]])
    multi_turn = run._multi_turn()
    record = run.data.heldout_records[0]
    assert multi_turn.is_multi_turn(record) and not multi_turn.is_multi_turn(
        run.data.train_records[0])
    settings = multi_turn.settings_for(multi_turn.environments(record))
    close_id = run.tokenizer.convert_tokens_to_ids("</tool>")
    assert (settings.max_turns, settings.max_trajectory_tokens) == (3, 3 * (24 + 40))
    assert settings.turn_stop_ids == (close_id,) and settings.end_of_turn_ids == (2,)
    assert settings.step_timeout_s == 90.0


def test_a_stop_text_that_is_not_one_token_stops_the_start(tmp_path):
    run, sandbox = _setup(tmp_path, ())  # "</tool>" is several tokens of this tokenizer
    run.environments = run._environments(sandbox)
    run.data = RunPrompts(train_records=_records("tool/math"), heldout_records=[],
                          train_prompt_ids=[[1]], heldout_prompt_ids=[])
    with pytest.raises(ConfigError, match=r"PythonToolEnvironment stop texts: stop text "
                                           r"'</tool>' is \d+ tokens"):
        run._multi_turn()
