"""The byte layout of every bucket a pipeline stage sends, fixed once per `WeightSync`.

Shapes are known without moving any data (the full tensors' shapes follow from the shards'; the
mapping's `to_hf` runs on meta tensors), so the whole sync is planned up front: which mapping
groups go in which bucket, each HF tensor's byte offset, and which HF tensors are a Megatron tensor
unchanged (a renamed group, same dtype, nothing to trim): those are gathered straight into their
place in the bucket, the others are converted and copied in.

A bucket holds whole groups up to `bucket_bytes` (a larger group travels alone). Inside a bucket
the tensors are ordered by decreasing item size, so every tensor's byte offset is a multiple of its
item size (what SGLang's flattened-bucket receiver needs) with no padding, and one bucket can mix
dtypes.

For FP8-serving generators (`quantiser`: fp8.py SyncQuantiser) a tensor SGLang holds in FP8 is
planned as its fp8 weight (one byte an element) and float32 scale under their HF names (Llama-4's
fused experts as per-expert tensors); those are never gathered in place (the quantiser reads the
gathered tensor and writes other bytes), everything else is planned as before.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from megatron_rl.rollout.types import TensorSpec


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlannedBucket:
    groups: tuple  # the mapping's WeightGroups, in order
    specs: tuple[TensorSpec, ...]  # byte order
    offsets: tuple[int, ...]  # byte offset of each spec
    in_place: dict[str, str]  # HF name -> the Megatron tensor gathered straight into its slot

    @property
    def num_bytes(self) -> int:
        return self.offsets[-1] + self.specs[-1].num_bytes if self.specs else 0

    @property
    def num_quantized(self) -> int:
        """FP8 weights in this bucket (each beside its scale)."""
        return sum(spec.dtype == torch.float8_e4m3fn for spec in self.specs)

    @property
    def megatron_names(self) -> list[str]:
        return [name for group in self.groups for name in group.megatron_names]

    def slots(self, data: torch.Tensor) -> dict[str, torch.Tensor]:
        """{HF name: its typed view into `data` (a uint8 buffer of at least num_bytes)}."""
        return {spec.name: data[offset:offset + spec.num_bytes].view(spec.dtype).view(spec.shape)
                for spec, offset in zip(self.specs, self.offsets)}


def plan_buckets(groups: Sequence, meta: Callable[[str], torch.Tensor], *, bucket_bytes: int,
                 dtype: torch.dtype | None = None,
                 can_fill: Callable[[str], bool] = lambda name: True,
                 quantiser=None) -> list[PlannedBucket]:
    """Buckets for `groups`; `meta(megatron_name)` is the full tensor as a meta tensor, `dtype`
    the generators' dtype (None: keep the trainer's), `can_fill(megatron_name)` whether the
    gatherer can assemble that tensor in a caller's buffer, `quantiser` (fp8.SyncQuantiser or
    None) what replaces the tensors the generators hold in FP8."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, pending, pending_bytes = [], [], 0
    for group in groups:
        inputs = {name: meta(name) for name in group.megatron_names}
        outputs = group.to_hf(inputs)
        specs, in_place = [], {}
        for hf_name, tensor in outputs.items():
            quantized = quantiser.planned(hf_name, tensor) if quantiser is not None else None
            if quantized is not None:
                specs += [TensorSpec(name=name, dtype=t.dtype, shape=tuple(t.shape))
                          for name, t in quantized.items()]
                continue
            out_dtype = dtype or tensor.dtype
            specs.append(TensorSpec(name=hf_name, dtype=out_dtype, shape=tuple(tensor.shape)))
            source = next((m for m, t in inputs.items() if t is tensor), None)
            if source is not None and out_dtype == tensor.dtype and can_fill(source) \
                    and source not in in_place.values():
                in_place[hf_name] = source
        size = sum(spec.num_bytes for spec in specs)
        if pending and pending_bytes + size > bucket_bytes:
            buckets.append(_bucket(pending))
            pending, pending_bytes = [], 0
        pending.append((group, specs, in_place))
        pending_bytes += size
    if pending:
        buckets.append(_bucket(pending))
    return buckets


def _bucket(entries: list) -> PlannedBucket:
    specs = [spec for _, group_specs, _ in entries for spec in group_specs]
    specs.sort(key=lambda spec: -spec.dtype.itemsize)  # stable: mapping order within a size
    offsets, offset = [], 0
    for spec in specs:
        offsets.append(offset)
        offset += spec.num_bytes
    in_place = {hf: m for _, _, group_in_place in entries for hf, m in group_in_place.items()}
    return PlannedBucket(groups=tuple(group for group, _, _ in entries), specs=tuple(specs),
                         offsets=tuple(offsets), in_place=in_place)
