"""Trainer side of the Llama-4 SGLang integration test: one torchrun launch (2 ranks).

Usage: torchrun --nproc-per-node 2 _llama4_sync_worker.py MODEL_DIR GENERATOR_URL OUT_JSON

The trainer is the llama4 family's Megatron model of MODEL_DIR's text config, bf16 (Float16Module,
bf16 parameters, FP32 log-prob head), at TP2 + SP for attention and the shared expert and EP2 x
ETP1 for the 4 routed experts. Rank 0 writes the measured values to OUT_JSON; the pytest side
asserts on them. Steps: trainer log-probs of fixed sequences vs the generator's before any sync
(stale) and after sync 1, both against transformers run in FP32 on the synced bf16 weights;
greedy completions vs transformers' on the same weights (and the logit margins that make that
comparison meaningful); a train step changes the weights and sync 2 makes the generator follow,
both sides again against transformers in FP32 on the weights sync 2 sent.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _hf_families import family_for  # noqa: E402
from _weight_sync_worker import (finish, make_trainer, max_abs_diff,  # noqa: E402
                                 trainer_logprobs, train_on_generator_samples)

from megatron_rl.rollout import (SamplingParams, SGLangGenerator,  # noqa: E402
                                 wait_for_health)
from megatron_rl.trainer import ParallelLayout, RLTrainer  # noqa: E402

LAYOUT = ParallelLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                        expert_tensor_parallel_size=1, sequence_parallel=True)
# Longer than the 8-token attention chunk (up to 3 chunks) and than floor_scale 4, so chunked
# attention and NoPE temperature tuning both act.
SEQUENCES = [[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39],
             [200, 4, 4, 31, 77, 150, 9, 18],
             [2, 200, 45, 61, 19, 88, 101, 7, 7, 250, 13, 6]]
# Greedy decoding crosses chunk boundaries (positions 8 and 16) during decode.
PROMPTS = [[5, 17, 42, 99, 7], [200, 4, 31], [2, 200, 45, 61, 19, 88, 101, 7, 9]]
MAX_NEW_TOKENS = 12


def transformers_model(family, state: dict[str, torch.Tensor]):
    """transformers' Llama4ForCausalLM holding `state` (the synced HF tensors, bf16), computing
    in FP32: the bf16 weights' exact function, up to FP32 rounding."""
    from transformers import Llama4ForCausalLM

    config = family.hf_config
    config._attn_implementation = "eager"
    model = Llama4ForCausalLM(config).eval()
    model.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=True)
    return model


@torch.no_grad()
def transformers_logprobs(model, sequences) -> list[torch.Tensor]:
    out = []
    for seq in sequences:
        logits = model(torch.tensor([seq])).logits[0, :-1].float()  # [len - 1, vocab]
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0])
    return out


@torch.no_grad()
def teacher_forced_steps(model, prompt: list[int], completion: list[int]) -> dict:
    """transformers' logits at every completion position given the same prefix: how far each
    chosen token is from transformers' top logit (0 when it is the argmax), and the top-1 /
    top-2 gap (how close each step is to a tie)."""
    logits = model(torch.tensor([prompt + completion])).logits[0].float()
    steps = logits[len(prompt) - 1:-1]  # [len(completion), vocab]: row t predicts completion[t]
    top2 = steps.topk(2, dim=-1).values
    chosen = steps.gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return {"chosen_gap": (top2[:, 0] - chosen).tolist(),
            "margin": (top2[:, 0] - top2[:, 1]).tolist()}


@torch.no_grad()
def transformers_greedy(model, prompts, max_new_tokens: int) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def change_weights_by_a_train_step(trainer: RLTrainer, generator, rank: int) -> dict:
    return train_on_generator_samples(trainer, generator, rank, PROMPTS)


def main() -> None:
    from megatron_rl.weight_sync import WeightSync, WeightSyncSettings

    model_dir, url, out_path = sys.argv[1:4]
    family = family_for(model_dir)
    trainer = make_trainer(
        family, LAYOUT, model_name="llama4", precision="bf16",
        # Random init of the full weights, then sliced: on CPU, Megatron's per-TP-rank init
        # gives every TP rank the same shard (duplicated vocab rows tie the greedy argmax).
        config_overrides={"use_cpu_initialization": True})
    rank = torch.distributed.get_rank()
    generator = SGLangGenerator(url, request_timeout_s=120, max_retries=2)
    result: dict = {}

    train_logp = trainer_logprobs(trainer, SEQUENCES)
    if rank == 0:
        # The server starts while this launch builds the trainer (the pytest side watches it).
        wait_for_health(url, timeout_s=240)
        result["stale_max_diff"] = max_abs_diff(train_logp, generator.score(SEQUENCES))

    # Small buckets (64 KiB): a sync takes several buckets, including tensors larger than one.
    sync = WeightSync(trainer.model, family.weight_groups(), [generator],
                      WeightSyncSettings(dtype=torch.bfloat16, bucket_bytes=64 * 2**10,
                                         timeout_s=120),
                      hf_vocab_size=family.hf_config.vocab_size)
    report = sync.sync()
    result["sync1"] = {"version": report.version, "num_buckets": report.num_buckets,
                       "num_tensors": report.num_tensors, "num_bytes": report.num_bytes}
    hf_state = sync.hf_state_dict()  # collective: {HF name: bf16 tensor} on rank 0
    if rank == 0:
        result["hf_dtypes"] = sorted({str(t.dtype) for t in hf_state.values()})
        result["generator_version_1"] = generator.weight_version
        result["server_version_1"] = generator.server_weight_version()
        gen_logp = generator.score(SEQUENCES)
        reference = transformers_model(family, hf_state)
        hf_logp = transformers_logprobs(reference, SEQUENCES)
        result["synced_max_diff"] = max_abs_diff(train_logp, gen_logp)
        result["generator_vs_transformers"] = max_abs_diff(gen_logp, hf_logp)
        result["trainer_vs_transformers"] = max_abs_diff(train_logp, hf_logp)

        greedy = generator.generate(PROMPTS, SamplingParams(
            max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, purpose="eval"))
        result["greedy_generator"] = [list(g.token_ids) for g in greedy]
        result["greedy_versions"] = [list(g.versions) for g in greedy]
        result["greedy_transformers"] = transformers_greedy(reference, PROMPTS, MAX_NEW_TOKENS)
        result["generator_steps"] = [teacher_forced_steps(reference, p, g)
                                     for p, g in zip(PROMPTS, result["greedy_generator"])]
        result["transformers_steps"] = [teacher_forced_steps(reference, p, g)
                                        for p, g in zip(PROMPTS, result["greedy_transformers"])]

    result.update(change_weights_by_a_train_step(trainer, generator, rank))
    train_logp_2 = trainer_logprobs(trainer, SEQUENCES)
    result["trainer_moved"] = max_abs_diff(train_logp, train_logp_2)
    if rank == 0:
        result["before_sync2_max_diff"] = max_abs_diff(train_logp_2, generator.score(SEQUENCES))
    report = sync.sync()
    result["sync2_version"] = report.version
    if rank == 0:
        gen_logp_2 = generator.score(SEQUENCES)
        result["synced2_max_diff"] = max_abs_diff(train_logp_2, gen_logp_2)
        result["generator_version_2"] = generator.weight_version
        result["server_version_2"] = generator.server_weight_version()
    # The FP32 function of the weights sync 2 sent: tells a sync fault (the generator strays
    # from it) from a bf16 near-tie in the top-1 router that flips one side's expert choice.
    hf_state_2 = sync.hf_state_dict()
    if rank == 0:
        hf_logp_2 = transformers_logprobs(transformers_model(family, hf_state_2), SEQUENCES)
        result["generator_vs_transformers_2"] = max_abs_diff(gen_logp_2, hf_logp_2)
        result["trainer_vs_transformers_2"] = max_abs_diff(train_logp_2, hf_logp_2)
    finish(rank, result, out_path, sync)


if __name__ == "__main__":
    main()
