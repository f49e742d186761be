"""In-process sampling from the trainer's own Megatron model, for the tiny CPU run only.

The production generators are SGLang engines fed by the weight sync (megatron_rl/rollout,
megatron_rl/weight_sync). This stand-in samples with full recomputation (no KV cache) from the
model being trained, which is affordable only for tiny models and short completions, and records
the behaviour log-prob of every sampled token in FP32, as a generator must.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def sample(model, prompts: torch.Tensor, num_new_tokens: int, *, temperature: float,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts [n, P] -> (token_ids [n, P + num_new_tokens], behaviour log-probs [n, same]).

    Log-probs at prompt positions are 0 (they carry no loss). Greedy when temperature == 0.
    """
    model.eval()
    tokens = prompts.clone()
    logprobs = torch.zeros(prompts.shape, dtype=torch.float32)
    for _ in range(num_new_tokens):
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions, None)[:, -1].float()  # [n, vocab]
        if temperature == 0:
            next_token = logits.argmax(dim=-1)
            scaled = logits
        else:
            scaled = logits / temperature
            next_token = torch.multinomial(torch.softmax(scaled, dim=-1), 1,
                                           generator=generator).squeeze(-1)
        token_logprob = torch.log_softmax(scaled, dim=-1).gather(-1, next_token[:, None])
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        logprobs = torch.cat([logprobs, token_logprob], dim=1)
    return tokens, logprobs
