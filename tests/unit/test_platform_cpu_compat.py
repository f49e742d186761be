"""The platform layer's fast checks, in the pytest process: capability queries and the guarantee
that the CPU shims leave a CUDA machine untouched (the shims themselves run in
tests/dist/test_platform_smoke.py, in a fresh process)."""
import pytest
import torch

from megatron_rl import platform
from megatron_rl.platform import cpu_compat

pytestmark = pytest.mark.unit


def test_capabilities_on_this_machine():
    assert platform.has_cuda() is torch.cuda.is_available()
    # Transformer Engine needs CUDA: never reported without it.
    if not torch.cuda.is_available():
        assert platform.has_transformer_engine() is False
        assert platform.device() == torch.device("cpu")
        assert platform.distributed_backend() == "gloo"


def test_activation_is_a_no_op_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # (Another test in this process may already have activated the shims on this CPU machine.)
    was_active = cpu_compat.is_cpu_compat_active()
    before = (torch.Tensor.type, torch.cuda.synchronize, torch.Tensor.cuda, torch.cuda.Stream)
    assert cpu_compat.activate_cpu_compat() is False
    assert (torch.Tensor.type, torch.cuda.synchronize, torch.Tensor.cuda,
            torch.cuda.Stream) == before
    assert cpu_compat.is_cpu_compat_active() is was_active
