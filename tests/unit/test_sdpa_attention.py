"""SDPACoreAttention (the local spec's core attention) against megatron-core's own
DotProductAttention, the reference it replaces: the same outputs and the same gradients of query,
key and value (fp32), with grouped-query attention, the causal mask, an explicit boolean mask,
a given softmax scale and query-key layer scaling; what it does not implement raises."""
import pytest
import torch

pytestmark = pytest.mark.unit

TOLERANCE = 1e-5  # fp32, values O(1)


def _config(**changes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                  kv_channels=16, attention_dropout=0.0, params_dtype=torch.float32,
                  use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **changes})


def _both(config, **kwargs):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from models.sdpa_attention import SDPACoreAttention

    args = dict(config=config, layer_number=2, attn_mask_type=AttnMaskType.causal,
                attention_type="self", **kwargs)
    return DotProductAttention(**args), SDPACoreAttention(**args)


def _inputs(seq=24, batch=3, heads=8, groups=2, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(seq, batch, n, dim, generator=gen, requires_grad=True)
            for n in (heads, groups, groups)]


def _run(module, inputs, mask, grad_out):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = module(*leaves, mask)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("case", ["causal", "explicit_mask", "softmax_scale", "layer_scaling"])
def test_same_output_and_gradients_as_megatrons_dot_product_attention(megatron_process_group,
                                                                        case):
    config = _config(apply_query_key_layer_scaling=case == "layer_scaling")
    reference, sdpa = _both(config, **({"softmax_scale": 0.3} if case == "softmax_scale" else {}))
    inputs = _inputs()
    mask = None
    if case == "explicit_mask":  # True = masked: causal, and row 1 cannot see its first 5 keys
        mask = torch.ones(24, 24, dtype=torch.bool).triu(1).expand(3, 1, 24, 24).clone()
        mask[1, :, 6:, :5] = True
    grad_out = torch.randn(24, 3, 8 * 16, generator=torch.Generator().manual_seed(1))
    expected, expected_grads = _run(reference, inputs, mask, grad_out)
    got, grads = _run(sdpa, inputs, mask, grad_out)
    assert got.shape == expected.shape == (24, 3, 128)
    assert (got - expected).abs().max() < TOLERANCE
    for g, e in zip(grads, expected_grads):
        assert (g - e).abs().max() < TOLERANCE
    # Not vacuous: the mask changes the answer.
    if case == "explicit_mask":
        causal_only, _ = _run(sdpa, inputs, None, grad_out)
        assert (causal_only[6:, 1] - got[6:, 1]).abs().max() > 1e-3


def test_what_it_does_not_implement_raises(megatron_process_group):
    from megatron.core.transformer.enums import AttnMaskType

    from models.sdpa_attention import SDPACoreAttention

    with pytest.raises(NotImplementedError, match="sliding-window"):
        SDPACoreAttention(_config(window_size=(8, 0)), 1, AttnMaskType.causal, "self")
    module = SDPACoreAttention(_config(), 1, AttnMaskType.causal, "self")
    with pytest.raises(NotImplementedError, match="packed"):
        module(*_inputs(), None, packed_seq_params=object())
