"""Body of the context-parallel tests (tests/dist/test_context_parallel.py): one torchrun launch on
2 gloo ranks. Rank 0 writes the measured values as JSON to OUT_DIR/result.json; the pytest side
asserts on them, so a failure shows the numbers.

1. attention: SDPACoreAttention at CP 2 (each rank its load-balanced slice of q/k/v) against the
   same module at CP 1 on the whole sequence: outputs and q/k/v gradients per slice; also with
   Llama-4's chunked local mask (`attention_chunk_size`) against an explicit chunk-causal mask.
2. split: `split_for_context_parallel` on every rank against megatron-core's own
   `get_batch_on_this_cp_rank` over the real CP group.
3. rl_step, per family (llama dense, qwen3_moe, llama4 with chunked + NoPE layers): one RL step
   of the same batch (uneven completion lengths, 2 micro-batches) at CP 1 (DP 2) and at CP 2
   (DP 1) from the same initial weights: loss, grad norm, token counts, updated parameters;
   at TP 2 + SP with CP 2 (4 ranks) loss and grad norm, and for llama4 a checkpoint saved there
   and loaded at CP 1 (DP 4), whose parameters must be CP 1's updated ones.
4. gspo_step (llama): the same CP 1 / CP 2 comparison with the GSPO loss, whose sequence ratio
   needs every slice of a completion (issue 29.5).
5. mismatch_step (llama): the same with DAPO and all three train / rollout mismatch corrections
   (TIS, the sequence mask on each completion's whole geometric-mean ratio, the token mask);
   every step also records its mismatch metrics (reduced over the ranks' sums and histograms).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _trainer_worker import full_params, make_batch, write_result  # noqa: E402

from megatron_rl.algorithms import MismatchCorrection  # noqa: E402
from megatron_rl.trainer import (LossSettings, OptimizerSettings, ParallelLayout,  # noqa: E402
                                 RLTrainer, TrainerSettings)

CP1, CP2 = ParallelLayout(), ParallelLayout(context_parallel_size=2)
# The tiny models score the batch's random tokens near log(1/256) and its generator log-probs
# are drawn in [-4.5, -0.5] (make_batch): log r lies in about [-5, -1], so windows from
# e^-3 keep about half of the tokens and of the completions; TIS weighs each by r.
MISMATCH = MismatchCorrection(tis_cap=2.0, sequence_window=(0.0498, 2.0),
                              token_window=(0.0498, 2.0))
TP2_SP_CP2 = ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True,
                            context_parallel_size=2)


def _attention_config(cp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                             num_query_groups=2, kv_channels=16, attention_dropout=0.0,
                             params_dtype=torch.float32, use_cpu_initialization=True,
                             context_parallel_size=cp)


def _attention(cp: int):
    from megatron.core.transformer.enums import AttnMaskType

    from models.sdpa_attention import SDPACoreAttention

    return SDPACoreAttention(_attention_config(cp), 2, AttnMaskType.causal, "self")


def _run(module, inputs, grad_out, mask=None, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = module(*leaves, mask, **kwargs)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in leaves]


def check_attention(out: dict) -> None:
    """CP 2 slices vs CP 1 on the full sequence (max abs differences)."""
    from megatron_rl.platform import init_distributed
    from megatron_rl.ops.context_parallel import load_balanced_positions

    init_distributed(context_parallel_size=2)
    from megatron.core import parallel_state as ps

    rank, seq = ps.get_context_parallel_rank(), 24
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(seq, 3, n, 16, generator=gen) for n in (8, 2, 2)]  # q, k, v
    grad_out = torch.randn(seq, 3, 8 * 16, generator=gen)
    keep = load_balanced_positions(seq, rank, 2)
    full, local = _attention(1), _attention(2)
    chunk = 5  # not a divisor of the chunk pieces: chunks straddle the load-balanced cut
    positions = torch.arange(seq)
    chunk_mask = (positions[None, :] > positions[:, None]) | \
        (positions[None, :] // chunk != positions[:, None] // chunk)  # True = masked
    results = {}
    for name, mask, kwargs in (("causal", None, {}),
                               ("chunked", chunk_mask, {"attention_chunk_size": chunk})):
        expected, expected_grads = _run(full, inputs, grad_out, mask)
        got, grads = _run(local, [x[keep] for x in inputs], grad_out[keep], **kwargs)
        results[name] = {
            "out_max_abs_diff": float((got - expected[keep]).abs().max()),
            "grad_max_abs_diff": [float((g - e[keep]).abs().max())
                                  for g, e in zip(grads, expected_grads)],
            "local_shape": list(got.shape)}
    # Not vacuous: the chunk mask changes the answer.
    causal, _ = _run(full, inputs, grad_out)
    chunked, _ = _run(full, inputs, grad_out, chunk_mask)
    results["chunk_mask_effect"] = float((causal - chunked).abs().max())
    out["attention"] = results


def check_split(out: dict) -> None:
    """Our split of real packed micro-batches == megatron-core's get_batch_on_this_cp_rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_rl.trainer.batch import (pack_micro_batches, padding_micro_batch,
                                           split_for_context_parallel)

    batch = make_batch(vocab_size=96)
    micro_batches = pack_micro_batches(batch, range(batch.num_samples), max_tokens=24,
                                       pad_to_multiple=4) + [padding_micro_batch(4)]
    mismatches, shapes = [], []
    for m in micro_batches:
        ours = split_for_context_parallel(m, ps.get_context_parallel_rank(), 2)
        fields = {k: getattr(m, k).clone() for k in ("input_ids", "position_ids", "targets",
                                                      "loss_mask", "old_logprobs", "advantages",
                                                      "sample_index", "prompt_index",
                                                      "padding_mask")}
        theirs = get_batch_on_this_cp_rank({"cu_seqlens": None, **fields}, is_hybrid_cp=False,
                                           cp_group=ps.get_context_parallel_group())
        mismatches += [k for k in fields if not torch.equal(getattr(ours, k), theirs[k])]
        shapes.append([list(m.input_ids.shape), list(ours.input_ids.shape)])
    out["split"] = {"mismatched_fields": mismatches, "shapes": shapes}


def _settings(layout: ParallelLayout, model_name: str, num_layers: int,
              kind: str = "cispo", mismatch: MismatchCorrection | None = None
              ) -> TrainerSettings:
    return TrainerSettings(
        model_name=model_name, model_size="tiny", layout=layout, precision="fp32",
        loss=LossSettings(kind=kind, aggregation="prompt", logprob_chunk_size=8,
                          mismatch=mismatch or MismatchCorrection()),
        optimizer=OptimizerSettings(lr=1e-3, lr_warmup_steps=0, clip_grad=1.0),
        micro_batch_max_tokens=32, seed=1234, config_overrides={"num_layers": num_layers})


def check_rl_step(out: dict, model_name: str, num_layers: int,
                  checkpoint_dir: str | None = None, kind: str = "cispo",
                  mismatch: MismatchCorrection | None = None) -> None:
    from megatron_rl.trainer.model import unwrap

    batch = make_batch(vocab_size=256, seed=3)
    result = {"true_num_tokens": sum(ids.numel() - 1 for ids in batch.token_ids)}
    for name, layout in (("cp1", CP1), ("cp2", CP2)):
        trainer = RLTrainer(_settings(layout, model_name, num_layers, kind, mismatch))
        if name == "cp1":
            initial = full_params(trainer)
        else:
            # Same start: CPU initialisation draws every weight from one seeded RNG; the copy
            # makes the comparison independent of that (fp32 params are the optimizer's).
            start_diff = max(float((p - initial[k]).abs().max())
                             for k, p in full_params(trainer).items())
            state = unwrap(trainer.model).state_dict()
            with torch.no_grad():
                for key, value in initial.items():
                    state[key].copy_(value)
            result["start_max_abs_diff"] = start_diff
        metrics = trainer.train_step(batch)
        after = full_params(trainer)
        result[name] = {"loss": metrics.loss, "grad_norm": metrics.grad_norm,
                        "num_loss_tokens": metrics.num_loss_tokens,
                        "num_tokens": metrics.num_tokens,
                        "num_micro_batches": metrics.num_micro_batches,
                        "local_seq_lens": [m.input_ids.shape[1]
                                           for m in trainer.micro_batches(batch)],
                        "dp_size": trainer.groups.dp_size, "cp_size": trainer.groups.cp_size,
                        "mismatch": metrics.mismatch,
                        "max_abs_update": max(float((after[k] - initial[k]).abs().max())
                                              for k in initial)}
        if name == "cp1":
            reference = after
        else:
            result["param_max_abs_diff"] = max(float((after[k] - reference[k]).abs().max())
                                               for k in reference)
    if mismatch is not None:
        out.setdefault("mismatch_step", {})[model_name] = result
        return
    if kind != "cispo":
        out.setdefault(f"{kind}_step", {})[model_name] = result
        return
    if torch.distributed.get_world_size() == 4:
        # TP2 + SP with CP2 (DP1): sequences padded to 2 * CP * TP; loss and grad norm (the
        # parameters are TP-sharded here, and a CP checkpoint to reshard them through is not
        # supported yet; TP2's update itself is covered by test_trainer_parallel).
        # Same start without a copy: CPU initialisation builds every full weight from one
        # seeded RNG and splits it over TP (trainer/model.py cpu_overrides).
        trainer = RLTrainer(_settings(TP2_SP_CP2, model_name, num_layers))
        metrics = trainer.train_step(batch)
        result["tp2_sp_cp2"] = {"loss": metrics.loss, "grad_norm": metrics.grad_norm,
                                "num_loss_tokens": metrics.num_loss_tokens,
                                "num_tokens": metrics.num_tokens,
                                "mismatch": metrics.mismatch,
                                "local_seq_lens": [m.input_ids.shape[1]
                                                   for m in trainer.micro_batches(batch)],
                                "dp_size": trainer.groups.dp_size,
                                "cp_size": trainer.groups.cp_size,
                                "tp_size": trainer.groups.tp_size}
        if checkpoint_dir is not None:
            # Saved at TP2 + SP + CP2, loaded at CP1 (DP4): the checkpoint works at CP > 1 and
            # holds CP1's updated parameters, gathered from the TP shards by the resharding load.
            trainer.save_checkpoint(checkpoint_dir)
            resumed = RLTrainer(_settings(CP1, model_name, num_layers))
            resumed.load_checkpoint(checkpoint_dir)
            loaded = full_params(resumed)
            result["tp2_sp_cp2"]["checkpoint_param_max_abs_diff"] = max(
                float((loaded[k] - reference[k]).abs().max()) for k in reference)
            result["tp2_sp_cp2"]["checkpoint_max_abs_update"] = max(
                float((loaded[k] - initial[k]).abs().max()) for k in initial)
    out.setdefault("rl_step", {})[model_name] = result


def main() -> None:
    out_dir = sys.argv[1]
    out: dict = {}
    check_attention(out)
    check_split(out)
    for model_name, num_layers in (("llama", 2), ("qwen3_moe", 2)):
        check_rl_step(out, model_name, num_layers)
    check_rl_step(out, "llama4", 4, checkpoint_dir=os.path.join(out_dir, "checkpoint"))
    check_rl_step(out, "llama", 2, kind="gspo")
    check_rl_step(out, "llama", 2, kind="dapo", mismatch=MISMATCH)
    write_result(out, out_dir)


if __name__ == "__main__":
    main()
