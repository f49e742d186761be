"""Time of one RL train step on CPU: our Megatron trainer (megatron_rl.trainer, 1 rank, fp32,
CISPO + prompt-level aggregation, FP32 chunked head, AdamW) against a plain transformers
Llama4ForCausalLM of the same size doing the same loss (full logits, log_softmax, the same
megatron_rl.algorithms loss and aggregation, torch AdamW). The transformers model is also timed
with the CPU shims active, which gives the shims' share of a step.

Two sizes: "tiny" (the llama4 tiny test model, hidden 64, 1024 tokens per step: per-op overhead
dominates) and "large" (the same architecture at hidden 512 with 32 heads and 1024-wide experts,
4096 tokens per step: compute dominates). Every measurement runs in its own interpreter (the CPU
shims patch process-wide torch state); the variants are run alternately, `--repeats` times each,
and the table gives the median, the spread (min-max) and the ratio of medians.

`--breakdown SIZE` instead profiles the trainer's step (torch.profiler) and prints the time per
component, forward and backward separately (docs/trainer_speed.md explains the attribution).

Run: .venv/bin/python benchmarks/train_step.py [--sizes tiny,large] [--repeats 3] [--steps 5]
     .venv/bin/python benchmarks/train_step.py --breakdown tiny [--top-ops 4]
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# (prompts, samples per prompt, prompt length, completion length); HF and Megatron size fields.
SIZES = {
    "tiny": dict(shape=(4, 4, 16, 48), steps=5, hf={}, megatron={}),
    "large": dict(
        shape=(16, 4, 16, 48), steps=1,
        hf=dict(hidden_size=512, num_attention_heads=32, num_key_value_heads=8, head_dim=16,
                intermediate_size=1024, intermediate_size_mlp=2048),
        megatron=dict(hidden_size=512, num_attention_heads=32, num_query_groups=8,
                      kv_channels=16, ffn_hidden_size=2048, moe_ffn_hidden_size=1024,
                      moe_shared_expert_intermediate_size=1024)),
}
VARIANTS = (("transformers", "transformers Llama4ForCausalLM (baseline)"),
            ("transformers_shims", "transformers, CPU shims active"),
            ("megatron", "megatron_rl trainer (Megatron GPTModel, 1 rank)"))


def num_tokens(size: str) -> int:
    prompts, group, prompt_len, completion_len = SIZES[size]["shape"]
    return prompts * group * (prompt_len + completion_len)


def make_batch(size: str, vocab_size: int):
    from megatron_rl.trainer import TrainBatch

    num_prompts, group_size, prompt_len, completion_len = SIZES[size]["shape"]
    gen = torch.Generator().manual_seed(0)
    ids, masks, old, prompts = [], [], [], []
    for p in range(num_prompts):
        prompt = torch.randint(3, vocab_size, (prompt_len,), generator=gen)
        for _ in range(group_size):
            completion = torch.randint(3, vocab_size, (completion_len,), generator=gen)
            ids.append(torch.cat([prompt, completion]))
            masks.append(torch.cat([torch.zeros(prompt_len), torch.ones(completion_len)]))
            old.append(-torch.rand(prompt_len + completion_len, generator=gen) - 5.0)
            prompts.append(p)
    num = len(ids)
    return TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old,
                      advantages=torch.randn(num, generator=gen),
                      prompt_ids=torch.tensor(prompts), sample_ids=torch.arange(num))


def time_steps(step, num_steps: int, warm_up: int = 2) -> float:
    for _ in range(warm_up):  # lazy optimizer state, first-call overheads, torch.compile
        step()
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    return (time.perf_counter() - start) / num_steps


def make_trainer(size: str):
    from megatron_rl.trainer import (LossSettings, OptimizerSettings, RLTrainer,
                                     TrainerSettings)

    return RLTrainer(TrainerSettings(
        model_name="llama4", model_size="tiny", precision="fp32",
        loss=LossSettings(kind="cispo", aggregation="prompt"),
        optimizer=OptimizerSettings(lr=1e-5, lr_warmup_steps=0),
        micro_batch_max_tokens=num_tokens(size), config_overrides=SIZES[size]["megatron"]))


def run_megatron(size: str, num_steps: int) -> float:
    trainer = make_trainer(size)
    batch = make_batch(size, vocab_size=256)
    return time_steps(lambda: trainer.train_step(batch), num_steps)


def run_transformers(size: str, num_steps: int, with_shims: bool) -> float:
    import transformers

    from megatron_rl.algorithms import aggregate_loss, compute_policy_loss

    if with_shims:
        from megatron_rl.platform import activate_cpu_compat

        activate_cpu_compat()
    from models import get_model_family

    config_dict = {**get_model_family("llama4").hf_config("tiny"), **SIZES[size]["hf"]}
    config = transformers.Llama4TextConfig(**{k: v for k, v in config_dict.items()
                                              if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, eps=1e-15, weight_decay=0.01)
    batch = make_batch(size, vocab_size=config.vocab_size)
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

    return time_steps(step, num_steps)


# --- per-component breakdown ---------------------------------------------------------------
# Forward: each component's module/function runs inside a profiler scope "C:<label>"; its time
# is the scope's duration minus nested scopes and backward nodes. Backward: every autograd node
# ("evaluate_function: XBackward") carries the sequence number of the forward op that created
# it; the node's time goes to the component whose scope ran that op.
_BACKWARD = "autograd::engine::evaluate_function: "
_NOT_A_FORWARD = ("optimizer", "zero grads", "grad-finite", "batch packing", "grad finalize",
                  "schedule", "step other")


def _scope(obj, attr: str, label: str) -> None:
    original = getattr(obj, attr)

    @functools.wraps(original)
    def scoped(*args, **kwargs):
        with torch.autograd.profiler.record_function("C:" + label):
            return original(*args, **kwargs)

    setattr(obj, attr, scoped)


def _instrument(trainer) -> None:
    import megatron.core.optimizer.optimizer as megatron_optimizer

    import megatron_rl.trainer.step as step_module
    import megatron_rl.trainer.trainer as trainer_module
    from megatron_rl.trainer.model import unwrap

    gpt = unwrap(trainer.model)
    _scope(gpt.embedding, "forward", "embedding")
    for layer in gpt.decoder.layers:
        _scope(layer.input_layernorm, "forward", "RMS norms")
        _scope(layer.pre_mlp_layernorm, "forward", "RMS norms")
        _scope(layer.self_attention, "forward", "attention: QKV/out projections, RoPE, q/k norm")
        _scope(layer.self_attention.core_attention, "forward", "attention: core (chunked, local)")
        mlp = layer.mlp
        if not hasattr(mlp, "router"):
            _scope(mlp, "forward", "dense MLP")
            continue
        _scope(mlp, "forward", "MoE: layer glue")
        _scope(mlp.router, "forward", "MoE: router")
        _scope(mlp.experts, "forward", "MoE: routed experts")
        if mlp.shared_experts is not None:
            _scope(mlp.shared_experts, "forward", "MoE: shared expert")
        for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                     "combine_preprocess", "token_combine", "combine_postprocess"):
            _scope(mlp.token_dispatcher, name, "MoE: dispatcher permute/unpermute")
    _scope(gpt.decoder.final_layernorm, "forward", "RMS norms")
    _scope(step_module, "_fp32_logprob_head", "LM head (FP32 chunked log-probs)")
    _scope(step_module, "_loss", "RL loss")
    _scope(trainer_module, "run_forward_backward", "fwd-bwd schedule, autograd engine")
    _scope(trainer.config, "finalize_model_grads_func", "grad finalize (DP/EP/SP reduce)")
    _scope(trainer, "_grads_finite", "grad-finite check")
    _scope(trainer, "micro_batches", "batch packing")
    _scope(trainer.model, "zero_grad_buffer", "zero grads")
    _scope(trainer.optimizer, "zero_grad", "zero grads")
    _scope(trainer.optimizer, "step", "optimizer: other")
    _scope(trainer.optimizer, "get_grad_norm", "optimizer: grad norm + clip")
    _scope(megatron_optimizer, "clip_grad_by_total_norm_fp32", "optimizer: grad norm + clip")
    for optimizer in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        _scope(optimizer, "prepare_grads", "optimizer: grads to main params (copy)")
        _scope(optimizer, "_copy_main_params_to_model_params",
               "optimizer: main params to model (copy, gather)")
        _scope(optimizer, "start_param_sync_for_bucket_group_subset",
               "optimizer: main params to model (copy, gather)")
        _scope(optimizer.optimizer, "step", "optimizer: AdamW math")


def _attribute(events, num_steps: int):
    """(ms per step, top-level aten ops per step, {operator: ms per step}) per component label."""
    def is_owner(event) -> bool:
        return event.name.startswith("C:") or event.name.startswith(_BACKWARD)

    def owner(event):
        parent = event.cpu_parent
        while parent is not None and not is_owner(parent):
            parent = parent.cpu_parent
        return parent

    component_of_op = {}  # forward sequence number -> component
    for event in events:
        if event.sequence_nr < 0 or event.name.startswith("autograd::"):
            continue
        scope = event if event.name.startswith("C:") else owner(event)
        if scope is not None and scope.name.startswith("C:"):
            component_of_op.setdefault(event.sequence_nr, scope.name[2:])
    owners = [event for event in events if is_owner(event)]
    nested = collections.defaultdict(float)
    for event in owners:
        if (parent := owner(event)) is not None:
            nested[id(parent)] += event.cpu_time_total
    label_of = {}
    totals: dict[str, float] = collections.defaultdict(float)
    for event in owners:
        if event.name.startswith("C:"):
            label = event.name[2:]
            parent = owner(event)
            if parent is not None and parent.name.startswith(_BACKWARD):
                label += " [recompute]"
            elif not any(word in label for word in _NOT_A_FORWARD):
                label += " [fwd]"
        else:
            label = component_of_op.get(event.sequence_nr, "fwd-bwd schedule, autograd engine")
            label += " [bwd]"
        label_of[id(event)] = label
        totals[label] += (event.cpu_time_total - nested[id(event)]) / 1e3 / num_steps
    # Top-level aten ops (not called from inside another aten op) and their time, per component.
    counts: dict[str, float] = collections.defaultdict(float)
    operators: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        if parent is not None and parent.name.startswith("aten::"):
            continue
        scope = owner(event)
        label = label_of.get(id(scope), "fwd-bwd schedule, autograd engine") if scope else \
            "fwd-bwd schedule, autograd engine"
        counts[label] += 1 / num_steps
        operators[label][event.name[len("aten::"):]] += event.cpu_time_total / 1e3 / num_steps
    return totals, counts, operators


def run_breakdown(size: str, num_steps: int, top_ops: int = 0) -> None:
    from torch.profiler import ProfilerActivity, profile

    trainer = make_trainer(size)
    batch = make_batch(size, vocab_size=256)
    _instrument(trainer)

    def step():
        with torch.autograd.profiler.record_function("C:step other"):
            trainer.train_step(batch)

    unprofiled = time_steps(step, num_steps)
    cpu_start = time.process_time()
    for _ in range(num_steps):
        step()
    cpu = (time.process_time() - cpu_start) / num_steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            step()
    totals, counts, operators = _attribute(prof.events(), num_steps)
    total = sum(totals.values())
    print(f"megatron_rl trainer step, llama4 {size}, {num_tokens(size)} tokens, fp32, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}: {unprofiled * 1e3:.1f} ms/step "
          f"unprofiled (process CPU time {cpu * 1e3:.1f} ms/step), {total:.1f} ms/step under the "
          f"profiler ({num_steps} steps), {sum(counts.values()):.0f} top-level aten ops/step")
    print(f"{'component':<62} {'ms/step':>8} {'share':>6} {'ops/step':>8}")
    for label, ms in sorted(totals.items(), key=lambda item: -item[1]):
        line = f"{label:<62} {ms:8.2f} {100 * ms / total:5.1f}% {counts.get(label, 0):8.0f}"
        if top_ops:
            ranked = sorted(operators[label].items(), key=lambda item: -item[1])[:top_ops]
            line += "  " + ", ".join(f"{name} {value:.1f}" for name, value in ranked)
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="timed steps per measurement (default: 5 at "
                        "tiny, 1 at large)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per variant")
    parser.add_argument("--sizes", default="tiny,large")
    parser.add_argument("--breakdown", choices=tuple(SIZES))
    parser.add_argument("--top-ops", type=int, default=0, help="with --breakdown: also list "
                        "each component's N most expensive aten operators (ms/step, inclusive)")
    parser.add_argument("--part", choices=tuple(name for name, _ in VARIANTS))
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    args = parser.parse_args()
    if args.breakdown:
        run_breakdown(args.breakdown, args.steps or SIZES[args.breakdown]["steps"],
                      top_ops=args.top_ops)
        return 0
    if args.part:
        steps = args.steps or SIZES[args.size]["steps"]
        seconds = (run_megatron(args.size, steps) if args.part == "megatron" else
                   run_transformers(args.size, steps,
                                    with_shims=args.part == "transformers_shims"))
        print("RESULT " + json.dumps({"seconds_per_step": seconds}))
        return 0
    sizes = args.sizes.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "PYTHONPATH": str(ROOT)}
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for repeat in range(args.repeats):
        for size in sizes:
            # Alternate the order so a slow phase of a shared machine hits every variant.
            order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
            for part, _ in order:
                proc = subprocess.run(
                    [sys.executable, "-W", "ignore", __file__, "--part", part, "--size", size,
                     *(["--steps", str(args.steps)] if args.steps else [])], env=env, capture_output=True, text=True,
                    timeout=900)
                if proc.returncode != 0:
                    raise RuntimeError(f"{part} ({size}) failed:\n{proc.stderr[-3000:]}")
                line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
                times[size, part].append(json.loads(line[len("RESULT "):])["seconds_per_step"])
    print(f"RL train step, fp32, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, "
          f"{args.repeats} measurements per variant (alternating), each the mean of "
          f"{args.steps or 'the size default of'} timed steps after 2 warm-up steps")
    for size in sizes:
        prompts, group, prompt_len, completion_len = SIZES[size]["shape"]
        print(f"\nllama4 {size}: {num_tokens(size)} tokens/step ({prompts}x{group} completions "
              f"of {prompt_len}+{completion_len}), {args.steps or SIZES[size]['steps']} timed "
              "steps per measurement")
        print(f"{'implementation':<50} {'median ms':>9} {'min-max ms':>15} {'tokens/s':>9} "
              f"{'vs baseline':>12}")
        baseline = statistics.median(times[size, "transformers"])
        for part, label in VARIANTS:
            values = times[size, part]
            median = statistics.median(values)
            spread = f"{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"
            print(f"{label:<50} {median * 1e3:9.1f} {spread:>15} {num_tokens(size) / median:9.0f} "
                  f"{baseline / median:11.2f}x")
        shims = statistics.median(times[size, "transformers_shims"])
        print(f"CPU shims' share of the transformers step: {100 * (shims - baseline) / shims:+.0f}% "
              "(median with shims vs without; negative = within noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
