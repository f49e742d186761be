"""How per-token losses become one scalar: sample average (mean over completions of each
completion's token mean), prompt average (ScaleRL: per prompt, the sum over its completions'
tokens divided by their total token count, then the mean over prompts) or token average (DAPO).
Each mode is expressed as a per-token weight built from denominators counted over the WHOLE
global batch, so any shard (data-parallel rank, pipeline micro-batch, packed sequence) computes
``(token_loss * weights).sum()`` locally and the shards add up to the single-rank aggregate: no
per-micro-batch normalisation, no gradient rescaling by the number of micro-batches.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MODES = ("sample", "prompt", "token")


# eq=False: field-wise == on tensors is ambiguous; instances compare by identity.
@dataclass(frozen=True, slots=True, eq=False)
class AggregationDenominators:
    """Global loss-token counts of one optimizer step's batch.

    Samples and prompts are numbered globally (0..N-1). ``num_samples`` / ``num_prompts`` count
    those with at least one loss token: a completion whose tokens are all masked (or a prompt
    dropped by the zero-variance filter through its loss mask) has nothing to average and is left
    out of the mean instead of counting as a zero.
    """

    num_prompts: int
    num_samples: int
    num_tokens: int
    sample_num_tokens: torch.Tensor  # [num_samples_global] int64
    prompt_num_tokens: torch.Tensor  # [num_prompts_global] int64

    def __post_init__(self) -> None:
        for name in ("sample_num_tokens", "prompt_num_tokens"):
            counts = getattr(self, name)
            if not isinstance(counts, torch.Tensor) or counts.dim() != 1:
                raise ValueError(f"{name} must be a 1-D tensor of token counts")
            if counts.numel() and int(counts.min()) < 0:
                raise ValueError(f"{name} has negative token counts")
        if int(self.sample_num_tokens.sum()) != self.num_tokens:
            raise ValueError(f"num_tokens={self.num_tokens} differs from the sum of "
                             f"sample_num_tokens ({int(self.sample_num_tokens.sum())})")
        if int(self.prompt_num_tokens.sum()) != self.num_tokens:
            raise ValueError(f"num_tokens={self.num_tokens} differs from the sum of "
                             f"prompt_num_tokens ({int(self.prompt_num_tokens.sum())})")

    @classmethod
    def from_global_batch(cls, loss_masks: Sequence[torch.Tensor],
                          prompt_of_sample: Sequence[int]) -> "AggregationDenominators":
        """From one loss mask per completion of the global batch (sample id = list position)
        and the global prompt id of each completion."""
        counts = [int((torch.as_tensor(mask) != 0).sum()) for mask in loss_masks]
        return cls.from_sample_token_counts(counts, prompt_of_sample)

    @classmethod
    def from_sample_token_counts(cls, sample_num_tokens: Sequence[int] | torch.Tensor,
                                 prompt_of_sample: Sequence[int] | torch.Tensor
                                 ) -> "AggregationDenominators":
        """From each completion's number of loss tokens: enough for a driver that ships only
        lengths, not masks, to the trainers."""
        sample_counts = torch.as_tensor(sample_num_tokens, dtype=torch.int64).reshape(-1)
        prompt_ids = torch.as_tensor(prompt_of_sample, dtype=torch.int64).reshape(-1)
        if sample_counts.numel() != prompt_ids.numel():
            raise ValueError(f"got {sample_counts.numel()} completions but "
                             f"{prompt_ids.numel()} prompt ids; give one prompt id per completion")
        if prompt_ids.numel() and int(prompt_ids.min()) < 0:
            raise ValueError("prompt ids must be >= 0")
        num_prompts_global = int(prompt_ids.max()) + 1 if prompt_ids.numel() else 0
        prompt_counts = torch.zeros(num_prompts_global, dtype=torch.int64)
        prompt_counts.index_add_(0, prompt_ids, sample_counts)
        return cls._from_counts(sample_counts, prompt_counts)

    @classmethod
    def from_tokens(cls, loss_mask: torch.Tensor, sample_index: torch.Tensor,
                    prompt_index: torch.Tensor) -> "AggregationDenominators":
        """From the per-token view of a batch that is entirely present (single rank)."""
        mask = _as_bool_mask(loss_mask)
        for name, index in (("sample_index", sample_index), ("prompt_index", prompt_index)):
            _check_index(name, index, mask)
        sample_counts = _bincount(sample_index[mask], sample_index)
        prompt_counts = _bincount(prompt_index[mask], prompt_index)
        return cls._from_counts(sample_counts, prompt_counts)

    @classmethod
    def _from_counts(cls, sample_counts: torch.Tensor,
                     prompt_counts: torch.Tensor) -> "AggregationDenominators":
        return cls(
            num_prompts=int((prompt_counts > 0).sum()),
            num_samples=int((sample_counts > 0).sum()),
            num_tokens=int(sample_counts.sum()),
            sample_num_tokens=sample_counts,
            prompt_num_tokens=prompt_counts,
        )

    def to(self, device: torch.device | str) -> "AggregationDenominators":
        return AggregationDenominators(
            num_prompts=self.num_prompts, num_samples=self.num_samples,
            num_tokens=self.num_tokens,
            sample_num_tokens=self.sample_num_tokens.to(device),
            prompt_num_tokens=self.prompt_num_tokens.to(device),
        )


def token_weights(
    mode: str,
    loss_mask: torch.Tensor,
    sample_index: torch.Tensor | None,
    prompt_index: torch.Tensor | None,
    denominators: AggregationDenominators,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-token weights [T] such that ``(token_loss * weights).sum()`` over every shard of the
    global batch is the aggregate loss. ``sample_index`` / ``prompt_index`` are GLOBAL ids
    ([T] integer; only the one the mode needs may be None). Masked tokens weigh 0:

    - token:  1 / num_tokens
    - sample: 1 / (num_samples * tokens of the token's completion)
    - prompt: 1 / (num_prompts * tokens of all completions of the token's prompt)
    """
    if mode not in MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {MODES}")
    mask = _as_bool_mask(loss_mask)
    if mode == "token":
        per_token = torch.full(mask.shape, float(max(denominators.num_tokens, 1)),
                               dtype=torch.float64, device=mask.device)
    elif mode == "sample":
        per_token = _group_denominator("sample_index", sample_index, mask,
                                       denominators.sample_num_tokens, denominators.num_samples)
    else:
        per_token = _group_denominator("prompt_index", prompt_index, mask,
                                       denominators.prompt_num_tokens, denominators.num_prompts)
    weights = torch.where(mask, 1.0 / per_token, torch.zeros_like(per_token))
    return weights.to(dtype)


def aggregate_loss(
    token_loss: torch.Tensor,
    mode: str,
    loss_mask: torch.Tensor,
    sample_index: torch.Tensor | None,
    prompt_index: torch.Tensor | None,
    denominators: AggregationDenominators | None = None,
) -> torch.Tensor:
    """Scalar loss of these tokens; with ``denominators=None`` they are counted from the given
    tokens, i.e. this call holds the whole batch. Masked tokens are ignored even if NaN."""
    mask = _as_bool_mask(loss_mask)
    if token_loss.shape != mask.shape:
        raise ValueError(f"token_loss has shape {tuple(token_loss.shape)} but loss_mask has "
                         f"shape {tuple(mask.shape)}")
    if denominators is None:
        if mode == "token":
            sample_index = prompt_index = torch.zeros_like(mask, dtype=torch.int64)
        elif mode in MODES and (sample_index is None or prompt_index is None):
            raise ValueError(f"aggregation mode {mode!r} without denominators needs both "
                             "sample_index and prompt_index to count them")
        denominators = AggregationDenominators.from_tokens(mask, sample_index, prompt_index)
    weights = token_weights(mode, mask, sample_index, prompt_index, denominators.to(mask.device),
                            dtype=torch.promote_types(token_loss.dtype, torch.float32))
    return torch.where(mask, token_loss * weights, torch.zeros_like(weights)).sum()


def _group_denominator(name: str, index: torch.Tensor | None, mask: torch.Tensor,
                       group_num_tokens: torch.Tensor, num_groups: int) -> torch.Tensor:
    """num_groups * (loss tokens of the token's group), float64 [T]; 1 on masked tokens."""
    if index is None:
        raise ValueError(f"this aggregation mode needs {name} (global ids per token)")
    _check_index(name, index, mask)
    index = torch.where(mask, index, torch.zeros_like(index))
    if index.numel() and int(index.max()) >= group_num_tokens.numel():
        raise ValueError(f"{name} holds id {int(index.max())} but the denominators cover only "
                         f"{group_num_tokens.numel()} ids; build them from the whole global "
                         "batch and pass global ids")
    counts = group_num_tokens.to(mask.device)[index]  # [T]
    if bool((mask & (counts == 0)).any()):
        raise ValueError(f"a loss token's {name} has 0 loss tokens in the denominators; they "
                         "were not built from the same global batch and loss masks")
    return torch.where(mask, counts * num_groups, torch.ones_like(counts)).to(torch.float64)


def _as_bool_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dim() != 1:
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask)
        raise ValueError(f"loss_mask must be a 1-D per-token tensor [T], got {shape}")
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def _check_index(name: str, index: torch.Tensor, mask: torch.Tensor) -> None:
    if not isinstance(index, torch.Tensor) or index.shape != mask.shape:
        shape = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index)
        raise ValueError(f"{name} has shape {shape} but loss_mask has shape "
                         f"{tuple(mask.shape)}; give one id per token")
    if index.is_floating_point() or index.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {index.dtype}")
    # Padding tokens (mask 0) may carry any id, e.g. -1.
    if bool((mask & (index < 0)).any()):
        raise ValueError(f"{name} must hold ids >= 0 on loss tokens")


def _bincount(ids: torch.Tensor, all_ids: torch.Tensor) -> torch.Tensor:
    size = max(int(all_ids.max()) + 1, 0) if all_ids.numel() else 0
    return torch.bincount(ids.to(torch.int64).cpu(), minlength=size)
