"""Trainer configuration without a GPU: precision / Transformer Engine / FP8 recipe selection,
parallel-layout checks, the optimizer defaults and RunConfig -> TrainerSettings."""
import dataclasses

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


def test_delayed_fp8_scaling_keeps_an_amax_history(monkeypatch):
    """Delayed scaling reaches the TransformerConfig with 1024 steps of amax history, scaled by
    their max (Megatron's default is a history of 1); the other recipes keep Megatron's defaults,
    which they do not read. The config path is the trainer's: precision_overrides -> the family's
    transformer_config."""
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    from megatron.core.transformer import transformer_config as tc

    from models import get_model_family

    # TransformerConfig refuses MoE + FP8 unless TE >= 1.7 is installed; TE cannot be installed
    # on CPU, so let its version query report a TE-bearing machine.
    monkeypatch.setattr(tc, "is_te_min_version", lambda *args, **kwargs: True)
    family = get_model_family("llama4")

    def config(recipe):
        choice = precision_overrides("bf16", fp8_recipe=recipe, transformer_engine_available=True)
        return family.transformer_config("tiny", use_transformer_engine=True, **choice.overrides)

    delayed = config("delayed")
    assert (delayed.fp8, delayed.fp8_recipe) == ("hybrid", "delayed")
    assert (delayed.fp8_amax_history_len, delayed.fp8_amax_compute_algo) == (1024, "max")
    defaults = {f.name: f.default for f in dataclasses.fields(tc.TransformerConfig)}
    assert (defaults["fp8_amax_history_len"], defaults["fp8_amax_compute_algo"]) == (
        1, "most_recent")
    mxfp8 = config("mxfp8")
    assert (mxfp8.fp8, mxfp8.fp8_recipe, mxfp8.fp8_amax_history_len) == ("e4m3", "mxfp8", 1)


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
    # CP builds with Transformer Engine's CP attention (GPU) or the local spec's all-gather path;
    # a communication scheme the backend lacks, or TE without flash and fused attention, is refused.
    from megatron_rl.trainer.model import check_context_parallel

    cp = ParallelLayout(context_parallel_size=2)
    assert cp.megatron_overrides()["context_parallel_size"] == 2
    check_context_parallel(cp, use_transformer_engine=True, cp_comm_type="p2p")
    check_context_parallel(cp, use_transformer_engine=False)
    with pytest.raises(ValueError, match=r"cp_comm_type \['p2p'\] is not supported by the local"):
        check_context_parallel(cp, use_transformer_engine=False, cp_comm_type="p2p")
    with pytest.raises(ValueError, match="NVTE_FLASH_ATTN=0 and NVTE_FUSED_ATTN=0"):
        check_context_parallel(cp, use_transformer_engine=True,
                               environ={"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"})


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


def test_settings_carry_the_sampling_temperature():
    """The head must score logits / T at the generator's sampling temperature: RunConfig's
    rollout.temperature reaches TrainerSettings (the step passes it to the FP32 head)."""
    from megatron_rl import config
    from megatron_rl.trainer import TrainerSettings

    assert TrainerSettings.from_run_config(config.RunConfig()).temperature == 1.0
    run = config.load_config(None, ["rollout.temperature=0.7"])
    assert TrainerSettings.from_run_config(run).temperature == 0.7


def test_settings_carry_fp32_lm_head():
    """model.fp32_lm_head reaches TrainerSettings (the step passes it to the head): true, the
    ScaleRL default, is the FP32 logits GEMM; false the params-dtype GEMM ablation."""
    from megatron_rl import config
    from megatron_rl.trainer import TrainerSettings

    assert TrainerSettings.from_run_config(config.RunConfig()).fp32_lm_head is True
    run = config.load_config(None, ["model.fp32_lm_head=false"])
    assert TrainerSettings.from_run_config(run).fp32_lm_head is False


class _SingleRankGroup:
    """What Megatron's TP region ops ask of a group of one: its size (no process group needed)."""

    def size(self) -> int:
        return 1


@pytest.mark.parametrize("fp32_lm_head", [True, False])
def test_forward_step_passes_fp32_lm_head_to_the_head(fp32_lm_head):
    """_forward_step's head scores BF16 hidden states with the BF16 output weight exactly as
    chunked_logprobs(fp32_head=fp32_lm_head) does: the flag reaches the op."""
    import types

    from megatron_rl.ops import chunked_logprobs
    from megatron_rl.trainer import LossSettings, MicroBatch, ParallelGroups
    from megatron_rl.trainer.step import _forward_step

    gen = torch.Generator().manual_seed(0)
    seq_len, hidden_size, vocab_size = 6, 16, 29
    hidden_states = torch.randn(seq_len, 1, hidden_size, generator=gen).bfloat16()  # [s, b, h]
    weight = torch.randn(vocab_size, hidden_size, generator=gen).bfloat16()  # [V, h]
    targets = torch.randint(0, vocab_size, (1, seq_len), generator=gen)
    loss_mask = torch.tensor([[False, True, True, False, True, True]])
    zeros = torch.zeros(1, seq_len)
    micro_batch = MicroBatch(
        input_ids=targets, position_ids=torch.arange(seq_len)[None], targets=targets,
        loss_mask=loss_mask, old_logprobs=zeros, advantages=zeros,
        sample_index=torch.zeros_like(targets), prompt_index=torch.zeros_like(targets),
        padding_mask=torch.zeros_like(loss_mask))
    group = _SingleRankGroup()
    groups = ParallelGroups(tp=group, pp=group, dp=group, expert_dp=group, world_size=1,
                            tp_rank=0, pp_rank=0, dp_rank=0, tp_size=1, pp_size=1, dp_size=1)

    def model(*_args, output_processor, output_processor_context, **_kwargs):
        return output_processor(
            hidden_states=hidden_states, output_layer=types.SimpleNamespace(
                sequence_parallel=False, weight=weight),
            output_weight=None, context=output_processor_context)

    logp, _ = _forward_step(iter([micro_batch]), model, groups=groups, denominators=None,
                            settings=LossSettings(logprob_chunk_size=3), temperature=0.7,
                            fp32_lm_head=fp32_lm_head)
    hidden = hidden_states.transpose(0, 1)[loss_mask]  # [num_loss_tokens, h]
    expected, entropy = chunked_logprobs(hidden, weight, targets[loss_mask], chunk_size=3,
                                         temperature=0.7, fp32_head=fp32_lm_head)
    other, _ = chunked_logprobs(hidden, weight, targets[loss_mask], chunk_size=3,
                                temperature=0.7, fp32_head=not fp32_lm_head)
    assert torch.equal(logp, expected) and torch.equal(micro_batch.entropy, entropy)
    assert not torch.allclose(logp, other, atol=1e-4, rtol=0)
