"""The trainer's GPU rules, checked on CPU: micro-batches reach the model on the platform's device
(moved in one place, trainer/step.py's forward step), and with FP8 every rank's slice of a padded
sequence suits Transformer Engine's FP8 GEMMs, the padding counting in no statistic.

A "meta" device stands in for the GPU: tensors moved there keep shape and dtype but no data, so a
test sees exactly which tensors the step moved."""
import dataclasses
import pathlib
import types

import pytest
import torch

from megatron_rl.trainer.batch import (MicroBatch, TrainBatch, pack_micro_batches,
                                       padding_micro_batch, split_for_context_parallel)

pytestmark = pytest.mark.unit


def _batch(lengths, *, routed_width=None):
    ids = [torch.arange(100, 100 + n) for n in lengths]
    masks = [torch.tensor([0, 0] + [1] * (n - 2)) for n in lengths]
    old = [-0.01 * torch.arange(n, dtype=torch.float32) - i for i, n in enumerate(lengths)]
    routed = None if routed_width is None else [
        torch.arange((n - 1) * routed_width, dtype=torch.uint8).reshape(n - 1, routed_width) % 4
        for n in lengths]
    num = len(lengths)
    return TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old,
                      advantages=torch.linspace(-1, 1, num), prompt_ids=torch.arange(num) // 2,
                      sample_ids=torch.arange(num), routed_experts=routed)


def _tensor_fields(micro_batch):
    return {f.name: getattr(micro_batch, f.name) for f in dataclasses.fields(micro_batch)
            if isinstance(getattr(micro_batch, f.name), torch.Tensor)}


def test_micro_batch_to_moves_every_tensor_field():
    (mb,) = pack_micro_batches(_batch([7, 4], routed_width=2), [0, 1], max_tokens=100)
    mb.entropy = torch.zeros(int(mb.loss_mask.sum()))
    fields = _tensor_fields(mb)
    assert set(fields) == {f.name for f in dataclasses.fields(MicroBatch)} - {"is_padding"}
    moved = mb.to(torch.device("meta"))
    for name, tensor in _tensor_fields(moved).items():
        assert tensor.device.type == "meta", name
        assert (tensor.shape, tensor.dtype) == (fields[name].shape, fields[name].dtype), name
    assert mb.input_ids.device.type == "cpu"  # the host copy is left as it was
    assert mb.to("cpu") is mb  # already there: no copy, the same object
    pad = padding_micro_batch(4).to("meta")
    assert pad.is_padding and pad.routed_experts is None and pad.input_ids.device.type == "meta"


def _single_rank_groups():
    from megatron_rl.trainer import ParallelGroups

    group = types.SimpleNamespace(size=lambda: 1)
    return ParallelGroups(tp=group, pp=group, dp=group, expert_dp=group, world_size=1,
                          tp_rank=0, pp_rank=0, dp_rank=0, tp_size=1, pp_size=1, dp_size=1)


def test_forward_step_feeds_the_model_on_the_platform_device(monkeypatch):
    """The model, the routing replay and the loss all get the micro-batch on the platform's
    device (meta standing in for the GPU), every tensor field moved."""
    import megatron_rl.platform
    from megatron_rl.trainer import LossSettings
    from megatron_rl.trainer.step import _forward_step

    monkeypatch.setattr(megatron_rl.platform, "device", lambda: torch.device("meta"))
    (mb,) = pack_micro_batches(_batch([6, 5], routed_width=2), [0, 1], max_tokens=100)
    seen = {}

    def model(input_ids, position_ids, attention_mask, *, padding_mask, output_processor,
              output_processor_context):
        seen["model"] = [input_ids.device, position_ids.device, padding_mask.device]
        seen["context"] = output_processor_context
        return torch.zeros(1)

    replay = types.SimpleNamespace(install=lambda micro_batch, mode: seen.setdefault(
        "replay", micro_batch.routed_experts.device))
    _, loss = _forward_step(iter([mb]), model, groups=_single_rank_groups(),
                            denominators=None, settings=LossSettings(), temperature=1.0,
                            routing_replay=replay, replay_mode="replay")
    assert [d.type for d in seen["model"]] == ["meta"] * 3 and seen["replay"].type == "meta"
    loss_micro_batch = loss.args[0]
    assert loss_micro_batch is seen["context"]  # the head and the loss see the same batch
    assert {name: t.device.type for name, t in _tensor_fields(loss_micro_batch).items()} == \
        {name: "meta" for name in _tensor_fields(mb)}


def test_sequence_pad_multiple():
    from megatron_rl.trainer.batch import FP8_TOKEN_ALIGNMENT, sequence_pad_multiple

    assert FP8_TOKEN_ALIGNMENT == 128
    # (TP under sequence parallelism, CP) -> multiple without FP8, with FP8.
    expected = {(1, 1): (1, 128), (2, 1): (2, 256), (8, 1): (8, 1024), (1, 2): (4, 256),
                (2, 2): (8, 512), (4, 4): (32, 2048)}
    for (tp, cp), (plain, fp8) in expected.items():
        assert sequence_pad_multiple(tensor_parallel_size=tp, context_parallel_size=cp) == plain
        for recipe in ("delayed", "current", "mxfp8"):
            assert sequence_pad_multiple(tensor_parallel_size=tp, context_parallel_size=cp,
                                         fp8_recipe=recipe) == fp8
    with pytest.raises(ValueError, match="must be >= 1"):
        sequence_pad_multiple(tensor_parallel_size=0)


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (8, 1), (1, 2), (2, 2)])
def test_fp8_padding_gives_every_rank_te_aligned_tokens(tp, cp):
    """Each rank's tokens of every micro-batch (one row or several, after the CP split and the
    sequence-parallel split over TP) are divisible by 32 (MXFP8's scaling blocks) and 16 (the
    per-tensor recipes' weight-gradient GEMM), and the padding is masked out."""
    from megatron_rl.trainer.batch import sequence_pad_multiple

    multiple = sequence_pad_multiple(tensor_parallel_size=tp, context_parallel_size=cp,
                                     fp8_recipe="mxfp8")
    lengths = [300, 45, 9, 3]  # uneven; the longest alone in its micro-batch
    batch = _batch(lengths)
    micro_batches = pack_micro_batches(batch, range(4), max_tokens=3 * multiple,
                                       pad_to_multiple=multiple) + [padding_micro_batch(multiple)]
    rows = [len(mb.input_ids) for mb in micro_batches]
    assert 1 in rows and max(rows) > 1
    for mb in micro_batches:
        for cp_rank in range(cp):
            local = split_for_context_parallel(mb, cp_rank, cp)
            rows, length = local.input_ids.shape
            assert length % tp == 0
            tokens_per_rank = rows * (length // tp)
            assert tokens_per_rank % 32 == 0 and tokens_per_rank % 16 == 0
    for mb in micro_batches[:-1]:
        for row, sample in enumerate(mb.sample_index[:, 0].tolist()):
            real = lengths[sample] - 1  # positions of completion `sample`
            assert not mb.padding_mask[row, :real].any() and mb.padding_mask[row, real:].all()
            assert not mb.loss_mask[row, real:].any() and not mb.targets[row, real:].any()
    assert sum(mb.num_tokens for mb in micro_batches) == sum(n - 1 for n in lengths)


def test_padding_counts_in_no_statistic():
    """The step's per-micro-batch statistics of an FP8-padded packing equal the unpadded
    packing's, and a lock-step padding micro-batch adds nothing (tokens, loss, ratios)."""
    from megatron_rl.algorithms import AggregationDenominators
    from megatron_rl.trainer import LossSettings
    from megatron_rl.trainer.step import _loss

    batch = _batch([11, 6, 5])
    denominators = AggregationDenominators.from_sample_token_counts(
        batch.sample_num_loss_tokens(), batch.prompt_of_sample())

    def statistics(micro_batch):
        logp = micro_batch.old_logprobs[micro_batch.loss_mask] + 0.05  # ratio e^0.05
        loss, num_tokens, reduced = _loss(micro_batch, logp, denominators=denominators,
                                          settings=LossSettings())
        return loss.item(), int(num_tokens), reduced["stats"].tolist()

    (unpadded,) = pack_micro_batches(batch, range(3), max_tokens=10**6)
    (padded,) = pack_micro_batches(batch, range(3), max_tokens=10**6, pad_to_multiple=128)
    assert padded.input_ids.shape == (3, 128) and unpadded.input_ids.shape == (3, 10)
    assert statistics(padded) == statistics(unpadded)
    pad = padding_micro_batch(256)
    assert pad.num_tokens == 0 and pad.num_loss_tokens == 0
    loss, num_tokens, reduced = _loss(pad, torch.zeros(1), denominators=denominators,
                                      settings=LossSettings())
    assert loss.item() == 0.0 and int(num_tokens) == 0 and not reduced["stats"].any()


def _trainer(**settings):
    """An RLTrainer with its settings and one-rank groups, no model (micro-batch planning only)."""
    import torch.distributed as dist

    from megatron_rl.trainer import ParallelGroups, RLTrainer, TrainerSettings

    trainer = RLTrainer.__new__(RLTrainer)
    trainer.settings = TrainerSettings(**settings)
    trainer.layout = trainer.settings.layout
    world = dist.group.WORLD
    trainer.groups = ParallelGroups(tp=world, pp=world, dp=world, expert_dp=world, world_size=1,
                                    tp_rank=0, pp_rank=0, dp_rank=0, tp_size=1, pp_size=1,
                                    dp_size=1)
    return trainer


def test_trainer_pads_for_fp8(megatron_process_group):
    trainer = _trainer(fp8_recipe="mxfp8", micro_batch_max_tokens=300)
    assert trainer.pad_to_multiple == 128
    micro_batches = trainer.micro_batches(_batch([130, 40, 7]))
    assert [tuple(mb.input_ids.shape) for mb in micro_batches] == [(1, 256), (2, 128)]
    assert sum(mb.num_tokens for mb in micro_batches) == 129 + 39 + 6
    plain = _trainer(micro_batch_max_tokens=300)
    assert plain.pad_to_multiple == 1
    assert [tuple(mb.input_ids.shape) for mb in plain.micro_batches(_batch([130, 40, 7]))] == \
        [(2, 129), (1, 6)]


def test_example_recipes_token_budget_fits_their_padding():
    """Each recipe's micro_batch_max_tokens is a multiple of its padding multiple (FP8 ones:
    TP x CP x 128), so a sequence within the budget still fits it once padded."""
    from megatron_rl import config
    from megatron_rl.trainer.batch import sequence_pad_multiple

    root = pathlib.Path(__file__).resolve().parents[2] / "examples"
    recipes = sorted(p for p in root.glob("*/*.yaml") if p.parent.name != "sweeps")  # sweep files
    assert sum(config.load_config(path, []).model.fp8 is not None for path in recipes) >= 3
    for path in recipes:
        run = config.load_config(path, [])
        parallelism = run.parallelism
        multiple = sequence_pad_multiple(
            tensor_parallel_size=parallelism.tensor_model_parallel_size
            if parallelism.sequence_parallel else 1,
            context_parallel_size=parallelism.context_parallel_size, fp8_recipe=run.model.fp8)
        assert run.train.micro_batch_max_tokens % multiple == 0, (path.name, multiple)
