"""A verifiable toy task that a tiny random model can learn on a CPU in a minute.

Prompts are random token strings; a completion is correct when most of its tokens lie in the
lower half of the vocabulary. A uniform random policy passes a 12-token completion with
P(Bin(12, 1/2) >= 7) = 0.387 (the random-init tiny model measures about 0.5), so groups have
reward variance from the first step and the pass rate has room to climb: exactly what is needed to show
the RL machinery (sampling, verification, filtering, advantages, CISPO, validation curve) working
end to end at a size where correctness, not capability, is the point.
"""
from __future__ import annotations

import torch


def make_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """[num_prompts, prompt_len] token ids; token 0 is kept out (it reads as padding)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (num_prompts, prompt_len), generator=generator)


def verify(completions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, completion_len] -> [n] reward 1.0 if more than half the tokens are < vocab_size / 2."""
    lower = (completions < vocab_size // 2).float().mean(dim=-1)
    return (lower > 0.5).float()
