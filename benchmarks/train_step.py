"""Tokens per second of one RL train step on CPU: our Megatron trainer (megatron_rl.trainer,
1 rank, fp32, CISPO + prompt-level aggregation, FP32 chunked head, AdamW) against a plain
transformers Llama4ForCausalLM of the same tiny size doing the same loss (full logits,
log_softmax, the same megatron_rl.algorithms loss and aggregation, torch AdamW). The transformers
model is also timed with the CPU shims active, to show what the shims cost.

Each measurement runs in its own interpreter (the CPU shims patch process-wide torch state).
Run: .venv/bin/python benchmarks/train_step.py [--steps N]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
NUM_PROMPTS, GROUP_SIZE, PROMPT_LEN, COMPLETION_LEN = 4, 4, 16, 48


def make_batch(vocab_size: int):
    from megatron_rl.trainer import TrainBatch

    gen = torch.Generator().manual_seed(0)
    ids, masks, old, prompts = [], [], [], []
    for p in range(NUM_PROMPTS):
        prompt = torch.randint(3, vocab_size, (PROMPT_LEN,), generator=gen)
        for _ in range(GROUP_SIZE):
            completion = torch.randint(3, vocab_size, (COMPLETION_LEN,), generator=gen)
            ids.append(torch.cat([prompt, completion]))
            masks.append(torch.cat([torch.zeros(PROMPT_LEN), torch.ones(COMPLETION_LEN)]))
            old.append(-torch.rand(PROMPT_LEN + COMPLETION_LEN, generator=gen) - 5.0)
            prompts.append(p)
    num = len(ids)
    return TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old,
                      advantages=torch.randn(num, generator=gen),
                      prompt_ids=torch.tensor(prompts), sample_ids=torch.arange(num))


def time_steps(step, num_steps: int) -> float:
    step()  # warm-up (lazy optimizer state, first-call overheads)
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    return (time.perf_counter() - start) / num_steps


def run_megatron(num_steps: int) -> dict:
    from megatron_rl.trainer import (LossSettings, OptimizerSettings, RLTrainer,
                                     TrainerSettings)

    trainer = RLTrainer(TrainerSettings(
        model_name="llama4", model_size="tiny", precision="fp32",
        loss=LossSettings(kind="cispo", aggregation="prompt"),
        optimizer=OptimizerSettings(lr=1e-5, lr_warmup_steps=0),
        micro_batch_max_tokens=NUM_PROMPTS * GROUP_SIZE * (PROMPT_LEN + COMPLETION_LEN)))
    batch = make_batch(vocab_size=256)
    seconds = time_steps(lambda: trainer.train_step(batch), num_steps)
    return {"seconds_per_step": seconds}


def run_transformers(num_steps: int, with_shims: bool) -> dict:
    import transformers

    from megatron_rl.algorithms import aggregate_loss, compute_policy_loss

    if with_shims:
        from megatron_rl.platform import activate_cpu_compat

        activate_cpu_compat()
    from models import get_model_family

    config_dict = get_model_family("llama4").hf_config("tiny")
    config = transformers.Llama4TextConfig(**{k: v for k, v in config_dict.items()
                                              if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, eps=1e-15, weight_decay=0.01)
    batch = make_batch(vocab_size=config.vocab_size)
    input_ids = torch.stack([ids[:-1] for ids in batch.token_ids])  # equal lengths
    targets = torch.stack([ids[1:] for ids in batch.token_ids])
    mask = torch.stack([m[1:] for m in batch.loss_mask]).bool()
    old = torch.stack([o[1:] for o in batch.old_logprobs])
    num_positions = input_ids.shape[1]
    sample_index = batch.sample_ids.repeat_interleave(num_positions)
    prompt_index = batch.prompt_ids.repeat_interleave(num_positions)
    advantages = batch.advantages.repeat_interleave(num_positions)

    def step():
        logits = model(input_ids=input_ids).logits.float()  # [b, s, vocab]
        logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).flatten()
        out = compute_policy_loss("cispo", logp, old.flatten(), advantages,
                                  sample_index=sample_index, loss_mask=mask.flatten())
        loss = aggregate_loss(out.token_loss, "prompt", mask.flatten(), sample_index,
                              prompt_index)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return {"seconds_per_step": time_steps(step, num_steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--part", choices=("megatron", "transformers", "transformers_shims"))
    args = parser.parse_args()
    if args.part:
        result = (run_megatron(args.steps) if args.part == "megatron" else
                  run_transformers(args.steps, with_shims=args.part == "transformers_shims"))
        print("RESULT " + json.dumps(result))
        return 0
    tokens = NUM_PROMPTS * GROUP_SIZE * (PROMPT_LEN + COMPLETION_LEN)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "PYTHONPATH": str(ROOT)}
    rows = []
    for part, label in (("transformers", "transformers Llama4ForCausalLM (baseline)"),
                        ("transformers_shims", "transformers, CPU shims active"),
                        ("megatron", "megatron_rl trainer (Megatron GPTModel, 1 rank)")):
        proc = subprocess.run([sys.executable, "-W", "ignore", __file__, "--part", part,
                               "--steps", str(args.steps)], env=env, capture_output=True,
                              text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{part} failed:\n{proc.stderr[-3000:]}")
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
        rows.append((label, json.loads(line[len("RESULT "):])["seconds_per_step"]))
    baseline = rows[0][1]
    print(f"RL train step, llama4 tiny, {tokens} tokens/step "
          f"({NUM_PROMPTS}x{GROUP_SIZE} completions of {PROMPT_LEN}+{COMPLETION_LEN}), "
          f"fp32, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, {args.steps} timed steps")
    print(f"{'implementation':<50} {'ms/step':>9} {'tokens/s':>10} {'vs baseline':>12}")
    for label, seconds in rows:
        print(f"{label:<50} {seconds * 1e3:9.1f} {tokens / seconds:10.0f} "
              f"{baseline / seconds:11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
