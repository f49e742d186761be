"""GroupedSequentialMLP (the local spec's routed experts, models/grouped_experts.py) against
megatron-core's SequentialMLP, the module it replaces: with the same weights, the same outputs and
the same gradients of the input tokens, the routing probabilities and every expert's fc1/fc2
weight (fp32), for Llama-4's probabilities-on-input top-1 routing and for probabilities applied
after the GLU (Qwen3-MoE), including an expert that receives no token; the same parameter names
and shapes; and what it does not cover falls back to SequentialMLP's own forward."""
import pytest
import torch

pytestmark = pytest.mark.unit

TOLERANCE = 1e-5  # fp32, values O(1)


def _config(**changes):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                  moe_ffn_hidden_size=24, num_moe_experts=4, moe_router_topk=1,
                  gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  bias_activation_fusion=False, moe_router_pre_softmax=True,
                  params_dtype=torch.float32, use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **changes})


def _pair(config):
    """(SequentialMLP, GroupedSequentialMLP) with identical weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from models.grouped_experts import GroupedSequentialMLP

    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    reference = SequentialMLP(config.num_moe_experts, config, submodules, pg_collection=groups)
    grouped = GroupedSequentialMLP(config.num_moe_experts, config, submodules,
                                   pg_collection=groups)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    grouped.load_state_dict(reference.state_dict())
    return reference, grouped


def _run(module, tokens, tokens_per_expert, probs, grad_out):
    tokens = tokens.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    module.zero_grad()
    out, bias = module(tokens, tokens_per_expert, probs)
    assert bias is None
    out.backward(grad_out)
    weights = {name: param.grad.clone() for name, param in module.named_parameters()}
    return out.detach(), tokens.grad, probs.grad, weights


@pytest.mark.parametrize("case", ["probs_on_input_top1", "probs_after_glu", "empty_expert"])
def test_same_output_and_gradients_as_megatrons_sequential_mlp(megatron_process_group, case):
    config = _config(moe_apply_probs_on_input=case == "probs_on_input_top1",
                     moe_router_topk=1 if case == "probs_on_input_top1" else 2)
    reference, grouped = _pair(config)
    assert dict((n, p.shape) for n, p in reference.named_parameters()) == \
        dict((n, p.shape) for n, p in grouped.named_parameters())
    counts = [7, 0, 12, 5] if case == "empty_expert" else [9, 3, 11, 6]
    tokens_per_expert = torch.tensor(counts)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randn(sum(counts), 32, generator=gen)
    probs = torch.rand(sum(counts), generator=gen)
    grad_out = torch.randn(sum(counts), 32, generator=gen)
    expected = _run(reference, tokens, tokens_per_expert, probs, grad_out)
    got = _run(grouped, tokens, tokens_per_expert, probs, grad_out)
    for name, g, e in zip(("output", "token grad", "probs grad"), got[:3], expected[:3]):
        assert g.shape == e.shape, name
        assert (g - e).abs().max() < TOLERANCE, name
    assert got[3].keys() == expected[3].keys()
    for name in expected[3]:
        assert (got[3][name] - expected[3][name]).abs().max() < TOLERANCE, name
    if case == "empty_expert":  # an expert without tokens gets a zero gradient, as in the loop
        assert not got[3]["local_experts.1.linear_fc1.weight"].any()
    # Not vacuous: every other expert's weights received gradient.
    assert got[3]["local_experts.0.linear_fc2.weight"].abs().sum() > 0


def test_falls_back_to_sequential_mlp_where_the_grouped_path_does_not_apply(
        megatron_process_group, monkeypatch):
    from megatron.core.transformer.moe.experts import SequentialMLP

    calls = []
    original = SequentialMLP.forward

    def recording(self, *args):
        calls.append(type(self).__name__)
        return original(self, *args)

    monkeypatch.setattr(SequentialMLP, "forward", recording)
    config = _config(activation_func_clamp_value=7.0)  # a clamp: not covered by the grouped path
    reference, grouped = _pair(config)
    tokens = torch.randn(10, 32)
    counts, probs = torch.tensor([4, 2, 3, 1]), torch.rand(10)
    expected, _ = reference(tokens, counts, probs)
    got, _ = grouped(tokens, counts, probs)
    assert calls == ["SequentialMLP", "GroupedSequentialMLP"]
    assert torch.equal(got, expected)
