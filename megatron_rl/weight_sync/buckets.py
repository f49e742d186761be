"""Packing HF-named tensors into byte buckets of a configurable size.

A `Bucket` is one flat uint8 tensor holding its tensors back to back (row-major bytes, no padding)
plus their `TensorSpec`s: exactly SGLang's "flattened_bucket" load format, so one broadcast moves a
whole bucket and the generator rebuilds the tensors as views. A bucket holds one dtype only (the
receiver requires every tensor's byte offset to be a multiple of its item size). A tensor larger
than the bucket size travels alone. `BucketPacker` copies each tensor into a preallocated buffer
(no concatenation of many small tensors at the end).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from megatron_rl.rollout.types import TensorSpec


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    specs: tuple[TensorSpec, ...]
    data: torch.Tensor  # [num_bytes] uint8

    @property
    def num_bytes(self) -> int:
        return self.data.numel()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The packed tensors, as views into `data`."""
        out, offset = [], 0
        for spec in self.specs:
            chunk = self.data[offset:offset + spec.num_bytes]
            out.append((spec.name, chunk.view(spec.dtype).view(spec.shape)))
            offset += spec.num_bytes
        return out


class BucketPacker:
    """Accumulates tensors; `add` returns the buckets that filled up, `flush` the rest."""

    def __init__(self, bucket_bytes: int, *, device: torch.device | str = "cpu"):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        done = []
        num_bytes = tensor.numel() * tensor.element_size()
        if self._pending and (self._pending_bytes + num_bytes > self.bucket_bytes
                              or tensor.dtype != self._pending[0][1].dtype):
            done.append(self._pack())
        self._pending.append((name, tensor))
        self._pending_bytes += num_bytes
        if self._pending_bytes >= self.bucket_bytes:
            done.append(self._pack())
        return done

    def flush(self) -> list[Bucket]:
        return [self._pack()] if self._pending else []

    def _pack(self) -> Bucket:
        data = torch.empty(self._pending_bytes, dtype=torch.uint8, device=self.device)
        specs, offset = [], 0
        for name, tensor in self._pending:
            spec = TensorSpec(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))
            data[offset:offset + spec.num_bytes].view(tensor.dtype).view(tensor.shape).copy_(
                tensor)
            specs.append(spec)
            offset += spec.num_bytes
        self._pending, self._pending_bytes = [], 0
        return Bucket(specs=tuple(specs), data=data)


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *,
                 device: torch.device | str = "cpu") -> Iterator[Bucket]:
    """Buckets of `named_tensors`, in order."""
    packer = BucketPacker(bucket_bytes, device=device)
    for name, tensor in named_tensors:
        yield from packer.add(name, tensor)
    yield from packer.flush()
