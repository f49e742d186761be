"""What the local (CPU) spec changes in megatron's defaults for speed (docs/trainer_speed.md,
third pass), and where it does not: routed experts are GroupedSequentialMLP on the local spec
only; the allgather dispatcher replaces the family's alltoall only without tensor or expert
parallelism and without variable sequence lengths (pipeline parallelism), never over an explicit
override and never with Transformer Engine."""
import pytest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def models_pkg():
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    import models

    return models


@pytest.mark.parametrize("family_name", ["llama4", "qwen3_moe"])
def test_dispatcher_choice(models_pkg, family_name):
    family = models_pkg.get_model_family(family_name)
    assert family.transformer_config("tiny").moe_token_dispatcher_type == "allgather"
    parallel = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    assert family.transformer_config("tiny", **parallel).moe_token_dispatcher_type == "alltoall"
    assert family.transformer_config(
        "tiny", expert_model_parallel_size=2).moe_token_dispatcher_type == "alltoall"
    # Pipeline parallelism sends variable sequence lengths, which allgather refuses.
    assert family.transformer_config(
        "tiny", pipeline_model_parallel_size=2,
        variable_seq_lengths=True).moe_token_dispatcher_type == "alltoall"
    assert family.transformer_config(
        "tiny", moe_token_dispatcher_type="alltoall").moe_token_dispatcher_type == "alltoall"
    assert family.transformer_config(
        "tiny", use_transformer_engine=True).moe_token_dispatcher_type == "alltoall"


def test_grouped_experts_on_the_local_spec_only(models_pkg):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from models.grouped_experts import GroupedSequentialMLP

    family = models_pkg.get_model_family("llama4")
    for use_te in (False, True):
        config = family.transformer_config("tiny", use_transformer_engine=use_te)
        block = family.layer_spec(config, use_transformer_engine=use_te, pp_rank=0)
        experts = block.submodules.layer_specs[0].submodules.mlp.keywords["submodules"].experts
        if use_te:
            assert experts.func is not GroupedSequentialMLP
        else:
            assert experts.func is GroupedSequentialMLP
            assert issubclass(GroupedSequentialMLP, SequentialMLP)
