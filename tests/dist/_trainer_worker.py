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
    the step without touching the weights. Beside it a trainer that offloads between steps
    (colocated runs): its gradient buffers freed after construction, each step, a checkpoint save
    and a load; its losses, weights, Adam state and checkpoint against the plain trainer's; which
    optimizer tensors may leave the device (FP32 with and without the distributed optimizer,
    bf16).
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
             max_tokens=24, precision="fp32", distributed_optimizer=True, offload=False,
             **overrides) -> TrainerSettings:
    return TrainerSettings(
        model_name=model_name, model_size="tiny", layout=layout, precision=precision,
        loss=LossSettings(kind=kind, aggregation="prompt", logprob_chunk_size=8),
        optimizer=OptimizerSettings(lr=lr, lr_warmup_steps=0, clip_grad=1.0,
                                    use_distributed_optimizer=distributed_optimizer),
        micro_batch_max_tokens=max_tokens, seed=1234, offload_between_steps=offload,
        config_overrides=overrides)


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
                       "dp_size": trainer.groups.dp_size, "mismatch": metrics.mismatch}
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


def grad_buffer_bytes(trainer: RLTrainer) -> int:
    """Bytes the rank's gradient buffers hold now (0 while offloaded)."""
    return sum(b.grad_data.untyped_storage().nbytes()
               for b in trainer.model.buffers + trainer.model.expert_parallel_buffers)


def global_max(value: float) -> float:
    """The largest of every rank's `value`."""
    tensor = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor)


def max_param_diff(a: RLTrainer, b: RLTrainer) -> float:
    pa, pb = full_params(a), full_params(b)
    assert pa.keys() == pb.keys()
    return global_max(max(float((pa[k] - pb[k]).abs().max()) for k in pa))


def adam_state(trainer: RLTrainer) -> list[torch.Tensor]:
    from megatron_rl.trainer.optimizer import offload_targets

    return [state[key] for state, key in
            offload_targets(trainer.optimizer, [trainer.model]).state_slots]


def checkpoint_diff(first: str, second: str) -> dict:
    """Every tensor of two dist checkpoints (model and optimizer), read back whole."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    def flat(tree, prefix=""):  # {path: leaf}
        if isinstance(tree, (dict, list, tuple)):
            items = tree.items() if isinstance(tree, dict) else enumerate(tree)
            return {k: v for key, sub in items for k, v in flat(sub, f"{prefix}/{key}").items()}
        return {prefix: tree}

    a, b = flat(load_plain_tensors(first)), flat(load_plain_tensors(second))
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    return {"num_tensors": len(tensors), "same_keys": sorted(a) == sorted(b),
            "optimizer_tensors": sum("optimizer" in k for k in tensors),
            "other_leaves_equal": all(a[k] == b[k] for k in a if k not in tensors),
            "max_abs_diff": max(float((a[k].double() - b[k].double()).abs().max())
                                for k in tensors)}


def offload_step_checks(trainer: RLTrainer, offloading: RLTrainer, batch: TrainBatch,
                        ckpt_root: str) -> tuple[list[float], dict]:
    """Three steps of both trainers from the same initial weights (the offloading one saves
    and loads a checkpoint while offloaded between steps 2 and 3) -> (the plain trainer's
    losses, measurements)."""
    out = {"initial_param_diff": max_param_diff(trainer, offloading),
           "plain_grad_bytes": grad_buffer_bytes(trainer),
           "grad_bytes_after_init": grad_buffer_bytes(offloading), "steps": []}
    losses = []
    for _ in range(2):
        plain, offloaded = trainer.train_step(batch), offloading.train_step(batch)
        losses.append(plain.loss)
        out["steps"].append({"loss": [plain.loss, offloaded.loss],
                             "grad_norm": [plain.grad_norm, offloaded.grad_norm],
                             "offloaded_bytes": [plain.offloaded_bytes,
                                                 offloaded.offloaded_bytes],
                             "grad_bytes_after": grad_buffer_bytes(offloading)})
    out["param_diff"] = max_param_diff(trainer, offloading)
    state_a, state_b = adam_state(trainer), adam_state(offloading)
    out["adam_tensors"] = len(state_a)
    out["adam_diff"] = global_max(max(float((x - y).abs().max())
                                      for x, y in zip(state_a, state_b, strict=True)))
    plain_dir = os.path.join(ckpt_root, "plain_step2")
    offloaded_dir = os.path.join(ckpt_root, "offloaded_step2")
    trainer.save_checkpoint(plain_dir)
    offloading.save_checkpoint(offloaded_dir)
    out["grad_bytes_after_save"] = grad_buffer_bytes(offloading)
    out["checkpoint"] = checkpoint_diff(plain_dir, offloaded_dir)
    offloading.load_checkpoint(plain_dir)
    out["grad_bytes_after_load"] = grad_buffer_bytes(offloading)
    plain, offloaded = trainer.train_step(batch), offloading.train_step(batch)
    losses.append(plain.loss)
    out["step3_loss"] = [plain.loss, offloaded.loss]
    out["step3_param_diff"] = max_param_diff(trainer, offloading)
    return losses, out


def offload_target_checks(trainer: RLTrainer, layout: ParallelLayout) -> dict:
    """Which optimizer tensors `offload_targets` would move: FP32 parameters are their own
    main copy (views of them under the distributed optimizer), bf16 ones have an FP32 copy."""
    from megatron_rl.trainer.optimizer import offload_targets

    def describe(t: RLTrainer) -> dict:
        targets = offload_targets(t.optimizer, [t.model])
        return {"num_main_params": len(targets.main_params),
                "main_param_numel": sum(p.numel() for p in targets.main_params),
                "main_dtypes": sorted({str(p.dtype) for p in targets.main_params}),
                "state_bytes": targets.num_bytes - sum(p.numel() * p.element_size()
                                                       for p in targets.main_params),
                "num_params": sum(1 for _ in t.model.parameters()),
                "param_numel": sum(p.numel() for p in t.model.parameters())}

    out = {"fp32_distributed": describe(trainer)}
    out["fp32_ddp"] = describe(build(layout, distributed_optimizer=False))
    out["bf16_distributed"] = describe(build(layout, precision="bf16"))
    return out


def scenario_training(out: dict, ckpt_root: str) -> None:
    batch = make_batch(vocab_size=96, seed=2)
    layout = ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True)
    trainer = build(layout, kind="grpo", lr=3e-3)
    offloading = build(layout, kind="grpo", lr=3e-3, offload=True)
    losses, out["offload"] = offload_step_checks(trainer, offloading, batch, ckpt_root)
    del offloading
    out["losses"] = losses + [trainer.train_step(batch).loss for _ in range(3)]
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
    out["offload"]["targets"] = offload_target_checks(trainer, layout)


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
