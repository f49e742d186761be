"""Trainer configuration without a GPU: precision / Transformer Engine / FP8 recipe selection,
parallel-layout checks, the optimizer defaults and RunConfig -> TrainerSettings."""
import pytest
import torch

from megatron_rl.trainer.model import precision_overrides, rl_overrides
from megatron_rl.trainer.optimizer import OptimizerSettings
from megatron_rl.trainer.parallel import ParallelLayout

pytestmark = pytest.mark.unit


def test_fp8_on_cpu_fails_with_a_clear_message():
    with pytest.raises(RuntimeError, match="FP8 .*needs Transformer Engine.*model.fp8=null"):
        precision_overrides("bf16", fp8_recipe="delayed")
    with pytest.raises(RuntimeError, match="use_transformer_engine=True"):
        precision_overrides("bf16", use_transformer_engine=True)


@pytest.mark.parametrize("recipe, megatron_recipe", [("delayed", "delayed"),
                                                     ("current", "tensorwise")])
def test_fp8_recipe_selection_with_transformer_engine(recipe, megatron_recipe):
    choice = precision_overrides("bf16", fp8_recipe=recipe, transformer_engine_available=True)
    assert choice.use_transformer_engine is True
    assert choice.overrides["fp8"] == "hybrid"
    assert choice.overrides["fp8_recipe"] == megatron_recipe
    assert choice.overrides["bf16"] is True and choice.overrides["params_dtype"] == torch.bfloat16


def test_layer_spec_backend_follows_availability():
    assert precision_overrides("fp32", transformer_engine_available=False) \
        .use_transformer_engine is False
    assert precision_overrides("bf16", transformer_engine_available=True) \
        .use_transformer_engine is True
    assert precision_overrides("bf16", use_transformer_engine=False,
                               transformer_engine_available=True).use_transformer_engine is False
    fp32 = precision_overrides("fp32", transformer_engine_available=False).overrides
    assert fp32 == {"bf16": False, "params_dtype": torch.float32, "pipeline_dtype": torch.float32}
    with pytest.raises(ValueError, match="precision='bf16'"):
        precision_overrides("fp32", fp8_recipe="delayed", transformer_engine_available=True)
    with pytest.raises(ValueError, match="choose one of"):
        precision_overrides("fp16")


def test_rl_overrides_disable_dropout_and_megatron_loss_averaging():
    overrides = rl_overrides(ParallelLayout(pipeline_model_parallel_size=2))
    assert overrides["hidden_dropout"] == 0.0 and overrides["attention_dropout"] == 0.0
    assert overrides["calculate_per_token_loss"] is True
    assert overrides["variable_seq_lengths"] is True
    assert overrides["pipeline_model_parallel_size"] == 2


def test_parallel_layout_checks():
    layout = ParallelLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                            sequence_parallel=True)
    assert layout.data_parallel_size(4) == 1 and layout.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match="EP x ETP x PP = 8"):
        ParallelLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                       expert_model_parallel_size=2).data_parallel_size(4)
    with pytest.raises(ValueError, match="not divisible"):
        ParallelLayout(tensor_model_parallel_size=4).data_parallel_size(6)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelLayout(sequence_parallel=True)
    with pytest.raises(NotImplementedError, match="context_parallel_size"):
        ParallelLayout(context_parallel_size=2)


def test_optimizer_defaults_are_scalerl():
    settings = OptimizerSettings()
    assert (settings.lr, settings.lr_warmup_steps, settings.adam_eps, settings.weight_decay) \
        == (5e-7, 100, 1e-15, 0.01)
    assert settings.lr_schedule == "constant" and settings.clip_grad == 1.0


def test_settings_from_run_config():
    from megatron_rl import config
    from megatron_rl.trainer import TrainerSettings

    run = config.RunConfig()
    settings = TrainerSettings.from_run_config(run)
    assert settings.model_name == run.model.name and settings.model_size == run.model.size
    assert settings.precision == {"bfloat16": "bf16", "float32": "fp32"}[run.model.params_dtype]
    assert settings.loss.kind == run.algorithm.loss
    assert settings.loss.aggregation == run.algorithm.aggregation
    assert settings.optimizer.lr == run.train.lr
    assert settings.optimizer.adam_eps == run.optimizer.adam_eps
    assert settings.micro_batch_max_tokens == run.train.micro_batch_max_tokens
    assert settings.layout.tensor_model_parallel_size \
        == run.parallelism.tensor_model_parallel_size
