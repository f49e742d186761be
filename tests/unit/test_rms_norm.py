"""The CPU trainer's RMS norm (megatron_rl/ops/rms_norm.py, built by the CPU shim for megatron's
WrappedTorchNorm) against the module it replaces, torch.nn.RMSNorm: forward bit-identical,
gradients of the input and the weight equal to fp32 rounding; without a weight the same as
megatron's L2Norm (x / rms(x)); the shim's module is a torch.nn.RMSNorm with the same state dict,
carries the sequence-parallel flag, and still rejects what WrappedTorchNorm rejects."""
import pytest
import torch

pytestmark = pytest.mark.unit

TOLERANCE = 1e-5  # fp32, values O(1)


@pytest.fixture(autouse=True, scope="module")
def cpu_shims():
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()  # before the first import of megatron.core


def _config(**changes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                  params_dtype=torch.float32, use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **changes})


def _grads(module, x, grad_out):
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    out = module(x)
    out.backward(grad_out)
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("shape", [(37, 64), (5, 3, 64)])
def test_shim_norm_matches_torch_rmsnorm(shape):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    gen = torch.Generator().manual_seed(0)
    reference = torch.nn.RMSNorm(64, eps=1e-5)
    local = WrappedTorchNorm(config=_config(), hidden_size=64, eps=1e-5)
    assert isinstance(local, torch.nn.RMSNorm) and type(local) is not torch.nn.RMSNorm
    with torch.no_grad():
        reference.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
    local.load_state_dict(reference.state_dict())
    assert local.state_dict().keys() == {"weight"}
    x = torch.randn(*shape, generator=gen) * 3
    grad_out = torch.randn(*shape, generator=gen)
    expected, expected_dx, (expected_dw,) = _grads(reference, x, grad_out)
    got, dx, (dw,) = _grads(local, x, grad_out)
    assert torch.equal(got, expected)  # the same ops as torch's composite forward
    assert (dx - expected_dx).abs().max() < TOLERANCE
    assert (dw - expected_dw).abs().max() < TOLERANCE * 10  # a sum over up to 37 tokens
    assert dw.abs().max() > 1e-2 and dx.abs().max() > 1e-2  # not vacuous


def test_without_weight_it_is_megatrons_l2_norm():
    from megatron.core.transformer.torch_norm import L2Norm

    from megatron_rl.ops.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 2, 4, 16, generator=gen)
    grad_out = torch.randn(40, 2, 4, 16, generator=gen)
    expected, expected_dx, _ = _grads(L2Norm(16, eps=1e-6), x, grad_out)
    leaf = x.clone().requires_grad_()
    got = rms_norm(leaf, None, 1e-6)
    got.backward(grad_out)
    assert (got.detach() - expected).abs().max() < TOLERANCE  # megatron's is torch.compile'd
    assert (leaf.grad - expected_dx).abs().max() < TOLERANCE


def test_sequence_parallel_flag_and_wrapped_torch_norm_checks():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = WrappedTorchNorm(config=_config(), hidden_size=64)
    assert norm.weight.sequence_parallel is False
    parallel = WrappedTorchNorm(config=_config(tensor_model_parallel_size=2,
                                               sequence_parallel=True), hidden_size=64)
    assert parallel.weight.sequence_parallel is True
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        WrappedTorchNorm(config=_config(layernorm_zero_centered_gamma=True), hidden_size=64)
    assert type(WrappedTorchNorm(config=_config(normalization="LayerNorm"), hidden_size=64)) \
        is torch.nn.LayerNorm  # LayerNorm outside SP: torch's own, unchanged


def test_non_fp32_input_uses_torchs_rms_norm():
    from megatron_rl.ops.rms_norm import rms_norm

    x = torch.randn(8, 64).bfloat16()
    weight = torch.rand(64).bfloat16()
    expected = torch.nn.functional.rms_norm(x, (64,), weight, 1e-5)
    assert torch.equal(rms_norm(x, weight, 1e-5), expected)
