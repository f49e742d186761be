"""CPU shim 11 (megatron_rl/platform/cpu_compat.py): megatron's parameter all-gather over a
one-rank group is a copy (none when the shard is the output's own memory), with the result
torch.distributed.all_gather_into_tensor gives; asynchronous calls still go to torch.distributed."""
import pytest
import torch

pytestmark = pytest.mark.unit


def test_one_rank_param_all_gather_is_a_copy(megatron_process_group):
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer

    gather = param_and_grad_buffer.dist_all_gather_func
    assert gather is not dist.all_gather_into_tensor  # the shim is installed
    bucket = torch.arange(12, dtype=torch.float32)
    assert gather(bucket, bucket[:], group=None, async_op=False) is None  # same memory
    assert torch.equal(bucket, torch.arange(12, dtype=torch.float32))
    output = torch.zeros(12)
    gather(output, bucket, group=None, async_op=False)
    expected = torch.zeros(12)
    dist.all_gather_into_tensor(expected, bucket)  # torch's own, over the same 1-rank group
    assert torch.equal(output, expected)


def test_asynchronous_gather_goes_to_torch_distributed(megatron_process_group):
    from megatron.core.distributed import param_and_grad_buffer

    output, shard = torch.zeros(6), torch.arange(6, dtype=torch.float32)
    work = param_and_grad_buffer.dist_all_gather_func(output, shard, group=None, async_op=True)
    work.wait()
    assert torch.equal(output, shard)
