"""The run configuration: ScaleRL defaults (literal values from SCALERL.md), YAML + dotted
overrides, errors that name the field, exact save/load round trips, and the generated docs and
default recipe being current."""
import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl import config as config_module
from megatron_rl.config import (
    LOSS_DEFAULTS,
    AlgorithmConfig,
    ConfigError,
    ParallelismConfig,
    RunConfig,
    config_reference_markdown,
    config_to_dict,
    config_to_yaml,
    load_config,
    save_config,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_scalerl_recipe():
    cfg = RunConfig()
    # Section 2: 48 prompts x 16 generations; 2,048 prompt + 12,288 thinking + 2,048 solution.
    assert cfg.rollout.samples_per_prompt == 16
    assert cfg.train.global_batch_size == 768
    assert cfg.prompts_per_step == 48
    assert (cfg.rollout.max_prompt_tokens, cfg.rollout.thinking_budget,
            cfg.rollout.solution_budget) == (2048, 12288, 2048)
    assert cfg.rollout.max_sequence_tokens == 16384
    # Section 3: CISPO with eps_max 5 (the surrogates' clip ranges do not apply to it),
    # prompt-level aggregation.
    assert cfg.algorithm.loss == "cispo"
    assert cfg.algorithm.eps_max == 5.0
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (None, None)
    assert (cfg.algorithm.gspo_eps_low, cfg.algorithm.gspo_eps_high) == (None, None)
    assert cfg.algorithm.aggregation == "prompt"
    # Section 4: batch-level normalisation, zero-variance filtering, NPR at 0.9.
    assert cfg.algorithm.advantage_normalization == "batch"
    assert cfg.algorithm.zero_variance_filter is True
    assert cfg.algorithm.no_positive_resampling is True
    assert cfg.algorithm.npr_threshold == 0.9
    # Section 5: forced interruption in [10k, 12k] with the exact phrase; penalty 14k / 2k (off).
    assert cfg.rollout.forced_interruption is True
    assert (cfg.rollout.thinking_budget_min, cfg.rollout.thinking_budget) == (10240, 12288)
    assert cfg.rollout.interruption_phrase == (
        "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>")
    assert cfg.algorithm.length_penalty is False
    assert cfg.algorithm.length_penalty_max_length == 14336
    assert cfg.algorithm.length_penalty_cache_length == 2048
    # Section 6: FP32 LM head on trainer and generator.
    assert cfg.model.fp32_lm_head is True and cfg.rollout.enable_fp32_lm_head is True
    # Section 7: Pipeline-RL with k = 8.
    assert cfg.rollout.mode == "pipeline" and cfg.rollout.max_off_policyness == 8
    # Section 8 (A.3): AdamW, constant lr 5e-7 after 100 warm-up steps, eps 1e-15, wd 0.01;
    # clipping and temperature unstated -> 1.0.
    assert cfg.optimizer.name == "adamw"
    assert (cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2) == (0.9, 0.999)
    assert cfg.optimizer.adam_eps == 1e-15
    assert cfg.optimizer.weight_decay == 0.01
    assert cfg.train.lr == 5e-7 and cfg.train.lr_warmup_steps == 100
    assert cfg.train.lr_schedule == "constant"
    assert cfg.train.clip_grad == 1.0
    assert cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0
    # Section 1: 1,000 held-out prompts, mean@16 every 100 steps, R0 at step 0, 1.5k GPU-h warm-up.
    assert cfg.eval.num_heldout_prompts == 1000
    assert cfg.eval.samples_per_prompt == 16
    assert cfg.eval.interval_steps == 100
    assert cfg.eval.at_step_zero is True
    assert cfg.eval.warmup_compute_gpu_hours == 1500.0
    # Project defaults (not from the paper).
    assert (cfg.model.name, cfg.model.size, cfg.model.fp8) == ("llama4", "tiny", None)
    assert cfg.model.use_transformer_engine is False
    assert cfg.parallelism.world_size == 1 and cfg.parallelism.data_parallel_size == 1
    assert cfg.parallelism.expert_tensor_parallel_size == 1
    assert cfg.checkpoint.format == "torch_dist"


def test_yaml_then_overrides_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "name: exp1\n"
        "train:\n  lr: 1.0e-6\n  num_steps: 10\n"
        "parallelism:\n  world_size: 8\n  tensor_model_parallel_size: 2\n"
        "  sequence_parallel: true\n  expert_model_parallel_size: 4\n")
    cfg = load_config(path, ["train.lr=5e-7", "model.fp8=null", "algorithm.eps_high=1",
                             "algorithm.loss=grpo", "train.num_steps=20", "train.num_steps=30",
                             "seed=7", "checkpoint.load=/ckpt/run 1"])
    assert cfg.name == "exp1"
    assert cfg.train.lr == 5e-7 and type(cfg.train.lr) is float  # YAML 1.1 would read a string
    assert cfg.model.fp8 is None
    assert cfg.algorithm.eps_high == 1.0 and type(cfg.algorithm.eps_high) is float  # int accepted
    assert cfg.algorithm.loss == "grpo"
    assert cfg.train.num_steps == 30  # later overrides win
    assert cfg.seed == 7
    assert cfg.checkpoint.load == "/ckpt/run 1"
    # untouched values keep the file's or the default's
    assert cfg.parallelism.expert_model_parallel_size == 4
    assert cfg.rollout.samples_per_prompt == 16
    # derived: 8 ranks / TP 2 = DP 4; experts: 8 / EP 4 = 2 replicas
    assert cfg.parallelism.data_parallel_size == 4
    assert cfg.parallelism.expert_data_parallel_size == 2
    # an empty section (every field commented out) is the section's defaults
    path.write_text("train:\neval:\n  interval_steps: 5\n")
    cfg = load_config(path, ["train.lr=1e-6"])
    assert cfg.train == dataclasses.replace(RunConfig().train, lr=1e-6)
    assert cfg.eval.interval_steps == 5
    # no file: defaults plus overrides
    assert load_config(None, ["train.lr=2e-6"]).train.lr == 2e-6
    assert load_config() == RunConfig()


def test_derived_parallel_sizes_and_paths():
    par = ParallelismConfig(world_size=16, tensor_model_parallel_size=2,
                            pipeline_model_parallel_size=2, context_parallel_size=2,
                            sequence_parallel=True, expert_model_parallel_size=4,
                            expert_tensor_parallel_size=2)
    assert par.data_parallel_size == 2          # 16 / (2 * 2 * 2)
    assert par.expert_data_parallel_size == 1   # 16 / (4 * 2 * 2)
    cfg = load_config(None, ["output_dir=/runs/a", "logging.tensorboard_dir=/tb/a"])
    assert cfg.checkpoint_dir == "/runs/a/checkpoints"
    assert cfg.tensorboard_dir == "/tb/a"
    # a multi-turn trajectory's budget: max_turns x (12288 + 2048) unless set
    assert cfg.max_trajectory_tokens == 8 * 14336
    assert load_config(None, ["environment.max_turns=3"]).max_trajectory_tokens == 3 * 14336
    assert load_config(None, ["environment.max_trajectory_tokens=20000"]) \
        .max_trajectory_tokens == 20000


@pytest.mark.parametrize("overrides, expected", [
    # unknown names, top and nested level, with the closest valid name suggested
    (["modle.name=llama4"], ["modle", "did you mean 'model'", "parallelism, rollout"]),
    (["algorithm.eps_mx=4"], ["algorithm.eps_mx", "did you mean 'algorithm.eps_max'", "eps_low"]),
    (["train.lr.peak=1"], ["train.lr is a field, not a section"]),
    (["model=llama4"], ["model is a section"]),
    (["train.lr"], ["expected FIELD=VALUE"]),
    # wrong types
    (["train.lr=fast"], ["train.lr", "expected a number", "str 'fast'"]),
    (["train.num_steps=true"], ["train.num_steps", "expected an integer", "bool True"]),
    (["train.num_steps=1.5"], ["train.num_steps", "expected an integer", "float 1.5"]),
    (["name=123"], ["name: expected a string", "quote it"]),
    (["rollout.mem_fraction_static='0.8'"], ["rollout.mem_fraction_static",
                                             "a number or null", "unquoted"]),
    # bad enum values, with the allowed ones
    (["algorithm.loss=cipso"], ["algorithm.loss", "'cispo', 'dapo', 'grpo', 'gspo'",
                                "did you mean 'cispo'"]),
    (["algorithm.aggregation=batch"], ["algorithm.aggregation", "'prompt', 'sample', 'token'"]),
    (["model.fp8=e4m3"], ["model.fp8", "'delayed', 'current', 'mxfp8' or null"]),
    (["rollout.attention_backend=torch_natve"], ["rollout.attention_backend",
                                                 "did you mean 'torch_native'"]),
    # out-of-range and inconsistent values
    (["algorithm.eps_max=0"], ["algorithm.eps_max", "must be > 0.0", "got 0.0"]),
    (["algorithm.eps_max=-5"], ["algorithm.eps_max", "must be > 0.0"]),
    (["rollout.top_p=1.5"], ["rollout.top_p", "must be <= 1.0"]),
    (["train.lr=.inf"], ["train.lr", "finite"]),
    (["parallelism.world_size=3", "parallelism.tensor_model_parallel_size=2",
      "parallelism.sequence_parallel=true"], ["parallelism.world_size", "= 2 must divide",
                                              "(3)"]),
    (["parallelism.world_size=4", "parallelism.pipeline_model_parallel_size=2",
      "parallelism.expert_model_parallel_size=4"], ["parallelism.expert_model_parallel_size",
                                                    "= 8 must divide world_size (4)"]),
    (["parallelism.world_size=2", "parallelism.tensor_model_parallel_size=2"],
     ["parallelism.sequence_parallel", "MoE", "sequence_parallel=true"]),
    (["parallelism.sequence_parallel=true"], ["parallelism.sequence_parallel",
                                              "tensor_model_parallel_size > 1"]),
    (["model.name=llama", "parallelism.world_size=2", "parallelism.expert_model_parallel_size=2"],
     ["parallelism.expert_model_parallel_size", "dense model 'llama'", "set it to 1"]),
    (["train.global_batch_size=770"], ["train.global_batch_size", "rollout.samples_per_prompt (16)",
                                       "use 768 or 784"]),
    (["train.micro_batch_max_tokens=4096"], ["train.micro_batch_max_tokens", "16384"]),
    (["model.fp8=delayed"], ["model.fp8", "model.use_transformer_engine=true"]),
    (["rollout.thinking_budget_min=13000"], ["rollout.thinking_budget_min",
                                             "rollout.thinking_budget (12288)"]),
    (["rollout.tp_size=4", "rollout.ep_size=3"], ["rollout.ep_size", "rollout.tp_size (4)"]),
    (["algorithm.length_penalty_cache_length=20000"], ["algorithm.length_penalty_cache_length"]),
    (["rollout.mode=ppo_off_policy", "rollout.max_off_policyness=0"],
     ["rollout.max_off_policyness"]),
    (["model.name=gpt5"], ["model.name", "llama, llama4, qwen3_moe"]),
    (["model.size=huge"], ["model.size", "'huge'", "tiny"]),
    # environments and multi-turn trajectories
    (["environment.modules=my_envs"], ["environment.modules", "expected a list, each a string"]),
    (["environment.modules=[3]"], ["environment.modules[0]", "expected a string"]),
    (["environment.modules=[envs/mine.py]"], ["environment.modules", "'envs/mine.py'",
                                               "not a file path"]),
    (["environment.max_turns=0"], ["environment.max_turns", "must be >= 1"]),
    (["environment.max_trajectory_tokens=1000"], ["environment.max_trajectory_tokens",
                                                  "one turn's budget", ">= 14336"]),
    (["environment.tool_call_close=<tool>"], ["environment.tool_call_close",
                                              "distinct open and close"]),
    (["environment.tool_call_open=' '"], ["environment.tool_call_open", "empty"]),
    (["environment.tool_wall_time_s=0"], ["environment.tool_wall_time_s", "must be > 0.0"]),
    (["environment.step_timeout_s=5"], ["environment.step_timeout_s (5) must exceed "
                                        "environment.tool_wall_time_s (5)", "raise"]),
    (["environment.observation_template='<out>{text}</out>'"],
     ["environment.observation_template", "{content}", "['text']"]),
    (["environment.observation_template='<out>{content'"],
     ["environment.observation_template", "not a format string"]),
])
def test_errors_name_the_field_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for text in expected:
        assert text in str(info.value), (text, str(info.value))


def test_yaml_file_errors(tmp_path):
    def error_of(text: str) -> str:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        return str(info.value)

    assert "unknown field; did you mean 'algorithm'" in error_of("algorithms:\n  loss: cispo\n")
    message = error_of("rollout:\n  temprature: 0.7\n")
    assert "rollout.temprature" in message and "did you mean 'rollout.temperature'" in message
    assert "train: expected a mapping" in error_of("train: 5\n")
    assert "not valid YAML" in error_of("train: [\n")
    assert "expected a mapping of sections" in error_of("- a\n- b\n")
    assert "algorithm.eps_max: must be > 0.0" in error_of("algorithm:\n  eps_max: 0\n")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="list of 'section.field=value' strings"):
        load_config(None, "train.lr=1e-6")


def test_python_construction_is_validated_and_frozen():
    with pytest.raises(ConfigError, match=r"^algorithm\.eps_max: must be > 0\.0"):
        AlgorithmConfig(eps_max=0.0)
    with pytest.raises(ConfigError, match=r"^algorithm\.eps_low: expected a number"):
        AlgorithmConfig(eps_low="0.2")
    with pytest.raises(ConfigError, match=r"^parallelism\.world_size"):
        RunConfig(parallelism=ParallelismConfig(world_size=6, pipeline_model_parallel_size=4))
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0
    # derive, never mutate: replace() re-validates
    changed = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, eps_max=8))
    assert changed.algorithm.eps_max == 8.0 and cfg.algorithm.eps_max == 5.0
    with pytest.raises(ConfigError, match="algorithm.eps_max"):
        dataclasses.replace(cfg.algorithm, eps_max=-1.0)


def test_model_name_falls_back_to_the_fixed_list_without_the_registry(monkeypatch):
    monkeypatch.setattr(config_module, "_model_registry", lambda: None)
    with pytest.raises(ConfigError,
                       match=r"model\.name: .*llama, llama4, qwen3_moe; did you mean 'llama4'"):
        load_config(None, ["model.name=llama-4"])
    assert load_config(None, ["model.name=qwen3_moe"]).model.name == "qwen3_moe"
    assert load_config(None, ["model.name=llama"]).model.name == "llama"


def test_save_load_round_trip(tmp_path):
    cfg = load_config(None, [
        "name='1e5'",            # a string that YAML 1.2 would read as a float: must stay a string
        "output_dir='/tmp/run: 1'", "seed=0", "model.name=qwen3_moe", "model.size=30b_a3b",
        "model.hf_checkpoint=/ckpts/Qwen3-30B-A3B", "model.use_transformer_engine=true",
        "model.fp8=current", "parallelism.world_size=16",
        "parallelism.tensor_model_parallel_size=2",
        "parallelism.sequence_parallel=true", "parallelism.expert_model_parallel_size=8",
        "rollout.temperature=0.7", "rollout.mem_fraction_static=0.85", "rollout.tp_size=8",
        "rollout.ep_size=8", "rollout.interruption_phrase='Time: up! \"now\" </think>'",
        "algorithm.loss=dapo", "algorithm.eps_high=0.26", "train.lr=3e-7", "train.clip_grad=0",
        "optimizer.adam_eps=1e-8", "eval.warmup_compute_gpu_hours=1234.5",
        "checkpoint.load=null", "logging.log_interval=10",
        "environment.modules=[my_envs, pkg.more_envs]", "environment.max_trajectory_tokens=40000",
        "environment.observation_template='<output>{content}</output>'",
    ])
    path = tmp_path / "sub" / "config.yaml"
    save_config(cfg, path)
    loaded = load_config(path)
    assert loaded == cfg
    assert config_to_dict(loaded) == config_to_dict(cfg)
    assert loaded.name == "1e5" and loaded.train.clip_grad == 0.0
    assert loaded.environment.modules == ("my_envs", "pkg.more_envs")
    assert load_config(None, []) != cfg
    # without comments too, and across processes (pickle: Ray / multiprocessing)
    path.write_text(config_to_yaml(cfg, comments=False))
    assert load_config(path) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


@pytest.mark.parametrize("loss, expected", [
    # SCALERL.md section 3: GRPO symmetric 0.2; DAPO clip-higher 0.2 / 0.28; GSPO 3e-4 / 4e-4.
    ("grpo", {"eps_low": 0.2, "eps_high": 0.2}),
    ("dapo", {"eps_low": 0.2, "eps_high": 0.28}),
    ("gspo", {"gspo_eps_low": 3e-4, "gspo_eps_high": 4e-4}),
    ("cispo", {"eps_max": 5.0}),
])
def test_each_loss_gets_its_own_defaults(loss, expected):
    algorithm = load_config(None, [f"algorithm.loss={loss}"]).algorithm
    for name in ("eps_max", "eps_low", "eps_high", "gspo_eps_low", "gspo_eps_high"):
        assert getattr(algorithm, name) == expected.get(name), name
    # The resolved values are what `python -m megatron_rl.config` prints.
    out = subprocess.run([sys.executable, "-m", "megatron_rl.config", f"algorithm.loss={loss}"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    section = yaml.safe_load(out)["algorithm"]
    for name, value in expected.items():
        assert section[name] == value, (name, section[name])
    # A user's value wins; a parameter the loss does not use is an error, not silently ignored.
    assert load_config(None, ["algorithm.loss=grpo", "algorithm.eps_high=0.3"]
                       ).algorithm.eps_high == 0.3
    with pytest.raises(ConfigError, match=r"algorithm\.eps_high: set to 0\.3, but loss 'cispo' "
                                          r"does not use it .*algorithm\.eps_high=null"):
        load_config(None, ["algorithm.eps_high=0.3"])


def test_loss_defaults_agree_with_the_loss_functions():
    from megatron_rl.algorithms.losses import DEFAULT_CLIP_RANGE

    for loss, (low, high) in DEFAULT_CLIP_RANGE.items():
        names = ("gspo_eps_low", "gspo_eps_high") if loss == "gspo" else ("eps_low", "eps_high")
        assert LOSS_DEFAULTS[loss] == dict(zip(names, (low, high)))


def test_grpo_trainer_gets_symmetric_clipping():
    """The settings the trainer is built from: GRPO was silently DAPO's 0.2 / 0.28."""
    from megatron_rl.trainer import TrainerSettings

    loss = TrainerSettings.from_run_config(load_config(None, ["algorithm.loss=grpo"])).loss
    assert (loss.kind, loss.eps_low, loss.eps_high) == ("grpo", 0.2, 0.2)
    loss = TrainerSettings.from_run_config(load_config(None, ["algorithm.loss=dapo"])).loss
    assert (loss.kind, loss.eps_low, loss.eps_high) == ("dapo", 0.2, 0.28)


@pytest.mark.parametrize("overrides, match", [
    (["algorithm.tis_cap=2"], r"algorithm\.tis_cap: set to 2\.0, but CISPO already weighs .* "
                              r"count the mismatch twice"),
    (["algorithm.loss=dapo", "algorithm.tis_cap=0"], r"algorithm\.tis_cap: must be > 0"),
    (["algorithm.loss=dapo", "algorithm.tis_cap=.inf"], r"algorithm\.tis_cap: expected a number"),
    (["algorithm.mismatch_sequence_low=0.5"], r"mismatch_sequence_low / _high: set both"),
    (["algorithm.mismatch_token_high=2"], r"mismatch_token_low / _high: set both"),
    (["algorithm.mismatch_token_low=1.2", "algorithm.mismatch_token_high=2"],
     r"algorithm\.mismatch_token_low: must be < 1\.0"),
    (["algorithm.mismatch_sequence_low=0.5", "algorithm.mismatch_sequence_high=1"],
     r"algorithm\.mismatch_sequence_high: must be > 1\.0"),
])
def test_mismatch_corrections_refused_where_they_cannot_work(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_mismatch_corrections_reach_the_trainer():
    """Off by default (ScaleRL); each field lands in the trainer's loss settings."""
    from megatron_rl.trainer import TrainerSettings

    assert not TrainerSettings.from_run_config(load_config(None, [])).loss.mismatch.enabled
    run = load_config(None, ["algorithm.loss=gspo", "algorithm.tis_cap=2",
                             "algorithm.mismatch_sequence_low=0.5",
                             "algorithm.mismatch_sequence_high=2",
                             "algorithm.mismatch_token_low=0.2",
                             "algorithm.mismatch_token_high=5"])
    mismatch = TrainerSettings.from_run_config(run).loss.mismatch
    assert (mismatch.tis_cap, mismatch.sequence_window, mismatch.token_window) == (
        2.0, (0.5, 2.0), (0.2, 5.0))


def test_training_rollouts_refuse_top_p():
    with pytest.raises(ConfigError, match=r"rollout\.top_p: 0\.9 truncates .*log-probs of the "
                                          r"untruncated"):
        load_config(None, ["rollout.top_p=0.9"])


def test_config_to_dict_is_plain_nested():
    data = config_to_dict(RunConfig())
    assert data["algorithm"]["eps_max"] == 5.0
    assert data["rollout"]["samples_per_prompt"] == 16
    assert set(data) == {"name", "output_dir", "seed", "model", "parallelism", "rollout",
                         "weight_sync", "algorithm", "train", "optimizer", "eval", "checkpoint",
                         "data", "cluster", "logging", "environment"}


def test_docs_and_default_recipe_are_generated_from_the_code():
    docs = (ROOT / "docs/config.md").read_text()
    assert docs == config_reference_markdown(), (
        "docs/config.md is stale: run `.venv/bin/python -m megatron_rl.config --markdown > "
        "docs/config.md`")
    recipe = ROOT / "examples/configs/scalerl_default.yaml"
    assert recipe.read_text() == config_to_yaml(RunConfig()), (
        "examples/configs/scalerl_default.yaml is stale: run `.venv/bin/python -m "
        "megatron_rl.config > examples/configs/scalerl_default.yaml`")
    # independently of the generators: the recipe loads to the defaults, every field has a
    # commented line, and the docs mention every field of every section with its default
    assert load_config(recipe) == RunConfig()
    lines = recipe.read_text().splitlines()
    for section, values in config_to_dict(RunConfig()).items():
        if not isinstance(values, dict):
            continue
        assert f"## `{section}`" in docs
        for name in values:
            assert f"| `{name}` |" in docs, (section, name)
            index = lines.index(next(l for l in lines if l.strip().startswith(f"{name}:")))
            assert lines[index - 1].strip().startswith("#"), name
    assert "| `eps_max` | `null` |" in docs and "| `adam_eps` | `1.0e-15` |" in docs


def test_demo_recipe():
    cfg = load_config(ROOT / "examples/configs/demo.yaml")
    assert (cfg.model.name, cfg.model.size) == ("llama4", "demo")
    assert cfg.parallelism.world_size == 1 and cfg.rollout.num_generators == 1
    assert cfg.rollout.max_off_policyness >= 1  # the asynchronous schedule, not a synchronous one
    assert cfg.rollout.forced_interruption
    assert cfg.rollout.max_sequence_tokens <= 512  # the demo model's positions
    assert cfg.rollout.attention_backend == "torch_native"
    # the ScaleRL recipe itself: what the demo does not set stays the default
    assert cfg.algorithm == RunConfig().algorithm
    assert cfg.optimizer == RunConfig().optimizer


def test_command_line_prints_the_resolved_config(capsys, tmp_path):
    recipe = str(ROOT / "examples/configs/demo.yaml")
    assert config_module.main([recipe, "train.lr=2e-5"]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "printed.yaml"
    path.write_text(out)
    assert load_config(path).train.lr == 2e-5
    assert config_module.main(["--markdown"]) == 0
    assert capsys.readouterr().out == config_reference_markdown()
    assert config_module.main([recipe, "train.lr=x"]) == 2
    assert "train.lr" in capsys.readouterr().err
