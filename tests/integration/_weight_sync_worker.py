"""Trainer side of the weight-sync integration tests: one torchrun launch (2 ranks) per model.

Usage: torchrun --nproc-per-node 2 _weight_sync_worker.py MODEL_DIR GENERATOR_URL OUT_JSON LAYOUT
LAYOUT: "tp2" (dense) or "tp2_ep2" (MoE: TP2 + SP for dense parts, EP2 x ETP1 for experts).

Rank 0 writes the measured values to OUT_JSON; the pytest side asserts on them.
Steps: trainer FP32 log-probs of fixed sequences vs the generator's before any sync (stale) and
after sync 1; greedy completions vs transformers on the synced weights; the trainer's
logp_mismatch metric on generator-sampled completions, at T = 1 and at T = 0.7 (the trainer's head
scoring logits / T, per token and through the step); a train step changes the weights and sync 2
makes the generator follow; a sync to a dead server fails on every rank without touching the
trainer; a sync after that works again.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _hf_families import family_for  # noqa: E402
from _workers import ENGINE_KEY_ENV  # noqa: E402

from megatron_rl.rollout import SamplingParams, SGLangGenerator, logprob_mismatch  # noqa: E402
from megatron_rl.rollout.sglang_server import free_port  # noqa: E402
from megatron_rl.trainer import (LossSettings, OptimizerSettings, ParallelLayout,  # noqa: E402
                                 RLTrainer, TrainBatch, TrainerSettings, pack_micro_batches)

LAYOUTS = {
    "tp2": ParallelLayout(tensor_model_parallel_size=2),
    "tp2_ep2": ParallelLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                              expert_tensor_parallel_size=1, sequence_parallel=True),
}
SEQUENCES = [[5, 17, 42, 99, 7, 250, 3, 64, 128, 11], [200, 4, 4, 31, 77, 150, 9, 18],
             [2, 300, 45, 61, 19, 88, 101, 7, 7, 250, 13, 6]]
PROMPTS = [[5, 17, 42, 99], [200, 4, 31], [2, 300, 45, 61, 19]]
TEMPERATURE = 0.7  # a sampling temperature != 1: SGLang records log softmax(logits / T)


def trainer_logprobs(trainer: RLTrainer, sequences,
                     temperature: float = 1.0) -> list[torch.Tensor]:
    """The trainer's own FP32 log pi(seq[t] | seq[:t]), t >= 1, through its RL loss head;
    pi = softmax(logits / temperature)."""
    from megatron_rl.trainer.step import _fp32_logprob_head

    n = len(sequences)
    batch = TrainBatch(
        token_ids=[torch.tensor(s) for s in sequences],
        loss_mask=[torch.tensor([0.0] + [1.0] * (len(s) - 1)) for s in sequences],
        old_logprobs=[torch.zeros(len(s)) for s in sequences],
        advantages=torch.zeros(n), prompt_ids=torch.arange(n), sample_ids=torch.arange(n))
    head = functools.partial(_fp32_logprob_head, groups=trainer.groups,
                             settings=trainer.settings.loss, temperature=temperature)
    out = [None] * n
    trainer.model.eval()
    with torch.no_grad():
        for i in range(n):  # one sequence per micro-batch: rows map back trivially
            (mb,) = pack_micro_batches(batch, [i], max_tokens=10**6,
                                       pad_to_multiple=trainer.pad_to_multiple)
            logp = trainer.model(mb.input_ids, mb.position_ids, None,
                                 padding_mask=mb.padding_mask, output_processor=head,
                                 output_processor_context=mb)
            out[i] = logp.float().clone()  # [len - 1]
    return out


def transformers_greedy(model_dir: str, state: dict, prompts, max_new_tokens: int):
    """transformers' greedy completions with `state` (HF on-disk names, loaded through
    from_pretrained so that transformers applies its own expert fusing)."""
    import shutil
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        shutil.copy(os.path.join(model_dir, "config.json"), directory)
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(directory, "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def sampled_batch(results) -> TrainBatch:
    """A TrainBatch whose old log-probs are the generator's (prompts are 2 samples each)."""
    ids, masks, old = [], [], []
    for r in results:
        prompt, completion = list(r.prompt_token_ids), list(r.token_ids)
        ids.append(torch.tensor(prompt + completion))
        masks.append(torch.tensor([0.0] * len(prompt) + [1.0] * len(completion)))
        old.append(torch.tensor([0.0] * len(prompt) + list(r.logprobs)))
    n = len(results)
    advantages = torch.tensor([1.0 if r.sample_index == 0 else -1.0 for r in results])
    return TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old, advantages=advantages,
                      prompt_ids=torch.tensor([r.prompt_index for r in results]),
                      sample_ids=torch.arange(n))


def train_on_generator_samples(trainer, generator, rank: int, prompts) -> dict:
    """One RL step on generator samples of `prompts` (rank 0 samples, every rank trains on the
    same batch) -> the step's log-prob mismatch and whether it was skipped."""
    from megatron_rl.rollout import GenerationResult

    payload = None
    if rank == 0:
        sampled = generator.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0,
                                                             num_samples=2, seed=3))
        payload = [(list(r.prompt_token_ids), list(r.token_ids), list(r.logprobs),
                    r.prompt_index, r.sample_index) for r in sampled]
    shared = [payload]
    torch.distributed.broadcast_object_list(shared, src=0)
    sampled = [GenerationResult(prompt_index=p, sample_index=k, prompt_token_ids=tuple(pr),
                                token_ids=tuple(c), logprobs=tuple(lp), versions=(1,) * len(c),
                                finish_reason="length") for pr, c, lp, p, k in shared[0]]
    metrics = trainer.train_step(sampled_batch(sampled))
    return {"step_logp_mismatch": metrics.logp_mismatch, "step_skipped": metrics.skipped}


def max_abs_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def as_payload(results) -> list:
    return [(list(r.prompt_token_ids), list(r.token_ids), list(r.logprobs), r.prompt_index,
             r.sample_index) for r in results]


def from_payload(payload) -> list:
    from megatron_rl.rollout import GenerationResult

    return [GenerationResult(prompt_index=p, sample_index=k, prompt_token_ids=tuple(pr),
                             token_ids=tuple(c), logprobs=tuple(lp), versions=(1,) * len(c),
                             finish_reason="length") for pr, c, lp, p, k in payload]


def completion_logprobs(trainer: RLTrainer, sampled, temperature: float) -> torch.Tensor:
    """The trainer's per-token log-probs of the sampled completion tokens, concatenated."""
    sequences = [list(r.prompt_token_ids) + list(r.token_ids) for r in sampled]
    per_token = trainer_logprobs(trainer, sequences, temperature)
    return torch.cat([lp[len(r.prompt_token_ids) - 1:] for lp, r in zip(per_token, sampled)])


def tempered_check(trainer: RLTrainer, sampled) -> dict:
    """Completions sampled at TEMPERATURE: the trainer's head at the same T reproduces the
    generator's log-probs per token and in the step's mismatch metric (forward only, weights
    untouched); at T = 1 (the old behaviour) it does not."""
    from megatron_rl.algorithms import AggregationDenominators
    from megatron_rl.trainer.step import run_forward_backward

    gen = torch.tensor([x for r in sampled for x in r.logprobs])
    tempered = completion_logprobs(trainer, sampled, TEMPERATURE)
    batch = sampled_batch(sampled)
    denominators = AggregationDenominators.from_sample_token_counts(
        batch.sample_num_loss_tokens(), batch.prompt_of_sample())
    step = run_forward_backward(trainer.model, trainer.micro_batches(batch), trainer.groups,
                                denominators, trainer.settings.loss, temperature=TEMPERATURE,
                                forward_only=True)
    return {"max_diff": float((tempered - gen).abs().max()),
            "independent_mismatch": logprob_mismatch(tempered, gen),
            "step_logp_mismatch": step.abs_logp_diff_sum / step.num_loss_tokens,
            "step_logp_mismatch_max": step.abs_logp_diff_max,
            "untempered_max_diff": float((completion_logprobs(trainer, sampled, 1.0) - gen)
                                         .abs().max())}


def make_trainer(family, layout: ParallelLayout | None = None, *, model_name: str = "test",
                 precision: str = "fp32", lr: float = 3e-2, **settings) -> RLTrainer:
    """The tiny trainer the sync workers check against: CISPO with prompt aggregation, 64-token
    log-prob chunks, no warm-up or clipping, seed 7; `settings` go to TrainerSettings."""
    return RLTrainer(TrainerSettings(
        model_name=model_name, model_size="tiny", layout=layout or ParallelLayout(),
        precision=precision,
        loss=LossSettings(kind="cispo", aggregation="prompt", logprob_chunk_size=64),
        optimizer=OptimizerSettings(lr=lr, lr_warmup_steps=0, clip_grad=0.0),
        micro_batch_max_tokens=4096, seed=7, **settings), family=family)


def main() -> None:
    from megatron_rl.weight_sync import WeightSync, WeightSyncError, WeightSyncSettings

    model_dir, url, out_path, layout = sys.argv[1:5]
    family = family_for(model_dir)
    trainer = make_trainer(family, LAYOUTS[layout])
    rank = torch.distributed.get_rank()
    generator = SGLangGenerator(url, request_timeout_s=120, max_retries=2,
                                api_key=os.environ.get(ENGINE_KEY_ENV))
    result: dict = {"layout": layout}

    # Small buckets (16 KiB): a sync takes many buckets, including tensors larger than one.
    settings = WeightSyncSettings(bucket_bytes=16 * 2**10, timeout_s=120)
    sync = WeightSync(trainer.model, family.weight_groups(), [generator], settings,
                      hf_vocab_size=family.hf_config.vocab_size)

    train_logp = trainer_logprobs(trainer, SEQUENCES)
    if rank == 0:
        stale = generator.score(SEQUENCES)
        result["stale_max_diff"] = max_abs_diff(train_logp, stale)

    report = sync.sync()
    result["sync1"] = {"version": report.version, "num_bytes": report.num_bytes,
                       "cache_flushed": report.cache_flushed,
                       "num_buckets": report.num_buckets, "num_tensors": report.num_tensors}
    hf_state = sync.hf_state_dict()
    if rank == 0:
        result["generator_version_1"] = generator.weight_version
        result["server_version_1"] = generator.server_weight_version()
        gen_logp = generator.score(SEQUENCES)
        result["synced_max_diff"] = max_abs_diff(train_logp, gen_logp)
        greedy = generator.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                            ignore_eos=True, purpose="eval"))
        result["greedy_generator"] = [list(g.token_ids) for g in greedy]
        result["greedy_versions"] = [list(g.versions) for g in greedy]
        result["greedy_transformers"] = transformers_greedy(model_dir, hf_state, PROMPTS, 8)
        sampled = generator.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0,
                                                             num_samples=2, seed=3))
        tempered = generator.generate(PROMPTS, SamplingParams(
            max_new_tokens=6, temperature=TEMPERATURE, num_samples=2, seed=5))
        shared = [as_payload(sampled), as_payload(tempered)]
    else:
        shared = [None, None]
    torch.distributed.broadcast_object_list(shared, src=0)
    sampled, tempered = from_payload(shared[0]), from_payload(shared[1])
    # Before the step below moves the trainer away from the generator's (sync 1) weights.
    result["tempered"] = tempered_check(trainer, tempered)
    batch = sampled_batch(sampled)
    # The mismatch metric, independently: trainer per-token log-probs of the sampled tokens.
    train_sampled = completion_logprobs(trainer, sampled, 1.0)
    gen_sampled = torch.tensor([x for r in sampled for x in r.logprobs])
    result["independent_mismatch"] = logprob_mismatch(train_sampled, gen_sampled)
    metrics = trainer.train_step(batch)  # changes the weights (lr 3e-2)
    result["step_logp_mismatch"] = metrics.logp_mismatch
    result["step_skipped"] = metrics.skipped

    train_logp_2 = trainer_logprobs(trainer, SEQUENCES)
    result["trainer_moved"] = max_abs_diff(train_logp, train_logp_2)
    if rank == 0:
        result["before_sync2_max_diff"] = max_abs_diff(train_logp_2, generator.score(SEQUENCES))
    report = sync.sync()
    result["sync2_version"] = report.version
    if rank == 0:
        result["synced2_max_diff"] = max_abs_diff(train_logp_2, generator.score(SEQUENCES))
        result["generator_version_2"] = generator.weight_version
        result["server_version_2"] = generator.server_weight_version()

    # A dead server: nothing listens on this port.
    dead = SGLangGenerator(f"http://127.0.0.1:{free_port()}", request_timeout_s=10,
                           max_retries=1, backoff_s=0.1)
    dead_sync = WeightSync(trainer.model, family.weight_groups(), [dead], settings,
                           hf_vocab_size=family.hf_config.vocab_size)
    try:
        dead_sync.sync()
        result["dead_error"] = None
    except WeightSyncError as exc:
        result["dead_error"] = str(exc)
    result["dead_sync_version"] = dead_sync.version
    train_logp_3 = trainer_logprobs(trainer, SEQUENCES)
    result["trainer_changed_by_dead_sync"] = max_abs_diff(train_logp_2, train_logp_3)
    report = sync.sync()
    result["sync3_version"] = report.version
    if rank == 0:
        result["synced3_max_diff"] = max_abs_diff(train_logp_3, generator.score(SEQUENCES))

    if layout == "tp2":
        # The fallback transports against the same live server: colocated tensors (shared
        # memory) and an HF folder on disk. Each follows a train step that moves the weights.
        result["transports"] = {}
        previous = train_logp_3
        for transport in ("tensor", "disk"):
            trainer.train_step(batch)
            moved = trainer_logprobs(trainer, SEQUENCES)
            fallback = WeightSync(trainer.model, family.weight_groups(), [generator],
                                  dataclasses.replace(
                                      settings, transport=transport,
                                      disk_dir=os.path.join(os.path.dirname(out_path), "hf"),
                                      hf_config_dir=model_dir),
                                  hf_vocab_size=family.hf_config.vocab_size)
            report = fallback.sync()
            if rank == 0:
                result["transports"][transport] = {
                    "trainer_moved": max_abs_diff(previous, moved),
                    "synced_max_diff": max_abs_diff(moved, generator.score(SEQUENCES)),
                    "version": report.version,
                    "server_version": generator.server_weight_version(),
                    "num_buckets": report.num_buckets}
            fallback.close()
            previous = moved
    finish(rank, result, out_path, sync)


def finish(rank: int, result: dict, out_path: str, sync) -> None:
    """The end of a sync worker: rank 0 writes the result, then every rank closes its weight
    sync and leaves the process group."""
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.barrier()
    sync.close()
    from megatron_rl.platform import destroy_distributed

    destroy_distributed()

if __name__ == "__main__":
    main()
