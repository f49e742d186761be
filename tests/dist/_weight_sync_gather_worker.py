"""Body of tests/dist/test_weight_sync_gather.py (4 ranks, one torchrun launch).

The tiny Llama-4 family (models/) is built at (TP, EP, PP) = (1,1,1) and its weights saved; the
reference is the converter mapping applied to that single-rank model's plain state dict (no
gather involved). Then, for every layout, a trainer loads the same weights and a `WeightSync`
(colocated tensor transport, small buckets so that a sync has many buckets and the two bucket
buffers are reused) sends them to an in-process recording generator on each stage's sender;
`hf_state_dict()` is collected too. Rank 0 writes, per layout, what the senders received: names,
the largest difference from the reference, bytes and buckets; and what each sender's sync keeps
allocated after it (bucket buffers, the scratch arena), which the memory planner predicts.
The FP8 layout (TP2 x EP2 x PP2 + SP, generators serving FP8 with [16, 16] blocks, bf16 as
their dtype) is compared bit for bit with the quantiser applied to the single-rank reference
(fp8.py's rule, unfuse and quantize_named, not the sync's SyncQuantiser).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from _trainer_worker import LAYOUTS  # noqa: E402  (the layouts every dist test uses)

from megatron_rl.platform import destroy_distributed  # noqa: E402
from megatron_rl.rollout.generator import Generator  # noqa: E402
from megatron_rl.trainer import (OptimizerSettings, ParallelLayout, RLTrainer,  # noqa: E402
                                 TrainerSettings)

BUCKET_BYTES = 96 * 1024  # the tiny model is ~1.3 MB: about a dozen buckets


class RecordingGenerator(Generator):
    """Receives colocated weight updates and keeps a copy of every tensor, as a real engine
    copies them into its model."""

    def __init__(self):
        self.received: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []
        self._version = 0

    num_ranks = property(lambda self: 1)
    weight_version = property(lambda self: self._version)

    def set_weight_version(self, version: int) -> None:
        self._version = version

    def update_weights_from_tensors(self, named_tensors, *, version, flush_cache=True):
        self.calls.append("tensors")
        for name, tensor in named_tensors:
            assert name not in self.received, f"{name} sent twice"
            self.received[name] = tensor.clone()

    def check_health(self) -> None:
        self.calls.append("health")

    def begin_weight_update(self) -> None:
        self.calls.append("begin")

    def end_weight_update(self) -> None:
        self.calls.append("end")

    def flush_cache(self) -> None:
        self.calls.append("flush")

    def pause(self, mode: str = "in_place") -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def _unused(self, *args, **kwargs):
        raise AssertionError("not part of a colocated sync")

    generate = score = abort = init_weight_update_group = destroy_weight_update_group = _unused
    update_weights_from_distributed = update_weights_from_disk = _unused


def build(layout: ParallelLayout) -> RLTrainer:
    from models import get_model_family

    return RLTrainer(TrainerSettings(
        model_name="llama4", model_size="tiny", layout=layout, precision="fp32", seed=7,
        optimizer=OptimizerSettings(use_distributed_optimizer=False)),
        family=get_model_family("llama4"))


def mapping():
    from models import get_model_family

    family = get_model_family("llama4")
    converter = family.converter()
    hf = converter.hf_text_config_from_dict(family.hf_config("tiny"))
    return converter.weight_groups(hf), hf


def compare(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    diffs = [float((state[k].double() - reference[k].to(state[k].dtype).double()).abs().max())
             for k in state]
    dtypes = sorted({str(t.dtype) for t in state.values()})
    shapes_ok = all(tuple(state[k].shape) == tuple(reference[k].shape) for k in state)
    return {"names": sorted(state), "max_diff": max(diffs, default=0.0), "dtypes": dtypes,
            "shapes_ok": shapes_ok}


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [16, 16]}  # blocks of whole heads (head_dim 16)


def fp8_reference(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What FP8-serving generators should receive: the quantiser applied to the single-rank
    reference in bf16 (the generators' dtype), Llama-4's fused experts per expert."""
    from megatron_rl.weight_sync import fp8

    layout = fp8.Fp8Layout.from_quantization_config(FP8_CONFIG)
    quantised = fp8.fp8_quantized(FP8_CONFIG, reference)
    out = {}
    for name, tensor in reference.items():
        tensor = tensor.bfloat16()
        if name not in quantised:
            out[name] = tensor
            continue
        pieces = fp8.unfuse_llama4_experts(name, tensor) if not name.endswith(".weight") \
            else {name: tensor}
        for piece_name, piece in pieces.items():
            out.update(fp8.quantize_named(piece_name, piece, layout))
    return out


def compare_bits(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    mismatched = [k for k in state if k not in reference or state[k].dtype != reference[k].dtype
                  or state[k].shape != reference[k].shape
                  or not torch.equal(bits(state[k]), bits(reference[k]))]
    return {"names": sorted(state), "mismatched": mismatched,
            "num_fp8": sum(t.dtype == torch.float8_e4m3fn for t in state.values()),
            "num_bytes": sum(t.numel() * t.element_size() for t in state.values())}


def gather_to_rank0(item) -> list:
    items = [None] * dist.get_world_size()
    dist.all_gather_object(items, item)
    return items


def run_layout(name: str, layout: ParallelLayout, init_dir: str | None, groups, hf,
               reference: dict, dtype: torch.dtype | None = None,
               quantization_config: dict | None = None) -> dict:
    from megatron_rl.weight_sync import WeightSync, WeightSyncSettings

    trainer = build(layout)
    if init_dir is not None:  # else: the trainer's own initialisation from the same seed
        trainer.load_checkpoint(init_dir, load_optimizer=False)
    generator = RecordingGenerator()
    sync = WeightSync(trainer.model, groups, [generator], WeightSyncSettings(
        transport="tensor", bucket_bytes=BUCKET_BYTES, dtype=dtype, pause_mode="in_place",
        quantization_config=quantization_config),
        hf_vocab_size=hf.vocab_size)
    report = sync.sync()
    # Before hf_state_dict(), which gathers everything into the arena (no bucket slots). The
    # colocated transport takes fresh bucket buffers every sync: ask for a sync's pair.
    kept = {"num_buckets": len(sync.plan),
            "largest_bucket": max(b.num_bytes for b in sync.plan),
            "buffers": sum(b.numel() * b.element_size() for b in sync._bucket_buffers())
            if sync.groups.is_sender else 0,
            "gathered": sync.arena.capacity}
    state = sync.hf_state_dict()
    sender = sync.groups.is_sender
    compared = compare if quantization_config is None else compare_bits
    mine = {
        "rank": dist.get_rank(), "sender": sender, "pp_rank": sync.groups.pp_rank,
        "received": compared(generator.received, reference) if sender else None,
        "hf_state_dict": compared(state, reference) if sender else None,
        "num_quantized": report.num_quantized, "quantize_s": report.quantize_s,
        "num_bytes": report.num_bytes, "num_buckets": report.num_buckets,
        "version": report.version, "calls": generator.calls,
        "planned_bytes": sum(b.num_bytes for b in sync.plan),
        "sync_memory": kept if sender else None,
    }
    return {"ranks": gather_to_rank0(mine)}


def main() -> None:
    out_dir = sys.argv[1]
    groups, hf = mapping()
    trainer = build(LAYOUTS["tp1_ep1_pp1"])
    init_dir = os.path.join(out_dir, "init")
    trainer.save_checkpoint(init_dir)
    from megatron_rl.trainer.model import unwrap
    from models.convert_common import convert_state_dict

    params = {k: v.detach().clone() for k, v in unwrap(trainer.model).state_dict().items()
              if not k.endswith("_extra_state")}
    reference = convert_state_dict(groups, params, to="hf")
    out = {"reference_names": sorted(reference),
           "reference_bytes": sum(t.numel() * t.element_size() for t in reference.values()),
           "layouts": {}}
    for name, layout in LAYOUTS.items():
        out["layouts"][name] = run_layout(name, layout, init_dir, groups, hf, reference)
    # No checkpoint: a TP2 trainer initialised from the same seed starts from the TP1 weights
    # (on CPU the trainer initialises full weights and splits them; see cpu_overrides).
    out["layouts"]["tp2_sp_fresh"] = run_layout("tp2_sp_fresh", LAYOUTS["tp2_sp"], None,
                                                groups, hf, reference)
    out["layouts"]["tp2_ep2_pp2_sp_bf16"] = run_layout(
        "tp2_ep2_pp2_sp_bf16", LAYOUTS["tp2_ep2_pp2_sp"], init_dir, groups, hf, reference,
        dtype=torch.bfloat16)
    reference_fp8 = fp8_reference(reference)
    out["reference_fp8_names"] = sorted(reference_fp8)
    out["reference_fp8_bytes"] = sum(t.numel() * t.element_size() for t in reference_fp8.values())
    out["layouts"]["tp2_ep2_pp2_sp_fp8"] = run_layout(
        "tp2_ep2_pp2_sp_fp8", LAYOUTS["tp2_ep2_pp2_sp"], init_dir, groups, hf, reference_fp8,
        dtype=torch.bfloat16, quantization_config=FP8_CONFIG)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(out, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
