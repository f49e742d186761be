"""A `Bucket`: HF-named tensors packed back to back in one flat uint8 tensor.

Its tensors' bytes lie in `specs` order with no padding: exactly SGLang's "flattened_bucket" load
format, so one broadcast moves a whole bucket and the generator rebuilds the tensors as views.
Every tensor's byte offset is a multiple of its item size (plan.py orders a bucket's tensors by
decreasing item size), which the receiver requires.
"""
from __future__ import annotations

import dataclasses

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
