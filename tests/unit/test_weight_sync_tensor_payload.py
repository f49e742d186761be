"""The colocated transport's payload against SGLang 0.5.23's contract for
`/update_weights_from_tensor` (megatron_rl.rollout.sglang_tensors): one serialisation per engine
rank, each read back by SGLang's own deserialiser as that rank reads it; SGLang's CUDA reductions
(device UUIDs) in force while CUDA tensors are serialised and undone afterwards, because SGLang's
reducer breaks the pickling of CPU tensors. CUDA IPC itself needs a GPU: tools/gpu_smoke.py's
colocated sync covers it."""
import pytest
import torch

from megatron_rl.rollout import sglang_tensors
from megatron_rl.rollout.sglang_tensors import serialize_for_ranks, sglang_cuda_reductions

pytestmark = pytest.mark.unit


def _named():
    return [("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).view(3, 4)),
            ("model.norm.weight", torch.tensor([0.5, -2.0], dtype=torch.bfloat16)),
            # FP8-serving generators (issue 40): an fp8 weight, its block and per-tensor scales.
            ("model.layers.0.mlp.down_proj.weight",
             torch.tensor([[1.5, -448.0], [0.0, 2.0**-9]]).to(torch.float8_e4m3fn)),
            ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.tensor([[0.25]])),
            ("model.layers.0.mlp.up_proj.weight_scale", torch.tensor(0.125))]


def _bits(tensor):
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_one_serialisation_per_engine_rank_read_back_by_sglang(monkeypatch, num_ranks):
    from sglang.srt.utils import MultiprocessingSerializer

    calls = []
    serialize = MultiprocessingSerializer.serialize

    def counting(obj, output_str=False):
        calls.append(obj)
        return serialize(obj, output_str=output_str)

    monkeypatch.setattr(MultiprocessingSerializer, "serialize", staticmethod(counting))
    named = _named()
    payloads = serialize_for_ranks(named, num_ranks)
    # Each rank's CUDA IPC references are its own: one serialisation per rank, not one copy.
    assert len(payloads) == len(calls) == num_ranks
    assert all(isinstance(p, str) for p in payloads)  # base64, as JSON carries it
    for rank in range(num_ranks):
        # As TpModelWorker.deserialize_own_rank reads its entry (SGLang's safe unpickler).
        received = MultiprocessingSerializer.deserialize(payloads[rank])
        assert [name for name, _ in received] == [name for name, _ in named]
        for (_, got), (_, sent) in zip(received, named):
            assert got.dtype == sent.dtype and torch.equal(_bits(got), _bits(sent))
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        serialize_for_ranks(named, 0)


def test_sglang_cuda_reductions_apply_only_while_serialising():
    """SGLang's reducer rewrites the device argument of CUDA tensors to the GPU's UUID. It also
    fails on CPU tensors, so the trainer's process gets torch's reducers back afterwards."""
    from multiprocessing.reduction import ForkingPickler

    from sglang.srt.utils import MultiprocessingSerializer, patch_torch
    from torch.multiprocessing import reductions

    cpu_tensor = [("w", torch.ones(3))]
    torch_reducer = ForkingPickler._extra_reducers[torch.Tensor]
    with sglang_cuda_reductions():
        assert ForkingPickler._extra_reducers[torch.Tensor] is patch_torch._reduce_tensor_modified
        assert reductions.rebuild_cuda_tensor is patch_torch._rebuild_cuda_tensor_modified
        with pytest.raises(IndexError):
            MultiprocessingSerializer.serialize(cpu_tensor)
    assert ForkingPickler._extra_reducers[torch.Tensor] is torch_reducer
    assert not hasattr(reductions, "_reduce_tensor_original")
    payload = MultiprocessingSerializer.serialize(cpu_tensor)
    assert torch.equal(MultiprocessingSerializer.deserialize(payload)[0][1], torch.ones(3))


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda=True: which reductions a payload gets is decided by
    its tensors' device, and CPU runs have no CUDA tensor to show it."""

    @property
    def is_cuda(self):
        return True


def test_cuda_tensors_are_serialised_under_sglangs_reductions(monkeypatch):
    entered = []

    def recording():
        import contextlib

        @contextlib.contextmanager
        def scope():
            entered.append(True)
            yield

        return scope()

    monkeypatch.setattr(sglang_tensors, "sglang_cuda_reductions", recording)
    serialize_for_ranks(_named(), 2)
    assert entered == []
    serialize_for_ranks([("w", torch.ones(2).as_subclass(_ClaimsCuda))], 2)
    assert entered == [True]


def test_a_slow_shared_memory_manager_is_asked_again(monkeypatch):
    """torch's shm manager daemon may answer its first client after libshm's timeout on a loaded
    machine (seen in the suite); the payload is serialised again, up to 3 times, and any other
    error is raised at once. The serializer is a stand-in that fails as libshm does."""
    from sglang.srt.utils import MultiprocessingSerializer

    serialize, attempts = MultiprocessingSerializer.serialize, []

    def slow_manager(obj, output_str=False):
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("Shared memory manager connection has timed out")
        return serialize(obj, output_str=output_str)

    monkeypatch.setattr(MultiprocessingSerializer, "serialize", staticmethod(slow_manager))
    (payload,) = serialize_for_ranks(_named(), 1)
    assert len(attempts) == 2
    assert torch.equal(dict(MultiprocessingSerializer.deserialize(payload))[
        "model.embed_tokens.weight"], _named()[0][1])

    def broken(obj, output_str=False):
        raise RuntimeError("something else")

    monkeypatch.setattr(MultiprocessingSerializer, "serialize", staticmethod(broken))
    with pytest.raises(RuntimeError, match="something else"):
        serialize_for_ranks(_named(), 1)
