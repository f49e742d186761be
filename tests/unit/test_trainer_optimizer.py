"""The CPU speed paths of the trainer's optimizer step against the code they replace: torch's
fused AdamW for megatron-core's torch.optim.AdamW fallback, and the foreach gradient norm and
scale that replace megatron-core's local multi-tensor fallbacks (platform shim 10)."""
import types

import pytest
import torch

from megatron_rl.platform import cpu_compat
from megatron_rl.trainer.optimizer import _use_fused_cpu_adamw

pytestmark = pytest.mark.unit

_SHAPES = [(16, 8), (8,), (3, 5, 2), (1,)]


def _params_and_grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in _SHAPES]
    grads = [[torch.randn(shape, generator=gen) for shape in _SHAPES] for _ in range(4)]
    return params, grads


def _train(optimizer, params, grads):
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    return [param.detach().clone() for param in params]


def test_fused_cpu_adamw_matches_the_single_tensor_loop():
    settings = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-15, weight_decay=0.01)
    params, grads = _params_and_grads()
    reference = _train(torch.optim.AdamW(params, foreach=False, **settings), params, grads)

    params, grads = _params_and_grads()
    inner = torch.optim.AdamW(params, **settings)
    chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=inner)])
    _use_fused_cpu_adamw(chained)
    assert all(group["fused"] for group in inner.param_groups)
    fused = _train(inner, params, grads)
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert inner.state_dict()["param_groups"][0]["fused"] is True  # recorded in checkpoints


def test_fused_cpu_adamw_leaves_other_optimizers_alone():
    param = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([param], lr=0.1)
    _use_fused_cpu_adamw(types.SimpleNamespace(optimizer=sgd))
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]
    _use_fused_cpu_adamw(types.SimpleNamespace(optimizer=None))  # a stub optimizer


def test_foreach_grad_norm_equals_megatrons_local_fallback():
    tensors = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 10 ** i
               for i, shape in enumerate(_SHAPES)]
    # megatron/core/utils.py local_multi_tensor_l2_norm: per-tensor norms read out as floats.
    want = torch.norm(torch.tensor([float(torch.norm(t)) for t in tensors]))
    got, per_tensor = cpu_compat._foreach_l2_norm(2048 * 32, None, [tensors], False)
    assert per_tensor is None and got.shape == (1,) and got.dtype == torch.float32
    assert float(got[0]) == float(want)  # bit for bit
    empty, _ = cpu_compat._foreach_l2_norm(2048 * 32, None, [[]], False)
    assert float(empty[0]) == 0.0


def test_foreach_scale_equals_megatrons_local_fallback():
    tensors = [torch.randn(shape) for shape in _SHAPES]
    want = [t * 0.37 for t in tensors]
    in_place = [t.clone() for t in tensors]
    cpu_compat._foreach_scale(2048 * 32, None, [in_place, in_place], 0.37)
    copied = [torch.empty_like(t) for t in tensors]
    cpu_compat._foreach_scale(2048 * 32, None, [tensors, copied], 0.37)
    for a, b, c in zip(in_place, copied, want):
        assert torch.equal(a, c) and torch.equal(b, c)
