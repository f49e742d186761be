"""The collective-device rule (megatron_rl/platform/distributed.py): every tensor our code hands
to a torch.distributed collective is created on `collective_device()`, the CUDA device under NCCL.

NCCL refuses CPU tensors ("No backend type associated with device type cpu"), but CPU runs use
gloo, which takes them: the GPU failure cannot happen here. Two checks stand in for it:
- statically, every collective call site in megatron_rl/ and models/ whose tensor is made by a
  torch factory (torch.zeros, torch.tensor, ...) passes device=collective_device() or another
  tensor's .device;
- behaviourally, the functions that reduce tensors they create run with the default device set to
  "meta" (so a tensor made without a device lands off the collective device, as it lands on the
  CPU on a GPU rank) and collectives that, like NCCL's, refuse tensors off the collective device.
"""
import ast
import contextlib
import math
import pathlib
import types

import pytest
import torch
import torch.distributed as dist

import megatron_rl
from megatron_rl.platform import distributed_backend

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(megatron_rl.__file__).resolve().parents[1]  # the code under test
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "gather",
               "scatter", "send", "recv", "isend", "irecv"}
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn"}


def _is_collective(call: ast.Call) -> bool:
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in COLLECTIVES):
        return False
    owner = func.value  # dist.<op> or torch.distributed.<op>
    return (isinstance(owner, ast.Name) and owner.id == "dist") or (
        isinstance(owner, ast.Attribute) and owner.attr == "distributed")


def _is_factory(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch")


def _on_collective_device(factory: ast.Call) -> bool:
    for keyword in factory.keywords:
        if keyword.arg != "device":
            continue
        value = keyword.value
        if isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute)):
            name = value.func.id if isinstance(value.func, ast.Name) else value.func.attr
            return name == "collective_device"
        return isinstance(value, ast.Attribute) and value.attr == "device"  # another tensor's
    return False


def collective_tensor_violations(source: str, filename: str = "<source>") -> tuple[list[str], int]:
    """(violations "file:line: name", number of factory-made collective tensors checked)."""
    violations, checked = set(), set()
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigned: dict[str, list[ast.AST]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, []).append(node.value)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and \
                    isinstance(node.target, ast.Name) and node.value is not None:
                assigned.setdefault(node.target.id, []).append(node.value)
        for call in ast.walk(function):
            if not (isinstance(call, ast.Call) and _is_collective(call)):
                continue
            for arg in call.args:
                name = arg.id if isinstance(arg, ast.Name) else ast.unparse(arg)
                made = assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [arg]
                for value in made:
                    if _is_factory(value):
                        checked.add(value)
                        if not _on_collective_device(value):
                            violations.add(f"{filename}:{value.lineno}: {name}")
    return sorted(violations), len(checked)


def test_the_checker_flags_host_tensors_and_accepts_the_rule():
    bad = ("def f(group):\n    flag = torch.tensor([1])\n    dist.all_reduce(flag)\n"
           "    stats = torch.zeros(3, device=collective_device())\n"
           "    stats += torch.ones(3)\n    torch.distributed.broadcast(stats, src=0)\n")
    assert collective_tensor_violations(bad) == (
        ["<source>:2: flag", "<source>:5: stats"], 3)
    good = ("def f(x):\n    a = torch.zeros(1, device=collective_device())\n"
            "    b = torch.zeros(1, device=x.device)\n    dist.all_reduce(a)\n"
            "    dist.all_reduce(b)\n    dist.all_reduce(x.sum())\n")
    assert collective_tensor_violations(good) == ([], 2)


def test_every_collective_tensor_is_made_on_the_collective_device():
    violations, checked = [], 0
    for path in sorted([*(ROOT / "megatron_rl").rglob("*.py"), *(ROOT / "models").rglob("*.py")]):
        source = path.read_text()
        if not any(f"{name}(" in source for name in COLLECTIVES):
            continue
        found, count = collective_tensor_violations(source, str(path.relative_to(ROOT)))
        violations += found
        checked += count
    assert not violations, (
        "tensors made without device=collective_device() go through a collective (NCCL refuses "
        f"CPU tensors on GPU): {violations}")
    # The step's statistics, routing flips, micro-batch count, gradient check and the weight
    # sync's flags and session broadcast: the scan must keep seeing them.
    assert checked >= 9, checked


def test_collective_device_follows_the_backend(monkeypatch):
    from megatron_rl.platform import collective_device

    assert distributed_backend() == "gloo" and collective_device() == torch.device("cpu")
    # A GPU rank: NCCL, and this rank's CUDA device (torch.cuda.set_device(LOCAL_RANK) at start).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed_backend() == "nccl"
    assert collective_device() == torch.device("cuda", 3)


@contextlib.contextmanager
def host_tensors_off_the_collective_device(monkeypatch):
    """Collectives that refuse tensors off the device the (gloo) group serves, the CPU, as NCCL
    refuses tensors off the GPU, with the default device "meta": a tensor made without a device
    lands off it, as it lands on the CPU on a GPU rank."""
    served = torch.device("cpu")

    def strict(collective):
        def call(tensor, *args, **kwargs):
            if tensor.device != served:
                raise RuntimeError(
                    f"No backend type associated with device type {tensor.device.type}")
            return collective(tensor, *args, **kwargs)
        return call

    for name in ("all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, strict(getattr(dist, name)))
    with torch.device("meta"):
        yield


def test_weight_sync_agreement_flags(megatron_process_group, monkeypatch):
    from megatron_rl.weight_sync.sync import WeightSync

    with host_tensors_off_the_collective_device(monkeypatch):
        assert WeightSync._any(True) is True and WeightSync._any(False) is False
        assert WeightSync._failures(None, None) == ([], False)


def test_gradient_check_agrees_on_non_finite_gradients(megatron_process_group, monkeypatch):
    from megatron_rl.trainer.trainer import RLTrainer

    def trainer_with_grads(*grads):
        buffers = [types.SimpleNamespace(grad_data=grad) for grad in grads]
        return types.SimpleNamespace(model=types.SimpleNamespace(
            buffers=buffers[:1], expert_parallel_buffers=buffers[1:]))

    finite = trainer_with_grads(torch.ones(4), torch.zeros(2))
    overflow = trainer_with_grads(torch.ones(4), torch.tensor([0.0, math.inf]))
    nan = trainer_with_grads(torch.tensor([math.nan, 1.0]))
    with host_tensors_off_the_collective_device(monkeypatch):
        assert RLTrainer._grads_finite(finite) is True
        assert RLTrainer._grads_finite(overflow) is False
        assert RLTrainer._grads_finite(nan) is False


def test_step_statistics_are_reduced_on_the_collective_device(megatron_process_group,
                                                              monkeypatch):
    """run_forward_backward's sums over micro-batches and ranks (stats, largest, routing flips),
    with the schedule's per-micro-batch outputs given: the reduced values are their sums."""
    from megatron.core import pipeline_parallel

    from megatron_rl.trainer import ParallelGroups
    from megatron_rl.trainer.routing_replay import FlipCount
    from megatron_rl.trainer.step import _STATS, _STATS_SIZE, LossSettings, run_forward_backward

    world = dist.group.WORLD
    groups = ParallelGroups(tp=world, pp=world, dp=world, expert_dp=world, world_size=1,
                            tp_rank=0, pp_rank=0, dp_rank=0, tp_size=1, pp_size=1, dp_size=1)
    outputs = [{"stats": torch.arange(_STATS_SIZE, dtype=torch.float64) + k,
                "abs_logp_diff_max": torch.tensor([0.5 * k], dtype=torch.float64)}
               for k in (1, 3)]
    monkeypatch.setattr(pipeline_parallel, "get_forward_backward_func",
                        lambda: lambda **kwargs: outputs)
    replay = types.SimpleNamespace(take_flip_count=lambda: FlipCount(3, 40), clear=lambda: None)
    micro_batch = types.SimpleNamespace(input_ids=torch.zeros(1, 4, dtype=torch.long))
    with host_tensors_off_the_collective_device(monkeypatch):
        result = run_forward_backward(None, [micro_batch], groups, None, LossSettings(),
                                      temperature=1.0, routing_replay=replay,
                                      replay_mode="replay")
    sums = dict(zip(_STATS, (2 * i + 4 for i in range(len(_STATS)))))  # (i + 1) + (i + 3)
    assert (result.loss, result.num_loss_tokens, result.num_tokens) == (
        sums["loss"], sums["num_loss_tokens"], sums["num_tokens"])
    assert (result.ratio_sum, result.entropy_sum) == (sums["ratio"], sums["entropy"])
    assert result.abs_logp_diff_max == 1.5
    assert (result.num_routing_flips, result.num_routing_decisions) == (3, 40)
