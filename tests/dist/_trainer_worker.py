"""Body of the multi-process trainer tests (tests/dist/test_trainer_parallel.py), one torchrun
launch per scenario. Rank 0 writes the measured values as JSON to OUT_DIR/result.json; the pytest
side asserts on them, so a failure shows the numbers.

Scenarios:
  invariance (4 ranks): one RL step of the same batch from the same weights at (TP, EP, PP) =
    (1,1,1), (2,1,1)+SP, (1,2,1), (1,1,2), (2,2,2)+SP (DP fills the rest) -> loss, grad norm and
    updated parameters per layout; an independent single-rank reference (plain autograd on the
    unwrapped GPTModel: full logits, log_softmax, hand-written CISPO and prompt-level averaging);
    checkpoint resharding (save at (1,1,1) after step 1, resume at (2,2,2) for steps 2-3); the
    Llama-4 tiny family at (1,1,1) and (2,2,2).
  training (2 ranks): the loss falls over a few steps on a fixed batch; a non-finite loss skips
    the step without touching the weights.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_rl.platform import destroy_distributed  # noqa: E402
from megatron_rl.trainer import (LossSettings, OptimizerSettings, ParallelLayout,  # noqa: E402
                                 RLTrainer, TrainBatch, TrainerSettings)

LAYOUTS = {
    "tp1_ep1_pp1": ParallelLayout(),
    "tp2_sp": ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True),
    "ep2": ParallelLayout(expert_model_parallel_size=2),
    "pp2": ParallelLayout(pipeline_model_parallel_size=2),
    # 4 ranks: TP2 x PP2 (DP1); experts EP2 x ETP1 x PP2.
    "tp2_ep2_pp2_sp": ParallelLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                     expert_tensor_parallel_size=1,
                                     pipeline_model_parallel_size=2, sequence_parallel=True),
}


def make_batch(vocab_size: int, *, seed: int = 0) -> TrainBatch:
    """3 prompts x 2 samples, uneven prompt and completion lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths = [3, 5, 4], [[6, 2], [9, 4], [3, 7]]
    ids, masks, old, advantages, prompts = [], [], [], [], []
    for p, (prompt_len, lengths) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=gen)
        for k, n in enumerate(lengths):
            ids.append(torch.cat([prompt, torch.randint(0, vocab_size, (n,), generator=gen)]))
            mask = torch.cat([torch.zeros(prompt_len), torch.ones(n)])
            if n > 3:
                mask[prompt_len + 1] = 0  # a forced-interruption token inside the completion
            masks.append(mask)
            old.append(-0.5 - 4.0 * torch.rand(prompt_len + n, generator=gen))
            advantages.append(1.0 if k == 0 else -0.7)
            prompts.append(p)
    return TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old,
                      advantages=torch.tensor(advantages), prompt_ids=torch.tensor(prompts),
                      sample_ids=torch.arange(len(ids)))


def settings(layout: ParallelLayout, *, model_name="tiny_moe", lr=1e-3, kind="cispo",
             max_tokens=24, **overrides) -> TrainerSettings:
    return TrainerSettings(
        model_name=model_name, model_size="tiny", layout=layout, precision="fp32",
        loss=LossSettings(kind=kind, aggregation="prompt", logprob_chunk_size=8),
        optimizer=OptimizerSettings(lr=lr, lr_warmup_steps=0, clip_grad=1.0),
        micro_batch_max_tokens=max_tokens, seed=1234, config_overrides=overrides)


def family_for(name: str):
    if name == "tiny_moe":
        from _tiny_family import TinyMoEFamily

        return TinyMoEFamily()
    from models import get_model_family

    return get_model_family(name)


def build(layout, model_name="tiny_moe", **kwargs) -> RLTrainer:
    # The default process group stays up; init_parallel rebuilds Megatron's groups for `layout`.
    overrides = {"num_layers": 2} if model_name == "llama4" else {}
    return RLTrainer(settings(layout, model_name=model_name, **overrides, **kwargs),
                     family=family_for(model_name))


def full_params(trainer: RLTrainer) -> dict[str, torch.Tensor]:
    """Parameters of a (1,1,1)-layout trainer (every rank holds the whole model)."""
    from megatron_rl.trainer.model import unwrap

    return {k: v.detach().clone() for k, v in unwrap(trainer.model).state_dict().items()
            if not k.endswith("_extra_state")}


def reference_loss_and_grad_norm(trainer: RLTrainer, batch: TrainBatch) -> tuple[float, float]:
    """Independent single-rank reference: plain autograd through the unwrapped GPTModel, full
    logits, log_softmax in float64, CISPO and prompt-level averaging written out by hand."""
    from megatron_rl.trainer.model import unwrap

    model = unwrap(trainer.model)
    params = [p for p in model.parameters()]
    per_prompt: dict[int, list[torch.Tensor]] = {}
    for i in range(batch.num_samples):
        ids = batch.token_ids[i]
        logits = model(ids[:-1].unsqueeze(0), torch.arange(ids.numel() - 1).unsqueeze(0), None)
        logp = torch.log_softmax(logits[0].double(), dim=-1).gather(
            1, ids[1:].unsqueeze(1)).squeeze(1)
        mask = batch.loss_mask[i][1:] != 0
        old = batch.old_logprobs[i][1:].double()
        ratio = torch.exp(logp.detach() - old).clamp(max=5.0)
        token_loss = -(ratio * float(batch.advantages[i]) * logp)
        per_prompt.setdefault(int(batch.prompt_ids[i]), []).append(token_loss[mask])
    loss = sum(torch.cat(v).sum() / torch.cat(v).numel() for v in per_prompt.values())
    loss = loss / len(per_prompt)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    return float(loss), norm


def scenario_invariance(out: dict, ckpt_root: str) -> None:
    batch = make_batch(vocab_size=96)
    # Reference layout: initial weights, one step, the reference values.
    trainer = build(LAYOUTS["tp1_ep1_pp1"])
    init_dir = os.path.join(ckpt_root, "init")
    trainer.save_checkpoint(init_dir)
    ref_loss, ref_norm = reference_loss_and_grad_norm(trainer, batch)
    out["naive_reference"] = {"loss": ref_loss, "grad_norm": ref_norm}
    steps = {}
    for name, layout in LAYOUTS.items():
        if name != "tp1_ep1_pp1":
            trainer = build(layout)
            trainer.load_checkpoint(init_dir, load_optimizer=False)
        metrics = trainer.train_step(batch)
        steps[name] = {"loss": metrics.loss, "grad_norm": metrics.grad_norm,
                       "num_micro_batches": metrics.num_micro_batches,
                       "num_loss_tokens": metrics.num_loss_tokens,
                       "dp_size": trainer.groups.dp_size}
        trainer.save_checkpoint(os.path.join(ckpt_root, f"step1_{name}"),
                                extra_state={"sampler": {"epoch": 3, "retired": [1, 5]}})
        if name == "tp1_ep1_pp1":
            # Continue two more steps for the resume check below.
            steps[name]["continued"] = [trainer.train_step(batch).loss for _ in range(2)]
    out["layouts"] = steps
    # Resume the (1,1,1) step-1 checkpoint at (2,2,2)+SP with its optimizer state.
    trainer = build(LAYOUTS["tp2_ep2_pp2_sp"])
    state = trainer.load_checkpoint(os.path.join(ckpt_root, "step1_tp1_ep1_pp1"))
    out["resumed"] = {"step": state.step, "rng_restored": state.rng_restored,
                      "extra_state": state.extra_state,
                      "losses": [trainer.train_step(batch).loss for _ in range(2)]}
    # Compare every layout's updated weights at (1,1,1).
    trainer = build(LAYOUTS["tp1_ep1_pp1"])
    trainer.load_checkpoint(os.path.join(ckpt_root, "step1_tp1_ep1_pp1"), load_optimizer=False)
    reference = full_params(trainer)
    trainer.load_checkpoint(init_dir, load_optimizer=False)
    initial = full_params(trainer)
    diffs = {}
    for name in LAYOUTS:
        trainer.load_checkpoint(os.path.join(ckpt_root, f"step1_{name}"), load_optimizer=False)
        params = full_params(trainer)
        diffs[name] = {
            "max_abs_diff_vs_reference": max(float((params[k] - reference[k]).abs().max())
                                             for k in reference),
            "max_abs_update": max(float((params[k] - initial[k]).abs().max()) for k in initial),
            "num_params": len(params)}
    out["param_diffs"] = diffs
    # The Llama-4 tiny family (models/) at (1,1,1) and at (2,2,2)+SP from the same weights.
    llama_batch = make_batch(vocab_size=256, seed=1)
    trainer = build(LAYOUTS["tp1_ep1_pp1"], model_name="llama4", max_tokens=32)
    llama_init = os.path.join(ckpt_root, "llama_init")
    trainer.save_checkpoint(llama_init)
    first = trainer.train_step(llama_batch)
    trainer = build(LAYOUTS["tp2_ep2_pp2_sp"], model_name="llama4", max_tokens=32)
    trainer.load_checkpoint(llama_init, load_optimizer=False)
    second = trainer.train_step(llama_batch)
    out["llama4"] = {"tp1_ep1_pp1": {"loss": first.loss, "grad_norm": first.grad_norm},
                     "tp2_ep2_pp2_sp": {"loss": second.loss, "grad_norm": second.grad_norm}}


def scenario_training(out: dict, ckpt_root: str) -> None:
    del ckpt_root
    batch = make_batch(vocab_size=96, seed=2)
    trainer = build(ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True),
                    kind="grpo", lr=3e-3)
    out["losses"] = [trainer.train_step(batch).loss for _ in range(6)]
    before = full_params(trainer)
    bad = TrainBatch(token_ids=batch.token_ids, loss_mask=batch.loss_mask,
                     old_logprobs=[torch.full_like(o, float("nan")) for o in batch.old_logprobs],
                     advantages=batch.advantages, prompt_ids=batch.prompt_ids,
                     sample_ids=batch.sample_ids)
    skipped = trainer.train_step(bad)
    after = full_params(trainer)
    out["skip"] = {"skipped": skipped.skipped, "num_skipped_steps": skipped.num_skipped_steps,
                   "step": skipped.step, "loss_is_finite": math.isfinite(skipped.loss),
                   "max_param_change": max(float((after[k] - before[k]).abs().max())
                                           for k in before)}
    out["after_skip_loss"] = trainer.train_step(batch).loss


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    out: dict = {}
    # out_dir is shared by all ranks (the test's tmp_path): checkpoints go below it.
    {"invariance": scenario_invariance, "training": scenario_training}[scenario](
        out, os.path.join(out_dir, "ckpt"))
    write_result(out, out_dir)


def write_result(out: dict, out_dir: str) -> None:
    """Rank 0 writes the measured values to OUT_DIR/result.json (what conftest's
    `torchrun_result` returns to the test); every rank then leaves the process group."""
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(out, f, indent=1)
    destroy_distributed()


if __name__ == "__main__":
    main()
