#!/usr/bin/env python
"""The GPU acceptance test: one GPU (H100, H200 or GB200), at most 10 minutes, fail-fast, one
JSON record per stage, the stages in an order where the first failure names its layer.

Usage: python tools/gpu_smoke.py [--output runs/gpu_smoke.jsonl] [--stages a,b,...]
       python tools/gpu_smoke.py --dry-run [--cpu]          # CPU: CI and the image build
       python tools/gpu_smoke.py --tier bare --output-dir runs/bare   # a bare GPU machine
       python tools/gpu_smoke.py --tier bare --dry-run [--cpu]        # CPU

Two tiers. `image` (the default, below) runs in the GPU image, SGLang and Transformer Engine
included: a real cluster's check. `bare` runs where only PyTorch is installed (torch 2.11 for
CUDA 13, Python 3.12, no network) plus the wheels tools/bare_wheels.py carries (megatron-core,
numpy, transformers' configs and their requirements; under 64 MiB), in under 8 minutes
(BARE_BUDGET_S): 1. bare_imports (torch, CUDA, NCCL, megatron.core; which image packages are
absent); 2. bare_trainer: RLTrainer on CUDA with NCCL, the tiny Llama-4 on the local spec in fp32
and bf16 (random weights from the seed), `score` with and without a padding micro-batch and
`train_step` on uneven lengths, the log-probs against `plain_logprobs` (the same model one
sequence at a time with a plain FP32 log-softmax head); 3. logprob_op: the FP32 chunked log-prob
op against a plain FP32 log-softmax at Scout's hidden size and vocabulary (values, input
gradients, time, peak memory against the op's documented bound); 4. device_collectives: the
trainer's NCCL group reduces / broadcasts / gathers tensors on the collective device, and
micro-batches reach the device; 5. offload: the colocated offload lowers memory_allocated by what
it reports, counted independently, and the reload restores it; 6. bare_moe_layer: one
Scout-width MoE layer (local spec) measured against the planner's per-layer figure. What the bare
tier does not cover: SGLang (generation, weight sync into an engine, the memory saver, chunked
attention in an engine), Transformer Engine (its spec, FP8, `_extra_state` in checkpoints) and
loading an HF checkpoint.

Image-tier stages (each on the project's own code paths; the model is a tiny Llama-4, written with
transformers, converted with megatron_rl.convert, served by SGLang from the layout
`models/llama4/convert.write_sglang_layout` writes):
1. imports: sgl_kernel, flashinfer, transformer_engine.pytorch and megatron.core import (a kernel
   built for another torch fails here with its undefined symbol); torch / CUDA / cuDNN / NCCL
   versions, the GPU, the NCCL and allocator environment of this process and of what
   megatron_rl.platform.environment gives trainer ranks and engines (they must agree), and
   FlashInfer's precompiled kernel wheels (tools/gpu_image.py's rule: nothing may be downloaded
   at first use).
2. trainer: `RLTrainer` itself on NCCL, the tiny Llama-4 on the Transformer Engine spec with its
   attention chunk shorter than the sequences, loaded from the converted checkpoint; `score` and
   `train_step` on uneven lengths, with a padding micro-batch (one GPU has no data-parallel peer,
   so one is appended the way `RLTrainer.micro_batches` does for a rank with fewer micro-batches;
   it must change no statistic), in fp32 on the local spec, then bf16 on TE, then FP8 (MXFP8 on
   Blackwell, delayed scaling on Hopper); per-token log-probs against transformers' fp32 forward
   of the same weights (the fp32 local-spec run anchors that reference). Micro-batch lengths must
   be multiples of the FP8 alignment.
3. sglang: an SGLang CUDA engine of the same model (Llama4ForConditionalGeneration: the loader
   that un-fuses the experts) on an attention backend that honours Llama-4's chunk (fa3 on
   Hopper, megatron_rl's default there; torch_native, patched by megatron_rl, on Blackwell and
   other GPUs, where SGLang 0.5.23 has no fast one: `tiny_attention_backend`; stages 3-4 record
   megatron_rl's refusal should it still refuse), its log-probs per position before and past the
   attention chunk against transformers' fp32 forward, and its teacher-forced log-probs against
   the trainer's token by token: as loaded, after a train step (stale), after a sync over the
   distributed transport (gloo: two NCCL ranks cannot share one GPU, and gloo carries CUDA
   tensors), and after a second train step and a sync over the in-memory transport (CUDA IPC)
   with buckets small enough to reuse buffers.
4. colocated: an engine with SGLang's memory saver beside the trainer: release -> train_step ->
   the trainer offloads (RLTrainer.offload_training_state) -> resume the weights -> sync ->
   resume the KV cache -> generate -> the trainer reloads -> train_step, with
   torch.cuda.mem_get_info at each point (the release must hand the engine's memory back, the
   sync must land). The offload must lower torch.cuda.memory_allocated by the gradient buffers,
   Adam state and FP32 main copies it reports (counted independently before it), the reload
   must raise it by as much, and the sync, scoring and the next step must work around it. The
   engine's log-probs after the release / resume cycle against the trainer's catch a q/k-norm
   weight lost at the release (the engine starts with --enable-weights-cpu-backup for that).
5. moe_layer: one MoE layer at Scout's widths (TE spec, bf16): the bytes its forward saves for the
   backward and its peak, against the planner's per-layer figure
   (megatron_rl.scaling.plan.layer_activation_bytes).
6. fp8_serving (rollout.precision=fp8, issue 40): the tiny Llama-4 served FP8 by an SGLang engine
   (block-wise e4m3, the largest block of FP8_BLOCK_SIZES the planner accepts for it; the FP8
   copy written by the run's own writer, cluster/served_checkpoint.py), a bf16 train step, the
   weight sync quantising into the engine (in-memory transport), then the per-token
   |logp_engine - logp_trainer|, printed with its bound (FP8_MISMATCH_BOUND). Skipped with one line where
   SGLang is not importable. Its configuration part (also the dry run's): SGLang's own
   Fp8Config reads the served quantization_config (weight_sync/fp8.py
   served_quantization_config); the weight sync's own quantiser and bucket plan, built as
   WeightSync builds them from the stage's settings, quantise a random bf16 copy of every tensor
   SGLang holds in FP8, each as planned and within FP8's bound, and the plan's bytes equal the
   planner's for the engine; where the tiny model's weights are written (--cpu, GPU), the run's
   FP8 copy of them holds every tensor the sync writes under its name, dtype and shape.

Each stage has a time budget (STAGE_BUDGET_S, 600 s in all) and its pass criteria (tolerances
below). Output: one JSON line per stage, written as the stage ends ({"stage", "index", "status":
ok | failed | not_run, "seconds", "result", "error", "traceback"}); after the first failure the
later stages are recorded not_run. Exit status 1 if any stage failed.

`--dry-run` (CPU) runs every stage's configuration: the models' configs, the TE layer spec
(Megatron's placeholders where TE is absent), the precision and FP8 fields, padded micro-batch
lengths, SGLang's arguments through SGLang's own parser, the weight-sync settings and bucket
counts, the planner's figure; `--cpu` also runs stage 2's RLTrainer path for real on CPU (gloo,
local spec, fp32 and bf16; FP8 is GPU only).

UNVERIFIED: no GPU was available when this was written; it follows SGLang 0.5.23's and
megatron-core 0.19.2's source. Stages 3 and 4 ran on CPU against SGLang's CPU engine (local-spec
trainer; memory figures stubbed) and stage 2 runs there in CI; on a GPU nothing has been seen yet,
in particular: SGLang's fa3 backend serving the tiny model (head_dim 32: FA3's kernels round
head sizes up to 64, flash_api round_up_headdim) and `--cuda-graph-max-bs-decode`; SGLang's
weights CPU backup across a release; Transformer Engine's chunked core attention and grouped
FP8 experts at these widths; SGLang's receiving side of a gloo weight-update group with CUDA
tensors; the memory saver's effect as mem_get_info sees it; the Scout layer's forward through
`set_input_tensor`; and every tolerance (LOGP_TOLERANCE, SYNC_TOLERANCE, MIN_RELEASED_FRACTION,
PLANNER_UNDERESTIMATE). Set them from the first real run's records.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import importlib
import importlib.metadata as md
import importlib.util
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

STAGES = ("imports", "trainer", "sglang", "colocated", "moe_layer",
          "fp8_serving")  # the image tier
# fp8_serving's 90 s came out of trainer, sglang and colocated (30 s each): 10 minutes in all.
STAGE_BUDGET_S = {"imports": 60, "trainer": 120, "sglang": 150, "colocated": 120,
                  "moe_layer": 60, "fp8_serving": 90}
TIME_LIMIT_S = sum(STAGE_BUDGET_S.values())  # 10 minutes
# The bare tier (--tier bare): a GPU machine with only its own PyTorch and what
# tools/bare_wheels.py carries (no SGLang, Transformer Engine, apex, transformers; no network).
BARE_STAGES = ("bare_imports", "bare_trainer", "logprob_op", "device_collectives", "offload",
               "bare_moe_layer")
BARE_BUDGET_S = {"bare_imports": 30, "bare_trainer": 150, "logprob_op": 60,
                 "device_collectives": 30, "offload": 60, "bare_moe_layer": 90}
BARE_TIME_LIMIT_S = sum(BARE_BUDGET_S.values())  # 7 minutes, under the 8 the tier promises
TIERS = {"image": STAGES, "bare": BARE_STAGES}
IMPORTS = ("sgl_kernel", "flashinfer", "transformer_engine.pytorch", "megatron.core")

# The tiny Llama-4 of stages 2-4: the registry's "demo" size (Scout's mechanisms; hidden 128,
# head_dim 32, 4 experts, attention chunk 48; every dimension a multiple of 16, as TE's FP8 GEMMs
# need). A registered size, because the trainer builds the Transformer Engine spec only from the
# registry (models.HFConfigFamily builds the local spec). Random weights at the size's
# initializer_range (0.02: at 0.1 the random sequences' tokens sit deep in the tails, where bf16
# activations move a log-prob by up to 2 nats, seen on CPU).
TINY_SIZE = "demo"
# The engines' attention backend on the GPU at hand: `tiny_attention_backend` (section 3).
# (prompt, completion) lengths: uneven, none a multiple of 8, all longer than one chunk.
SEQUENCE_LENGTHS = ((8, 50), (12, 61), (5, 74), (9, 45), (16, 67), (11, 56))
MICRO_BATCH_MAX_TOKENS = 160  # several micro-batches of uneven lengths
SMALL_BUCKET_BYTES = 64 * 2**10  # the in-memory sync: many buckets, so buffers are reused
MIN_BUCKETS = 3
SCOUT_MOE_TOKENS = 8192  # one micro-batch through the Scout-width MoE layer

# Pass criteria (UNVERIFIED on a GPU: see the module docstring). Per-token |logp - logp_ref|,
# (mean, max) over the loss tokens, against transformers' fp32 forward of the same weights.
LOGP_TOLERANCE = {"fp32": (2e-3, 2e-2), "bf16": (0.05, 0.5), "fp8": (0.25, 2.0)}
# Trainer (bf16) against SGLang (bf16 weights, FP32 LM head) after a sync: (mean, max).
SYNC_TOLERANCE = (0.05, 0.5)
MIN_RELEASED_FRACTION = 0.5  # of the engine's memory that a release must hand back
# The trainer's offload and reload move memory_allocated by its expected bytes to within this
# fraction, plus the allocator's rounding (512-byte blocks; 1 MiB in all).
OFFLOAD_TOLERANCE = (0.05, 2**20)
PLANNER_UNDERESTIMATE = 1.25  # measured saved bytes may exceed the planner's by this factor
# Bare tier: the trainer's packed, micro-batched, chunked-head log-probs against a plain forward
# of the same model, one sequence at a time, with a plain log-softmax head: (mean, max).
BARE_LOGP_TOLERANCE = {"fp32": (1e-3, 1e-2), "bf16": (0.05, 0.5)}
# The FP32 chunked log-prob op against a plain FP32 log-softmax: (tokens, hidden, vocab) on GPU
# (Scout's hidden and vocabulary) and on CPU; values and input gradients within these.
LOGPROB_OP_SHAPE = {"gpu": (4096, 5120, 202048), "cpu": (256, 64, 4096)}
LOGPROB_OP_CHUNK = 1024
LOGPROB_OP_TOLERANCE = {"logp_max_abs": 2e-3, "grad_max_rel": 2e-2}
# Stage 6: the block sizes tried for the demo model's FP8 layout, largest first, and the bound
# on |logp_engine - logp_trainer| (mean, max) of an FP8 engine after the quantised sync (FP8's
# weight error, a few per cent per element, against bf16's SYNC_TOLERANCE; UNVERIFIED).
FP8_BLOCK_SIZES = (128, 64, 32)
FP8_MISMATCH_BOUND = (0.25, 2.0)


class SmokeFailure(RuntimeError):
    """A stage's criterion failed; `result` holds what was measured up to it."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


class StageTimeout(RuntimeError):
    pass


def expect(condition: bool, message: str, result: dict) -> None:
    if not condition:
        raise SmokeFailure(message, result)


@dataclasses.dataclass(kw_only=True)
class Context:
    """What the stages share: the mode, a scratch directory, the tiny model's folders, and the
    bf16 trainer of stages 3-4 (built once)."""

    mode: str  # gpu | dry_run | cpu
    work: Path
    tier: str = "image"  # image | bare
    model: "TinyModel | None" = None
    trainer: object | None = None
    generators: list = dataclasses.field(default_factory=list)  # shut down at the end

    @property
    def device_type(self) -> str:
        return "cuda" if self.mode == "gpu" else "cpu"


# ----------------------------------------------------------------------------- the tiny model

@dataclasses.dataclass(kw_only=True)
class TinyModel:
    hf_config: dict  # the text config's fields (transformers Llama4TextConfig)
    text_dir: Path  # transformers' Llama4ForCausalLM (the fp32 reference reads it)
    served_dir: Path  # SGLang's Llama4ForConditionalGeneration layout
    megatron_dir: Path | None  # converted (HF -> Megatron), what the trainers load
    family: object  # models.HFConfigFamily bound to served_dir/config.json
    reference: list | None = None  # reference_logprobs(), computed once

    @property
    def sequences(self) -> list[list[int]]:
        import torch

        generator = torch.Generator().manual_seed(1)
        # Ids 3 .. vocab - 2: above the special ids, and not the last one, which SGLang 0.5.23
        # reports as id 0 among a prompt's log-probs (seen on its CPU engine).
        vocab = self.hf_config["vocab_size"]
        return [torch.randint(3, vocab - 1, (p + c,), generator=generator).tolist()
                for p, c in SEQUENCE_LENGTHS]


def tiny_hf_config() -> dict:
    from models import get_model_family

    return get_model_family("llama4").hf_config(TINY_SIZE)


def tiny_model(ctx: Context, *, weights: bool = True) -> TinyModel:
    """The tiny Llama-4, written once per run: random bf16 weights (seed 0) saved by transformers,
    re-saved in SGLang's layout and converted for the trainer. Without `weights` (dry run): the
    config files only."""
    if ctx.model is not None and (ctx.model.megatron_dir is not None or not weights):
        return ctx.model
    import torch
    from transformers import Llama4ForCausalLM

    from models import get_model_family, model_family_for_hf_config

    converter = get_model_family("llama4").converter()
    fields = tiny_hf_config()
    text = converter.hf_text_config_from_dict(fields)
    text_dir, served_dir = ctx.work / "tiny_llama4_text", ctx.work / "tiny_llama4_sglang"
    megatron_dir = None
    if weights:
        torch.manual_seed(0)
        Llama4ForCausalLM(text).to(torch.bfloat16).save_pretrained(text_dir)
        converter.write_sglang_layout(text_dir, served_dir)
        from megatron_rl.convert import convert_hf_to_megatron

        megatron_dir = ctx.work / "tiny_llama4_megatron"
        convert_hf_to_megatron(served_dir, megatron_dir, progress=False)
    else:
        from transformers import Llama4Config

        served_dir.mkdir(parents=True, exist_ok=True)
        served = Llama4Config(text_config=text.to_dict()).to_dict()
        served.update(architectures=["Llama4ForConditionalGeneration"], torch_dtype="bfloat16")
        (served_dir / "config.json").write_text(json.dumps(served))
    family = model_family_for_hf_config(json.loads((served_dir / "config.json").read_text()))
    ctx.model = TinyModel(hf_config=fields, text_dir=text_dir, served_dir=served_dir,
                          megatron_dir=megatron_dir, family=family)
    return ctx.model


def reference_logprobs(model: TinyModel) -> list:
    """transformers' fp32 (eager attention, CPU) log p(seq[t] | seq[:t]) for t >= 1: the same
    weights' function, independent of Megatron, TE and SGLang."""
    import torch
    from transformers import Llama4ForCausalLM

    if model.reference is not None:
        return model.reference
    reference = Llama4ForCausalLM.from_pretrained(model.text_dir, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for seq in model.sequences:
            logits = reference(torch.tensor([seq])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(seq[1:])[:, None])[:, 0])
    model.reference = out
    return out


def make_batch(sequences: list[list[int]], logprobs: list):
    """A TrainBatch of `sequences` (prompt / completion split by SEQUENCE_LENGTHS) whose old
    log-probs are `logprobs` ([len - 1] per sequence: position t >= 1); two samples per prompt
    with advantages +1 / -1."""
    import torch

    from megatron_rl.trainer import TrainBatch

    masks, old = [], []
    for (prompt, completion), lp in zip(SEQUENCE_LENGTHS, logprobs):
        masks.append(torch.tensor([0.0] * prompt + [1.0] * completion))
        old.append(torch.cat([torch.zeros(1), lp.float().cpu()]))
    n = len(sequences)
    return TrainBatch(token_ids=[torch.tensor(s) for s in sequences], loss_mask=masks,
                      old_logprobs=old, advantages=torch.tensor([1.0, -1.0] * (n // 2)),
                      prompt_ids=torch.arange(n) // 2, sample_ids=torch.arange(n))


def trainer_settings(*, precision: str, use_transformer_engine: bool,
                     fp8_recipe: str | None = None):
    from megatron_rl.trainer import LossSettings, OptimizerSettings, TrainerSettings

    return TrainerSettings(
        model_name="llama4", model_size=TINY_SIZE, precision=precision, fp8_recipe=fp8_recipe,
        use_transformer_engine=use_transformer_engine,
        loss=LossSettings(kind="cispo", aggregation="prompt", logprob_chunk_size=256),
        optimizer=OptimizerSettings(lr=1e-2, lr_warmup_steps=0, clip_grad=1.0),
        micro_batch_max_tokens=MICRO_BATCH_MAX_TOKENS, seed=7)


def padded_trainer_class():
    """RLTrainer that, when `extra_padding` is set, appends one padding micro-batch to its own:
    what `RLTrainer.micro_batches` gives a data-parallel rank with fewer micro-batches than its
    peers (a peer only exists with two or more GPUs)."""
    from megatron_rl.trainer import RLTrainer
    from megatron_rl.trainer.batch import padding_micro_batch

    class PaddedTrainer(RLTrainer):
        extra_padding = False

        def micro_batches(self, batch):
            micro_batches = super().micro_batches(batch)
            if self.extra_padding:
                micro_batches.append(padding_micro_batch(self.pad_to_multiple))
            return micro_batches

    return PaddedTrainer


def build_trainer(model: TinyModel, settings):
    trainer = padded_trainer_class()(settings)  # the registry's family: TE spec on GPU
    trainer.load_model_weights(str(model.megatron_dir))
    return trainer


def logp_against(trainer, batch) -> dict:
    """The trainer's per-token log-probs against the batch's old ones, over the loss tokens
    (RLTrainer.score: forward only)."""
    result = trainer.score(batch)
    return {"mean_abs": result.abs_logp_diff_sum / max(result.num_loss_tokens, 1),
            "max_abs": result.abs_logp_diff_max, "num_loss_tokens": result.num_loss_tokens,
            "num_tokens": result.num_tokens, "abs_sum": result.abs_logp_diff_sum}


def release(ctx: Context, *objects: str) -> None:
    import gc

    import torch

    for name in objects:
        setattr(ctx, name, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def mem_info() -> dict:
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"free_gib": free / 2**30, "total_gib": total / 2**30,
            "allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30}


# ----------------------------------------------------------------------------- 1. imports

def nccl_environment() -> dict:
    """This process's NCCL / CUDA / allocator variables, and those the launches give trainer
    ranks and engines (megatron_rl.platform.environment); the shared ones must agree."""
    from megatron_rl.platform import environment

    prefixes = ("NCCL_", "TORCH_NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF",
                "PYTORCH_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "FLASHINFER_")
    trainer = environment.trainer_environment(cuda_ipc=True)
    engine = environment.generator_environment()
    disagree = {k: (trainer.get(k), engine.get(k)) for k in environment.SHARED_DEFAULTS
                if trainer.get(k) != engine.get(k)}
    return {"process": {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)},
            "trainer_ranks": trainer, "engines": engine, "shared_disagree": disagree}


def _version(distribution: str) -> str | None:
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None


def stage_imports(ctx: Context) -> dict:
    import torch

    import megatron_rl  # noqa: F401  (before megatron.core: megatron_rl/_nvrx_compat.py)
    import gpu_image

    result = {"python": platform.python_version(), "torch": torch.__version__,
              "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
              "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
              else None, "environment": nccl_environment()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result.update(gpu=props.name, num_gpus=torch.cuda.device_count(),
                      compute_capability=f"{props.major}.{props.minor}",
                      gpu_memory_gib=round(props.total_memory / 2**30, 1),
                      nccl=".".join(map(str, torch.cuda.nccl.version())))
    modules, failures = {}, []
    for name in IMPORTS:
        if ctx.mode != "gpu" and name != "megatron.core":  # configuration only: found or not
            modules[name] = {"found": _find(name)}
            continue
        try:
            module = importlib.import_module(name)
            modules[name] = {"imported": True, "file": getattr(module, "__file__", None)}
        except Exception as exc:  # noqa: BLE001 (all four are tried, then reported together)
            modules[name] = {"imported": False, "error": f"{type(exc).__name__}: {exc}"}
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
    result["modules"] = modules
    result["versions"] = {d: _version(d) for d in (
        "sglang", "sglang-kernel", "flashinfer-python", "flashinfer-cubin",
        "flashinfer-jit-cache", "transformer-engine", "transformer-engine-torch",
        "megatron-core", "apex", "triton", "nvidia-nccl-cu13")}
    kernels = gpu_image.check_kernels(gpu_image.installed_versions())
    result["flashinfer_kernels"] = kernels or "installed, matching flashinfer"
    expect(not failures, "imports failed (a kernel built for another torch shows an undefined "
           "symbol here: rebuild the image, Dockerfile): " + "; ".join(failures), result)
    expect(not result["environment"]["shared_disagree"], "trainer ranks and engines get "
           "different NCCL settings (megatron_rl/platform/environment.py)", result)
    if ctx.mode == "gpu":
        expect(not kernels, "FlashInfer's precompiled kernels are missing or mismatched; a "
               "first use would download them: " + "; ".join(kernels), result)
    return result


def _find(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# ----------------------------------------------------------------------------- 2. trainer

def fp8_choice() -> dict:
    """The FP8 recipe this GPU runs (None with the reason when it has none): MXFP8 from compute
    capability 10 (Blackwell), delayed scaling from 8.9 (Ada, Hopper); Transformer Engine's own
    check has the last word."""
    import torch

    if not torch.cuda.is_available():
        return {"recipe": None, "reason": "no CUDA GPU"}
    capability = torch.cuda.get_device_capability(0)
    if capability < (8, 9):
        return {"recipe": None, "reason": f"compute capability {capability} < (8, 9): no FP8"}
    recipe = "mxfp8" if capability >= (10, 0) else "delayed"
    for module_name in ("transformer_engine.pytorch.quantization",
                        "transformer_engine.pytorch.fp8"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        check = getattr(module, "check_mxfp8_support" if recipe == "mxfp8"
                        else "check_fp8_support", None)
        if check is not None:
            supported, reason = check()
            if not supported and recipe == "mxfp8":
                return {"recipe": "delayed", "reason": f"Transformer Engine: MXFP8 {reason}"}
            if not supported:
                return {"recipe": None, "reason": f"Transformer Engine: {reason}"}
            return {"recipe": recipe, "reason": f"{module_name}.{check.__name__}: supported"}
    return {"recipe": recipe, "reason": f"compute capability {capability} (no TE check found)"}


def precision_variants(ctx: Context) -> list[tuple[str, dict]]:
    """(name, TrainerSettings fields) in stage order: fp32 on the local spec (the anchor), bf16
    and FP8 on TE (GPU); fp32 and bf16 on the local spec (CPU stand-in)."""
    if ctx.mode != "gpu":
        return [("fp32_local", dict(precision="fp32", use_transformer_engine=False)),
                ("bf16_local", dict(precision="bf16", use_transformer_engine=False))]
    variants = [("fp32_local", dict(precision="fp32", use_transformer_engine=False)),
                ("bf16_te", dict(precision="bf16", use_transformer_engine=True))]
    recipe = fp8_choice()["recipe"]
    if recipe is not None:
        variants.append((f"fp8_{recipe}_te", dict(precision="bf16", use_transformer_engine=True,
                                                  fp8_recipe=recipe)))
    return variants


def _tolerance(fields: dict) -> tuple[float, float]:
    return LOGP_TOLERANCE["fp8" if fields.get("fp8_recipe") else fields["precision"]]


def run_precision(ctx: Context, name: str, fields: dict, batch) -> dict:
    """One precision through RLTrainer: load, score with and without a padding micro-batch,
    micro-batch lengths, train_step."""
    trainer = build_trainer(ctx.model, trainer_settings(**fields))
    return exercise_trainer(ctx, name, fields, trainer, batch, tolerance=_tolerance(fields))


def exercise_trainer(ctx: Context, name: str, fields: dict, trainer, batch, *,
                     tolerance: tuple[float, float]) -> dict:
    """`trainer` (a padded_trainer_class instance) scores `batch` (its old log-probs the
    reference) with and without a padding micro-batch, then takes a train_step; released after."""
    import torch

    out: dict = {"settings": {k: str(v) for k, v in fields.items()}}
    try:
        out["backend"] = str(torch.distributed.get_backend())
        out["parameter_device"] = str(next(trainer.model.parameters()).device)
        expect(out["parameter_device"].startswith(ctx.device_type),
               f"{name}: parameters on {out['parameter_device']}", out)
        out["pad_to_multiple"] = trainer.pad_to_multiple
        base = logp_against(trainer, batch)
        trainer.extra_padding = True
        padded = logp_against(trainer, batch)
        lengths = [int(m.input_ids.shape[-1]) for m in trainer.micro_batches(batch)]
        out.update(logp_vs_reference=base, logp_with_padding=padded,
                   micro_batch_lengths=lengths)
        expect(all(length % trainer.pad_to_multiple == 0 for length in lengths),
               f"{name}: micro-batch lengths {lengths} are not multiples of "
               f"{trainer.pad_to_multiple}", out)
        if fields.get("fp8_recipe"):
            alignment = 32 if fields["fp8_recipe"] == "mxfp8" else 16
            expect(trainer.pad_to_multiple % alignment == 0,
                   f"{name}: FP8 needs token counts divisible by {alignment}, micro-batches are "
                   f"padded to multiples of {trainer.pad_to_multiple}", out)
        expect(padded["num_loss_tokens"] == base["num_loss_tokens"]
               and padded["num_tokens"] == base["num_tokens"]
               and math.isclose(padded["abs_sum"], base["abs_sum"], rel_tol=1e-5, abs_tol=1e-6),
               f"{name}: a padding micro-batch changed the statistics", out)
        mean_tol, max_tol = tolerance
        expect(base["mean_abs"] <= mean_tol and base["max_abs"] <= max_tol,
               f"{name}: log-probs differ from the reference by mean "
               f"{base['mean_abs']:.3g} / max {base['max_abs']:.3g} (tolerance {mean_tol} / "
               f"{max_tol})", out)
        metrics = trainer.train_step(batch)
        out["train_step"] = {k: getattr(metrics, k) for k in (
            "loss", "grad_norm", "logp_mismatch", "logp_mismatch_max", "num_loss_tokens",
            "num_tokens", "num_micro_batches", "skipped")}
        expect(not metrics.skipped and math.isfinite(metrics.loss)
               and math.isfinite(metrics.grad_norm),
               f"{name}: train_step skipped or not finite: {out['train_step']}", out)
        expect(metrics.num_micro_batches == len(lengths),
               f"{name}: {metrics.num_micro_batches} micro-batches stepped, {len(lengths)} "
               f"expected (the padding one included)", out)
        if ctx.mode == "gpu":
            out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        del trainer
        release(ctx)
    return out


def stage_trainer(ctx: Context) -> dict:
    model = tiny_model(ctx)
    reference = reference_logprobs(model)
    batch = make_batch(model.sequences, reference)
    result = {"sequence_lengths": [p + c for p, c in SEQUENCE_LENGTHS],
              "attention_chunk_size": model.hf_config["attention_chunk_size"],
              "fp8": fp8_choice(), "precisions": {}}
    for name, fields in precision_variants(ctx):
        try:
            result["precisions"][name] = run_precision(ctx, name, fields, batch)
        except SmokeFailure as failure:
            result["precisions"][name] = failure.result
            raise SmokeFailure(str(failure), result) from None
    if ctx.mode != "gpu":
        result["fp8_skipped"] = "FP8 needs Transformer Engine on a GPU"
    return result


def stage_trainer_on_cpu(ctx: Context) -> dict:
    """--cpu: every precision's configuration (FP8's included), then the stage for real on the
    local spec (gloo, fp32 and bf16)."""
    return {"configuration": check_trainer(ctx), **stage_trainer(ctx)}


def _spec_classes(spec) -> dict[str, str]:
    """Slot -> class name of a layer spec (TE slots show Megatron's placeholder without TE)."""
    out = {}

    def visit(prefix: str, node) -> None:
        module = getattr(node, "module", None)
        if module is not None:
            out[prefix or "layer"] = getattr(module, "__name__", type(module).__name__)
        if getattr(node, "func", None) is not None:  # functools.partial of a class
            out[prefix] = getattr(node.func, "__name__", str(node.func))
            node = type("P", (), {"submodules": node.keywords.get("submodules")})
        submodules = getattr(node, "submodules", None)
        if submodules is None or not dataclasses.is_dataclass(submodules):
            return
        for field in dataclasses.fields(submodules):
            value = getattr(submodules, field.name)
            name = f"{prefix}.{field.name}" if prefix else field.name
            if hasattr(value, "submodules") or getattr(value, "func", None) is not None:
                visit(name, value)
            elif value is not None:
                out[name] = getattr(value, "__name__", type(value).__name__)

    visit("", spec)
    return out


def check_trainer(ctx: Context) -> dict:
    """Dry run: the settings and Megatron configs of every precision (TE assumed present), the
    TE layer spec, and the padded micro-batch lengths each recipe gives the batch."""
    import torch

    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    from megatron_rl.trainer import pack_micro_batches, precision_overrides
    from megatron_rl.trainer.batch import padding_micro_batch, sequence_pad_multiple

    from models import get_model_family

    model = tiny_model(ctx, weights=False)
    family = get_model_family("llama4")
    lengths = [p + c for p, c in SEQUENCE_LENGTHS]
    chunk = model.hf_config["attention_chunk_size"]
    expect(min(lengths) > chunk, f"sequences {lengths} must all be longer than the attention "
           f"chunk {chunk}", {})
    batch = make_batch(model.sequences, [torch.zeros(n - 1) for n in lengths])
    result = {"sequence_lengths": lengths, "attention_chunk_size": chunk, "precisions": {}}
    variants = [("fp32_local", dict(precision="fp32", use_transformer_engine=False)),
                ("bf16_te", dict(precision="bf16", use_transformer_engine=True))] + [
        (f"fp8_{r}_te", dict(precision="bf16", use_transformer_engine=True, fp8_recipe=r))
        for r in ("delayed", "mxfp8")]
    for name, fields in variants:
        settings = trainer_settings(**fields)
        choice = precision_overrides(settings.precision, fp8_recipe=settings.fp8_recipe,
                                     use_transformer_engine=settings.use_transformer_engine,
                                     transformer_engine_available=True)
        multiple = sequence_pad_multiple(fp8_recipe=settings.fp8_recipe)
        packed = pack_micro_batches(batch, list(range(len(lengths))),
                                    max_tokens=settings.micro_batch_max_tokens,
                                    pad_to_multiple=multiple)
        entry = {"pad_to_multiple": multiple,
                 "micro_batch_lengths": [int(m.input_ids.shape[-1]) for m in packed],
                 "padding_micro_batch_length": int(
                     padding_micro_batch(multiple).input_ids.shape[-1]),
                 "fp8_fields": {k: str(v) for k, v in choice.overrides.items()
                                if k.startswith("fp8")}}
        expect(all(n % multiple == 0 for n in entry["micro_batch_lengths"]),
               f"{name}: packed lengths {entry['micro_batch_lengths']} not multiples of "
               f"{multiple}", entry)
        expect(len(packed) > 1, f"{name}: one micro-batch; the stage needs several", entry)
        if settings.fp8_recipe is None:  # (TransformerConfig checks TE's version for FP8)
            config = family.transformer_config(
                TINY_SIZE, use_transformer_engine=settings.use_transformer_engine,
                **choice.overrides)
            entry.update(params_dtype=str(config.params_dtype), num_layers=config.num_layers,
                         num_moe_experts=config.num_moe_experts,
                         attention_chunk_size=config.attention_chunk_size)
            if settings.use_transformer_engine:
                spec = family.layer_spec(config, use_transformer_engine=True, pp_rank=0)
                entry["layer_spec"] = _spec_classes(spec.submodules.layer_specs[0])
        result["precisions"][name] = entry
    return result


# ----------------------------------------------------------------------------- 3. sglang

def tiny_attention_backend(compute_capability: tuple[int, int] | None) -> str | None:
    """The engines' rollout.attention_backend on this GPU. None on Hopper (or unknown):
    megatron_rl's rule (rollout/sglang_server.py gpu_attention_backend) picks fa3 (its kernels
    round head_dim 32 up to their 64 instantiation). Elsewhere (Blackwell: SGLang 0.5.23 has no
    fast backend that honours Llama-4's chunk, and the rule refuses an unset one) torch_native,
    which megatron_rl patches to honour the chunk, so the per-position check past the chunk runs
    there too (slowly: no CUDA graphs). (triton, picked here before, attends to the whole prefix:
    every token past the chunk wrong.)"""
    if compute_capability is None or compute_capability[0] == 9:
        return None
    return "torch_native"


def server_settings(ctx: Context, *, memory_saver: bool, name: str):
    from megatron_rl.rollout import SGLangServerSettings
    from megatron_rl.rollout.sglang_server import gpu_compute_capability

    # visible_devices unset: the engine sees this process's GPUs and takes the first, the
    # trainer's; mem_fraction_static leaves the rest of it to the trainer.
    return SGLangServerSettings(
        model_path=str(ctx.model.served_dir), dtype="bfloat16", device="cuda",
        attention_backend=tiny_attention_backend(gpu_compute_capability()),
        mem_fraction_static=0.25 if memory_saver else 0.15, context_length=512,
        enable_memory_saver=memory_saver, startup_timeout_s=150, request_timeout_s=120,
        max_retries=1, log_path=str(ctx.work / f"sglang_{name}.log"),
        extra_args=("--cuda-graph-max-bs-decode", "16"))


def parse_with_sglang(args: list[str]) -> dict:
    """The server arguments through SGLang's own command-line parser: every flag must exist in
    the installed SGLang and every value parse."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        return vars(parser.parse_args(args))
    except SystemExit:  # argparse reports some errors by exiting (ambiguous flags)
        raise ValueError(f"SGLang's parser refuses {args}") from None


def sync_settings(kind: str):
    import torch

    from megatron_rl.weight_sync import WeightSyncSettings

    if kind == "distributed":  # one GPU: NCCL refuses a second rank on it; gloo takes CUDA
        return WeightSyncSettings(transport="distributed", backend="gloo", dtype=torch.bfloat16,
                                  timeout_s=120)
    return WeightSyncSettings(transport="tensor", dtype=torch.bfloat16,
                              bucket_bytes=SMALL_BUCKET_BYTES, timeout_s=120)


def hf_weight_bytes(model: TinyModel) -> tuple[int, int]:
    """(bytes, tensors) the sync sends: the HF text model's bf16 state (meta device)."""
    import torch
    from transformers import Llama4ForCausalLM

    from models import get_model_family

    text = get_model_family("llama4").converter().hf_text_config_from_dict(model.hf_config)
    with torch.device("meta"):
        state = Llama4ForCausalLM(text).state_dict()
    return sum(t.numel() * 2 for t in state.values()), len(state)


def by_position(logprobs: list, reference: list, chunk: int) -> dict:
    """|logp - logp_ref| (mean, max) over the positions before the attention chunk ends and past
    it (position t >= 1 of each sequence; entry t - 1 of both lists): an engine that ignores
    Llama-4's chunked attention agrees before the chunk and not past it."""
    import torch

    diffs = {"within_chunk": [], "past_chunk": []}
    for lp, ref in zip(logprobs, reference):
        diff = (torch.as_tensor(lp).float().cpu() - ref.float().cpu()).abs()
        diffs["within_chunk"].append(diff[:chunk - 1])
        diffs["past_chunk"].append(diff[chunk - 1:])
    out = {}
    for part, values in diffs.items():
        values = torch.cat(values)
        out[part] = {"mean_abs": float(values.mean()) if values.numel() else 0.0,
                     "max_abs": float(values.max()) if values.numel() else 0.0,
                     "num_tokens": int(values.numel())}
    return out


def chunked_attention_refusal(ctx: Context) -> str | None:
    """Why megatron_rl refuses an engine of the tiny Llama-4 on this GPU, or None (always None
    where `tiny_attention_backend` asks for torch_native, i.e. off Hopper, and on Hopper)."""
    try:
        server_settings(ctx, memory_saver=False, name="probe").server_args(port=30000)
    except ValueError as exc:
        return str(exc)
    return None


def check_sglang(ctx: Context) -> dict:
    from megatron_rl.rollout.sglang_server import gpu_compute_capability

    model = tiny_model(ctx, weights=False)
    backend = tiny_attention_backend(gpu_compute_capability()) or "fa3"  # fa3: the rule's choice
    result = {}
    for name, saver in (("sglang", False), ("colocated", True)):
        args = server_settings(ctx, memory_saver=saver, name=name).server_args(port=30000)
        parsed = parse_with_sglang(args)
        result[f"server_{name}"] = {"args": args, "parsed": {k: str(parsed[k]) for k in (
            "device", "dtype", "mem_fraction_static", "enable_fp32_lm_head",
            "enable_memory_saver", "cuda_graph_max_bs_decode", "attention_backend",
            "enable_weights_cpu_backup", "disable_hybrid_swa_memory")}}
        expect(parsed["attention_backend"] == backend, f"the {name} engine of the "
               f"chunked-attention model gets attention backend {parsed['attention_backend']!r}, "
               f"not {backend}", result)
        # torch_native reads the hybrid sliding-window KV pool with the wrong indices.
        expect(parsed["disable_hybrid_swa_memory"] == (backend == "torch_native"), f"the {name} "
               f"engine on {backend} has disable_hybrid_swa_memory "
               f"{parsed['disable_hybrid_swa_memory']}", result)
    expect(result["server_colocated"]["parsed"]["enable_weights_cpu_backup"] == "True",
           "the colocated Llama-4 engine would lose its q/k-norm weight at a release (no "
           "--enable-weights-cpu-backup)", result)
    num_bytes, num_tensors = hf_weight_bytes(model)
    small = sync_settings("tensor")
    result["syncs"] = {kind: {"transport": s.transport, "backend": s.backend,
                              "bucket_bytes": s.bucket_bytes, "dtype": str(s.dtype)}
                       for kind, s in (("distributed", sync_settings("distributed")),
                                       ("tensor", small))}
    result["hf_bytes"], result["hf_tensors"] = num_bytes, num_tensors
    result["min_tensor_buckets"] = math.ceil(num_bytes / small.bucket_bytes)
    expect(result["min_tensor_buckets"] >= MIN_BUCKETS, f"the in-memory sync's buckets "
           f"({small.bucket_bytes} bytes) hold the whole model: no buffer is reused", result)
    result["family"] = model.family.family.name
    result["num_weight_groups"] = len(model.family.weight_groups())
    return result


def bf16_trainer(ctx: Context):
    if ctx.trainer is None:
        ctx.trainer = build_trainer(ctx.model, trainer_settings(precision="bf16",
                                                                use_transformer_engine=True))
    return ctx.trainer


def launch_generator(ctx: Context, *, memory_saver: bool, name: str):
    from megatron_rl.rollout import SGLangGenerator

    generator = SGLangGenerator.launch(server_settings(ctx, memory_saver=memory_saver,
                                                       name=name))
    ctx.generators.append(generator)
    return generator


def against_generator(trainer, generator, sequences) -> dict:
    """Token by token: SGLang's teacher-forced log-probs as the old ones of the trainer's score."""
    return logp_against(trainer, make_batch(sequences, generator.score(sequences)))


def stage_sglang(ctx: Context) -> dict:
    from megatron_rl.weight_sync import WeightSync

    model = tiny_model(ctx)
    if refusal := chunked_attention_refusal(ctx):  # correct by construction: no engine here
        return {"refused": refusal}
    sequences = model.sequences
    started = time.perf_counter()
    generator = launch_generator(ctx, memory_saver=False, name="sglang")
    result = {"server_start_s": time.perf_counter() - started}
    trainer = bf16_trainer(ctx)
    reference = reference_logprobs(model)
    reference_batch = make_batch(sequences, reference)
    result["as_loaded"] = against_generator(trainer, generator, sequences)
    mean_tol, max_tol = SYNC_TOLERANCE
    expect(result["as_loaded"]["mean_abs"] <= mean_tol, "SGLang's weights as loaded from the HF "
           f"folder differ from the trainer's: mean |dlogp| {result['as_loaded']['mean_abs']:.3g}"
           " (loader names / expert un-fusing / q-k permutation)", result)
    # Per position against transformers' fp32 forward (which honours the chunk): past the chunk
    # an engine that attends to the whole prefix serves another model.
    chunk = model.hf_config["attention_chunk_size"]
    positions = result["as_loaded_by_position"] = by_position(generator.score(sequences),
                                                              reference, chunk)
    expect(positions["past_chunk"]["num_tokens"] > 0
           and positions["past_chunk"]["mean_abs"] <= mean_tol
           and positions["past_chunk"]["max_abs"] <= max_tol,
           f"SGLang's log-probs past the attention chunk ({chunk}) differ from transformers' by "
           f"{positions['past_chunk']} (within it: {positions['within_chunk']}): the engine's "
           "attention backend ignores Llama-4's chunked attention", result)
    for index, kind in enumerate(("distributed", "tensor"), start=1):
        trainer.train_step(reference_batch)  # the trainer moves away from the engine
        entry = {"stale": against_generator(trainer, generator, sequences)}
        sync = WeightSync(trainer.model, model.family.weight_groups(), [generator],
                          sync_settings(kind), hf_vocab_size=model.family.hf_config.vocab_size)
        try:
            report = sync.sync(version=index)
        finally:
            sync.close()
        entry["report"] = {k: getattr(report, k) for k in (
            "version", "num_bytes", "num_tensors", "num_buckets", "seconds", "transfer_s",
            "load_s", "control_s")}
        entry["synced"] = against_generator(trainer, generator, sequences)
        entry["generator_version"] = generator.server_weight_version()
        result[f"sync_{kind}"] = entry
        synced, stale = entry["synced"], entry["stale"]
        expect(synced["mean_abs"] <= mean_tol and synced["max_abs"] <= max_tol
               and synced["mean_abs"] < 0.5 * stale["mean_abs"],
               f"after the {kind} sync SGLang's log-probs differ from the trainer's by mean "
               f"{synced['mean_abs']:.3g} / max {synced['max_abs']:.3g} (stale: mean "
               f"{stale['mean_abs']:.3g})", result)
        if kind == "tensor":
            expect(report.num_buckets >= MIN_BUCKETS, f"the in-memory sync took "
                   f"{report.num_buckets} bucket(s): no buffer was reused", result)
    generator.shutdown()
    ctx.generators.remove(generator)
    return result


# ----------------------------------------------------------------------------- 4. colocated

def check_colocated(ctx: Context) -> dict:
    from megatron_rl.platform import environment
    from megatron_rl.rollout import SGLangGenerator

    from megatron_rl.config import load_config
    from megatron_rl.trainer import TrainerSettings

    env = environment.trainer_environment({}, cuda_ipc=True)
    result = {"trainer_environment": env,
              "resume_order": [list(SGLangGenerator.MEMORY_WEIGHTS),
                               list(SGLangGenerator.MEMORY_AFTER_WEIGHTS)]}
    expect(not any(k in env for k in environment.ALLOCATOR_VARIABLES), "a trainer that hands "
           "tensors over CUDA IPC must not use expandable segments", result)
    recipe = load_config(ROOT / "examples/configs/tiny_pipeline.yaml",
                         ["cluster.colocated=true", "rollout.max_off_policyness=0"])
    result["colocated_trainer_offloads"] = \
        TrainerSettings.from_run_config(recipe).offload_between_steps
    expect(result["colocated_trainer_offloads"], "a colocated recipe's trainer keeps its "
           "gradients and optimizer state on the device during generation", result)
    return result


def offload_bytes(trainer) -> int:
    """What the trainer's offload should release, counted before it: the gradient buffers and
    the optimizer tensors that may leave (trainer/optimizer.py offload_targets)."""
    from megatron_rl.trainer.optimizer import offload_targets

    buffers = trainer.model.buffers + trainer.model.expert_parallel_buffers
    return sum(b.grad_data.untyped_storage().nbytes() for b in buffers) + \
        offload_targets(trainer.optimizer, [trainer.model]).num_bytes


def allocated_change(before: dict, after: dict) -> int:
    return round((after["allocated_gib"] - before["allocated_gib"]) * 2**30)


def within_offload_tolerance(change: int, expected: int) -> bool:
    fraction, slack = OFFLOAD_TOLERANCE
    return abs(change - expected) <= fraction * expected + slack


def stage_colocated(ctx: Context) -> dict:
    import torch

    from megatron_rl.rollout import SamplingParams, SGLangGenerator
    from megatron_rl.weight_sync import WeightSync

    model = tiny_model(ctx)
    if refusal := chunked_attention_refusal(ctx):
        return {"refused": refusal}
    sequences = model.sequences
    trainer = bf16_trainer(ctx)
    reference_batch = make_batch(sequences, reference_logprobs(model))
    torch.cuda.synchronize()
    points = {"before_engine": mem_info()}
    generator = launch_generator(ctx, memory_saver=True, name="colocated")
    points["engine_up"] = mem_info()
    result = {"memory": points}
    sync = WeightSync(trainer.model, model.family.weight_groups(), [generator],
                      sync_settings("tensor"), hf_vocab_size=model.family.hf_config.vocab_size)
    try:
        generator.release_memory()
        points["released"] = mem_info()
        result["train_step_loss"] = trainer.train_step(reference_batch).loss
        torch.cuda.synchronize()
        points["trained"] = mem_info()
        result["offload_expected_bytes"] = offload_bytes(trainer)
        result["offload_reported_bytes"] = trainer.offload_training_state()
        points["trainer_offloaded"] = mem_info()
        generator.resume_memory(SGLangGenerator.MEMORY_WEIGHTS)
        points["weights_resumed"] = mem_info()
        result["sync_buckets"] = sync.sync(version=1).num_buckets
        points["synced"] = mem_info()
        generator.resume_memory(SGLangGenerator.MEMORY_AFTER_WEIGHTS)
        points["kv_resumed"] = mem_info()
        outputs = generator.generate([s[:8] for s in sequences[:3]], SamplingParams(
            max_new_tokens=16, temperature=1.0, num_samples=2, seed=1, ignore_eos=True))
        points["generated"] = mem_info()
    finally:
        sync.close()
    result["generated_tokens"] = sum(len(o.token_ids) for o in outputs)
    result["generated_logprobs_finite"] = all(math.isfinite(x) for o in outputs
                                              for x in o.logprobs)
    # Still offloaded. A q/k-norm weight lost at the release (issue 39.3) shows here: the
    # engine's RoPE layers then scale q and k by whatever the memory held.
    result["after_cycle"] = against_generator(trainer, generator, sequences)
    result["weights_cpu_backup"] = "--enable-weights-cpu-backup" in server_settings(
        ctx, memory_saver=True, name="colocated").server_args(port=30000)
    points["before_reload"] = mem_info()
    trainer.reload_training_state()
    points["trainer_reloaded"] = mem_info()
    result["step_after_reload"] = trainer.train_step(reference_batch).loss
    expected = result["offload_expected_bytes"]
    result["offload_allocated_change"] = allocated_change(points["trained"],
                                                          points["trainer_offloaded"])
    result["reload_allocated_change"] = allocated_change(points["before_reload"],
                                                         points["trainer_reloaded"])
    expect(result["offload_reported_bytes"] == expected and expected > 0, "the trainer's "
           f"offload reports {result['offload_reported_bytes']} bytes, its gradient buffers "
           f"and optimizer state hold {expected}", result)
    expect(within_offload_tolerance(-result["offload_allocated_change"], expected),
           f"the trainer's offload lowered memory_allocated by "
           f"{-result['offload_allocated_change']} bytes, {expected} expected", result)
    expect(within_offload_tolerance(result["reload_allocated_change"], expected),
           f"the trainer's reload raised memory_allocated by "
           f"{result['reload_allocated_change']} bytes, {expected} expected", result)
    expect(math.isfinite(result["step_after_reload"]), "the step after the reload is not "
           "finite", result)
    held = points["before_engine"]["free_gib"] - points["engine_up"]["free_gib"]
    handed_back = points["released"]["free_gib"] - points["engine_up"]["free_gib"]
    result.update(engine_held_gib=held, released_gib=handed_back)
    expect(handed_back >= MIN_RELEASED_FRACTION * held, f"releasing the engine freed "
           f"{handed_back:.2f} of the {held:.2f} GiB it held (memory saver off?)", result)
    expect(result["generated_tokens"] == 3 * 2 * 16 and result["generated_logprobs_finite"],
           "generation after the cycle failed", result)
    expect(result["after_cycle"]["mean_abs"] <= SYNC_TOLERANCE[0], "after the colocated cycle "
           f"SGLang's log-probs differ from the trainer's: {result['after_cycle']}", result)
    generator.shutdown()
    ctx.generators.remove(generator)
    return result


# ----------------------------------------------------------------------------- 5. moe_layer

def scout_moe_layer_config(*, use_transformer_engine: bool):
    from megatron_rl.trainer import precision_overrides
    from models import get_model_family

    choice = precision_overrides("bf16", fp8_recipe=None,
                                 use_transformer_engine=use_transformer_engine,
                                 transformer_engine_available=True)
    # One layer of Scout (its widths, 16 experts, top-1, shared expert); plain .grad (no DDP
    # wrapper allocates main_grad for TE's fused accumulation).
    return get_model_family("llama4").transformer_config(
        "scout", use_transformer_engine=use_transformer_engine, num_layers=1,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        **choice.overrides)


def planner_layer_bytes(config, tokens: int) -> dict:
    """The planner's figure for one micro-batch of `tokens` through layer 0 of `config` (one
    rank holds the whole layer: TP = EP = 1, so routing imbalance does not arise)."""
    from megatron_rl.scaling.plan import (ActivationSettings, Architecture, TrainerLayout,
                                          layer_activation_bytes)
    from models import get_model_family

    vocab = get_model_family("llama4").model_kwargs("scout")["vocab_size"]
    arch = Architecture.from_transformer_config(config, vocab)
    parts = layer_activation_bytes(arch, TrainerLayout(), ActivationSettings(tokens=tokens),
                                   moe=arch.is_moe_layer(0), chunked=arch.is_chunked_layer(0))
    return {"parts": parts, "total": sum(parts.values())}


def check_moe_layer(ctx: Context, *, use_transformer_engine: bool = True) -> dict:
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    from models import get_model_family

    config = scout_moe_layer_config(use_transformer_engine=use_transformer_engine)
    spec = get_model_family("llama4").layer_spec(
        config, use_transformer_engine=use_transformer_engine, pp_rank=0)
    plan = planner_layer_bytes(config, SCOUT_MOE_TOKENS)
    result = {"hidden_size": config.hidden_size, "num_moe_experts": config.num_moe_experts,
              "moe_ffn_hidden_size": config.moe_ffn_hidden_size, "tokens": SCOUT_MOE_TOKENS,
              "layer_spec": _spec_classes(spec.submodules.layer_specs[0]),
              "planner_bytes": plan["total"], "planner_parts": plan["parts"]}
    expect(config.num_layers == 1 and config.num_moe_experts == 16, "not one Scout MoE layer",
           result)
    return result


def stage_moe_layer(ctx: Context, *, use_transformer_engine: bool = True) -> dict:
    import torch

    from megatron_rl.trainer import ParallelLayout, init_parallel
    from models import get_model_family

    release(ctx, "trainer")
    init_parallel(ParallelLayout(), seed=1234)
    config = scout_moe_layer_config(use_transformer_engine=use_transformer_engine)
    layer = get_model_family("llama4").build_model(
        config, pre_process=False, post_process=False,
        use_transformer_engine=use_transformer_engine).cuda()
    tokens = SCOUT_MOE_TOKENS
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(tokens, 1, config.hidden_size, generator=generator) * 0.5).to(
        "cuda", torch.bfloat16).requires_grad_()
    positions = torch.arange(tokens, device="cuda")[None]
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if tensor.device.type == "cuda" and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    layer.set_input_tensor(hidden)  # no embedding stage (pre_process=False): the block's input
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = layer(None, positions, None)  # [tokens, 1, hidden]
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated() - base
    output.float().square().mean().backward()
    torch.cuda.synchronize()
    plan = planner_layer_bytes(config, tokens)
    result = {"tokens": tokens, "transformer_engine": use_transformer_engine,
              "saved_bytes": sum(saved.values()),
              "forward_allocated_bytes": after_forward,
              "peak_bytes": torch.cuda.max_memory_allocated() - base,
              "planner_bytes": plan["total"], "planner_parts": plan["parts"]}
    result["planner_over_measured"] = plan["total"] / max(result["saved_bytes"], 1)
    del layer, output, hidden
    release(ctx)
    expect(result["saved_bytes"] <= PLANNER_UNDERESTIMATE * plan["total"], "the layer's forward "
           f"saves {result['saved_bytes'] / 2**30:.2f} GiB, the planner counts "
           f"{plan['total'] / 2**30:.2f} GiB (megatron_rl/scaling/plan.py underestimates)",
           result)
    return result


# ----------------------------------------------------------------------------- 6. fp8_serving

def fp8_served_config() -> dict:
    """The demo model served FP8 (rollout.precision=fp8) at TP 1: the largest of
    FP8_BLOCK_SIZES the planner accepts for it (megatron_rl.scaling.plan.check_fp8_rollout:
    SGLang's block-shape rules, Llama-4's whole heads), its served quantization_config (the
    weight sync's builder, weight_sync/fp8.py served_quantization_config), the family's mapping
    and the HF tensors the weight sync sends (meta)."""
    import types

    from megatron_rl.scaling import plan
    from megatron_rl.scaling.hardware import ACCELERATORS
    from megatron_rl.weight_sync.fp8 import served_quantization_config

    arch = plan.Architecture.from_family("llama4", TINY_SIZE)
    mapping = plan.family_mapping("llama4", TINY_SIZE)
    hf_tensors = plan.hf_meta_tensors(arch, mapping)
    for block in FP8_BLOCK_SIZES:
        rollout = types.SimpleNamespace(precision="fp8", fp8_block_size=block,
                                        fp8_scale_fmt="float32", tp_size=1, ep_size=1)
        try:
            plan.check_fp8_rollout(types.SimpleNamespace(rollout=rollout),
                                   accelerator=ACCELERATORS["H100"], arch=arch,
                                   hf_names=hf_tensors)
        except ValueError:
            continue
        return {"block": block, "quantization_config": served_quantization_config(rollout),
                "architecture": arch, "mapping": mapping, "hf_tensors": hf_tensors}
    raise SmokeFailure(f"no block size of {FP8_BLOCK_SIZES} fits the demo model", {})


def fp8_sync_settings(quantization_config: dict):
    """The in-memory sync's settings with the served quantization_config: the sync quantises."""
    return dataclasses.replace(sync_settings("tensor"), quantization_config=quantization_config)


def check_fp8_serving(ctx: Context) -> dict:
    """The FP8 stage's configuration on CPU: SGLang's own Fp8Config reads the served
    quantization_config; the weight sync's own FP8 path (the quantiser and bucket plan
    WeightSync builds from its settings) quantises a random bf16 copy of every tensor SGLang
    holds in FP8 (Llama-4's experts unfused per expert), each as planned and within FP8's bound
    (amax / 28 per block) of its input; its bytes equal the planner's for the engine."""
    if ctx.mode != "gpu":  # CPU: the stand-ins SGLang's layer imports need
        from megatron_rl.platform.sglang_cpu import apply_sglang_cpu_fixes

        apply_sglang_cpu_fixes()
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    served = fp8_served_config()
    config = served["quantization_config"]
    result = {"block": served["block"], "quantization_config": config}
    sglang_config = Fp8Config.from_config(config)
    result["sglang_weight_block_size"] = sglang_config.weight_block_size
    expect(list(sglang_config.weight_block_size or []) == config.get("weight_block_size", []),
           f"SGLang's Fp8Config reads weight_block_size {sglang_config.weight_block_size} from "
           f"{config}", result)
    copy = None
    if ctx.model is not None and ctx.model.megatron_dir is not None:  # the weights are written
        from megatron_rl.cluster.served_checkpoint import SERVED_DIR, write_fp8_checkpoint

        copy = write_fp8_checkpoint(ctx.model.served_dir, ctx.work / SERVED_DIR, config)
    return quantiser_check(served, result, copy=copy)


def served_copy_check(copy: Path, quantization_config: dict, specs: dict, result: dict) -> None:
    """The run's FP8 copy of the demo model (cluster/served_checkpoint.py write_fp8_checkpoint,
    what the FP8 engine starts from): its config.json holds the served quantization_config, and
    every tensor the sync's bucket plan (`specs`) writes is in it under the same name, dtype and
    shape (the copy's names under the layout's "language_model." prefix, which SGLang's loader
    drops): the engine loads from the copy the parameters the sync later writes into."""
    from safetensors import safe_open

    from models.llama4.convert import hf_weight_prefix

    config = json.loads((copy / "config.json").read_text())
    prefix = hf_weight_prefix(config)
    copied = {}
    for path in sorted(copy.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                copied[name.removeprefix(prefix)] = (tensor.get_dtype(),
                                                     tuple(tensor.get_shape()))
    planned = {name: (str(spec.dtype), spec.shape) for name, spec in specs.items()}
    dtype_names = {"torch.float8_e4m3fn": "F8_E4M3", "torch.float32": "F32",
                   "torch.bfloat16": "BF16"}  # safetensors' names of the dtypes
    differ = sorted(n for n, (dtype, shape) in planned.items()
                    if copied.get(n) != (dtype_names.get(dtype, dtype), tuple(shape)))
    result["served_copy"] = {"tensors": len(copied), "fp8": sum(
        d == "F8_E4M3" for d, _ in copied.values())}
    written = config.get("quantization_config")
    expect(written == quantization_config, f"the served copy's config.json holds "
           f"quantization_config {written}, not {quantization_config}", result)
    expect(not differ, f"the served copy ({copy}) holds "
           f"{[(n, copied.get(n)) for n in differ[:4]]} where the sync writes "
           f"{[(n, planned[n]) for n in differ[:4]]}", result)


def quantiser_check(served: dict, result: dict, *, copy: Path | None = None) -> dict:
    """The weight sync's FP8 path on the demo model, as WeightSync builds it from
    `fp8_sync_settings` (weight_sync/fp8.py SyncQuantiser over the mapping's HF names, its
    bucket plan by weight_sync/plan.py plan_buckets): the quantiser on a random bf16 copy of
    every tensor SGLang holds in FP8 writes each piece under the name, dtype and shape its plan
    has, within FP8's bound; the plan's fp8, scale and high-precision bytes equal the planner's
    engine weights (megatron_rl.scaling.plan.served_weight_bytes) and what the quantiser wrote;
    nothing high-precision is quantised."""
    import torch

    from megatron_rl.scaling import plan
    from megatron_rl.weight_sync import fp8
    from megatron_rl.weight_sync.plan import plan_buckets

    arch, mapping, hf_tensors = served["architecture"], served["mapping"], served["hf_tensors"]
    settings = fp8_sync_settings(served["quantization_config"])
    quantiser = fp8.SyncQuantiser(settings.quantization_config,
                                  [name for group in mapping for name in group.hf_names],
                                  head_dim=arch.head_dim)
    full = {p.name: p.shape for p in plan.rank_parameters(arch, plan.TrainerLayout(), pp_rank=0)}
    buckets = plan_buckets(
        [group for group in mapping if group.megatron_names],
        lambda name: torch.empty(full[name], dtype=torch.bfloat16, device="meta"),
        bucket_bytes=settings.bucket_bytes, dtype=settings.dtype, quantiser=quantiser)
    specs = {spec.name: spec for bucket in buckets for spec in bucket.specs}
    layout = quantiser.layout
    generator = torch.Generator().manual_seed(0)
    fp8_bytes = scale_bytes = 0
    scale_names, mismatched = set(), []
    worst = 0.0  # max |dequantised - input| / amax(input), over the pieces
    for name in sorted(quantiser.quantised):
        tensor = (torch.randn(hf_tensors[name].shape, generator=generator) * 0.02).to(
            torch.bfloat16)
        sent = quantiser.quantize(name, tensor)
        mismatched += [n for n, t in sent.items() if n not in specs or (
            specs[n].dtype, specs[n].shape) != (t.dtype, tuple(t.shape))]
        pieces = fp8.unfuse_llama4_experts(name, tensor) if fp8.is_llama4_fused_experts(name) \
            else {name: tensor}
        for piece_name, piece in pieces.items():
            weight, scale = sent[piece_name], sent[layout.scale_name(piece_name)]
            scale_names.add(layout.scale_name(piece_name))
            fp8_bytes += weight.numel() * weight.element_size()
            scale_bytes += scale.numel() * scale.element_size()
            back = fp8.dequantize_blockwise(weight, scale, layout.weight_block_size) \
                if layout.weight_block_size else weight.float() * scale
            worst = max(worst, float((back - piece.float()).abs().max()
                                     / piece.float().abs().max()))
    sync_bytes = {"fp8": sum(s.num_bytes for s in specs.values() if s.dtype == fp8.FP8_DTYPE),
                  "scales": sum(specs[n].num_bytes for n in scale_names if n in specs)}
    sync_bytes["high_precision"] = sum(s.num_bytes for s in specs.values()) - sum(
        sync_bytes.values())
    planned = plan.served_weight_bytes(hf_tensors, generator_dtype="bfloat16",
                                       quantization_config=served["quantization_config"])
    result.update(quantised_tensors=len(quantiser.quantised),
                  high_precision=sorted(set(hf_tensors) - quantiser.quantised)[:8],
                  fp8_bytes=fp8_bytes, scale_bytes=scale_bytes, sync_buckets=len(buckets),
                  sync_bytes=sync_bytes,
                  planner={"fp8": planned.fp8, "scales": planned.scales,
                           "high_precision": planned.high_precision},
                  max_error_over_amax=worst)
    expect(not mismatched, f"the quantiser wrote {mismatched[:4]} other than the sync's bucket "
           "plan has them (name, dtype, shape)", result)
    # Half a step at e4m3's top binade is amax / 28 (weight_sync/fp8.py), plus float32 rounding.
    expect(worst <= (1 + 1e-5) / 28, f"the quantiser's round trip is off by {worst:.4g} of "
           "amax (FP8's bound: 1/28)", result)
    expect(sync_bytes == result["planner"] and (fp8_bytes, scale_bytes) == (
        planned.fp8, planned.scales), f"the planner counts {result['planner']} bytes, the "
           f"sync's buckets hold {sync_bytes}, the quantiser wrote {fp8_bytes} fp8 + "
           f"{scale_bytes} scale bytes", result)
    expect(not any(k in n for n in quantiser.quantised for k in ("router", "embed", "lm_head",
                                                                   "norm")),
           "a router, embedding, LM head or norm would be quantised", result)
    if copy is not None:
        served_copy_check(copy, served["quantization_config"], specs, result)
    return result


def stage_fp8_serving(ctx: Context) -> dict:
    """An FP8 engine of the tiny Llama-4 on the GPU, a trainer step, the quantised sync into it,
    then the per-token log-prob mismatch against the trainer, printed with its bound."""
    import dataclasses as dc

    if importlib.util.find_spec("sglang") is None:
        return {"skipped": "SGLang is not importable here: no FP8 engine to serve"}
    from megatron_rl.cluster.served_checkpoint import SERVED_DIR, write_fp8_checkpoint
    from megatron_rl.weight_sync import WeightSync

    result = check_fp8_serving(ctx)
    model = tiny_model(ctx)
    if refusal := chunked_attention_refusal(ctx):
        return {**result, "refused": refusal}
    config = result["quantization_config"]
    # The FP8 copy the engine starts from, written by the run's own writer (cluster/launch.py
    # served_model_dir), so the GPU serves exactly what a run with rollout.precision=fp8 serves.
    served = write_fp8_checkpoint(model.served_dir, ctx.work / SERVED_DIR, config)
    from megatron_rl.rollout import SGLangGenerator

    generator = SGLangGenerator.launch(dc.replace(
        server_settings(ctx, memory_saver=False, name="fp8"), model_path=str(served)))
    ctx.generators.append(generator)
    trainer = bf16_trainer(ctx)
    sequences = model.sequences
    trainer.train_step(make_batch(sequences, reference_logprobs(model)))
    result["stale"] = against_generator(trainer, generator, sequences)
    sync = WeightSync(trainer.model, model.family.weight_groups(), [generator],
                      fp8_sync_settings(config), hf_vocab_size=model.family.hf_config.vocab_size)
    try:
        report = sync.sync(version=1)
    finally:
        sync.close()
    result["report"] = {k: getattr(report, k, None) for k in (
        "num_bytes", "num_tensors", "num_buckets", "num_quantized", "seconds")}
    synced = result["synced"] = against_generator(trainer, generator, sequences)
    mean_bound, max_bound = FP8_MISMATCH_BOUND
    print(f"gpu_smoke: fp8_serving: per-token |logp_engine - logp_trainer| mean "
          f"{synced['mean_abs']:.3g} (bound {mean_bound}), max {synced['max_abs']:.3g} "
          f"(bound {max_bound}); stale before the sync: mean {result['stale']['mean_abs']:.3g}",
          flush=True)
    expect(synced["mean_abs"] <= mean_bound and synced["max_abs"] <= max_bound,
           f"after the FP8 sync the engine's log-probs differ from the trainer's by mean "
           f"{synced['mean_abs']:.3g} / max {synced['max_abs']:.3g}, over the bound "
           f"{FP8_MISMATCH_BOUND} (a wrong scale or layout)", result)
    generator.shutdown()
    ctx.generators.remove(generator)
    return result


# ----------------------------------------------------------------------------- the bare tier

def bare_settings(*, precision: str, offload: bool = False):
    """The tiny Llama-4's trainer on the local spec (no Transformer Engine on a bare machine),
    random weights from the seed (no checkpoint: converting one needs safetensors and
    transformers, which the bare machine lacks)."""
    settings = trainer_settings(precision=precision, use_transformer_engine=False)
    return dataclasses.replace(settings, offload_between_steps=offload)


def bare_sequences() -> list[list[int]]:
    import torch

    vocab = tiny_hf_config()["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab - 1, (p + c,), generator=generator).tolist()
            for p, c in SEQUENCE_LENGTHS]


def plain_logprobs(trainer, sequences: list[list[int]]) -> list:
    """The trainer's model, one sequence at a time (no packing, no micro-batches, no padding),
    with a plain FP32 log-softmax over the whole vocabulary for a head: log p(seq[t] | seq[:t])
    for t >= 1, [len - 1] per sequence. The reference for the trainer's own score."""
    import torch

    from megatron_rl.platform import device
    from megatron_rl.trainer.model import unwrap

    gpt = unwrap(trainer.model)
    gpt.eval()

    def head(*, hidden_states, output_layer, output_weight, **_):
        weight = output_weight if output_weight is not None else output_layer.weight
        logits = hidden_states[:, 0].float() @ weight.float().t()  # [s, vocab]
        return torch.log_softmax(logits, dim=-1)

    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], device=device())
            positions = torch.arange(len(seq), device=device())[None]
            logp = gpt(ids, positions, None, padding_mask=torch.zeros_like(ids, dtype=torch.bool),
                       output_processor=head)
            out.append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].float().cpu())
    return out


def stage_bare_imports(ctx: Context) -> dict:
    """What a bare GPU machine has: torch and its CUDA / NCCL, megatron.core from the carried
    wheels, and none of SGLang, Transformer Engine, apex, transformers (reported, not needed)."""
    import torch

    import megatron_rl  # noqa: F401  (before megatron.core: megatron_rl/_nvrx_compat.py)
    import megatron.core  # noqa: F401
    from megatron_rl.platform import environment

    result = {"python": platform.python_version(), "torch": torch.__version__,
              "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
              "megatron_core": _version("megatron-core"), "numpy": _version("numpy"),
              "absent": {name: not _find(name) for name in (
                  "sglang", "transformer_engine", "apex", "transformers", "safetensors")},
              "fabric": environment.host_fabric(),
              "trainer_environment": environment.trainer_environment(cuda_ipc=False)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                      gpu_memory_gib=round(props.total_memory / 2**30, 1),
                      nccl=".".join(map(str, torch.cuda.nccl.version())))
    if ctx.mode == "gpu":
        expect(torch.distributed.is_nccl_available(), "this torch has no NCCL", result)
    return result


def stage_bare_trainer(ctx: Context) -> dict:
    """RLTrainer on the platform's device and collectives (NCCL on a GPU), local spec, fp32 and
    bf16: score and train_step on uneven lengths, a padding micro-batch changing nothing, the
    log-probs against `plain_logprobs` of the same model."""
    sequences = bare_sequences()
    result = {"sequence_lengths": [len(s) for s in sequences],
              "attention_chunk_size": tiny_hf_config()["attention_chunk_size"], "precisions": {}}
    for precision in ("fp32", "bf16"):
        name = f"{precision}_local"
        fields = dict(precision=precision, use_transformer_engine=False)
        trainer = padded_trainer_class()(bare_settings(precision=precision))
        batch = make_batch(sequences, plain_logprobs(trainer, sequences))
        try:
            result["precisions"][name] = exercise_trainer(
                ctx, name, fields, trainer, batch, tolerance=BARE_LOGP_TOLERANCE[precision])
        except SmokeFailure as failure:
            result["precisions"][name] = failure.result
            raise SmokeFailure(str(failure), result) from None
        finally:
            del trainer
            release(ctx)
    return result


def check_bare_trainer(ctx: Context) -> dict:
    """Dry run: the settings and packed micro-batch lengths of both precisions."""
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    import torch

    from megatron_rl.trainer import pack_micro_batches
    from megatron_rl.trainer.batch import sequence_pad_multiple

    sequences = bare_sequences()
    lengths = [len(s) for s in sequences]
    chunk = tiny_hf_config()["attention_chunk_size"]
    batch = make_batch(sequences, [torch.zeros(n - 1) for n in lengths])
    result = {"sequence_lengths": lengths, "attention_chunk_size": chunk, "precisions": {}}
    expect(min(lengths) > chunk, f"sequences {lengths} must be longer than the chunk", result)
    for precision in ("fp32", "bf16"):
        settings = bare_settings(precision=precision)
        packed = pack_micro_batches(batch, list(range(len(lengths))),
                                    max_tokens=settings.micro_batch_max_tokens,
                                    pad_to_multiple=sequence_pad_multiple())
        result["precisions"][f"{precision}_local"] = {
            "use_transformer_engine": settings.use_transformer_engine,
            "micro_batch_lengths": [int(m.input_ids.shape[-1]) for m in packed]}
        expect(len(packed) > 1 and not settings.use_transformer_engine,
               f"{precision}: one micro-batch, or the TE spec", result)
    return result


def stage_logprob_op(ctx: Context) -> dict:
    """megatron_rl.ops.chunked_logprobs (FP32 head, bf16 inputs) against a plain FP32
    log-softmax: the log-probs and the input gradients, the time of each, and on a GPU the peak
    memory each adds (the op's docstring bounds its own)."""
    import torch

    from megatron_rl.ops import chunked_logprobs
    from megatron_rl.platform import device

    gpu = ctx.mode == "gpu"
    tokens, hidden_size, vocab = LOGPROB_OP_SHAPE["gpu" if gpu else "cpu"]
    where = device() if gpu else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(tokens, hidden_size, generator=generator)).to(where, torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * hidden_size ** -0.5).to(
        where, torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=generator).to(where)

    def measure(fn) -> dict:
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if gpu else 0
        started = time.perf_counter()
        logp = fn(h, w)
        logp.sum().backward()
        if gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated() - base if gpu else None  # before the copies
        return {"seconds": seconds, "peak_extra_bytes": peak, "logp": logp.detach().float(),
                "grad_hidden": h.grad.float(), "grad_weight": w.grad.float()}

    def plain(h, w):
        logits = h.float() @ w.float().t()  # [tokens, vocab] FP32
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]

    reference = measure(plain)
    chunked = measure(lambda h, w: chunked_logprobs(h, w, targets, chunk_size=LOGPROB_OP_CHUNK,
                                                    compute_entropy=False)[0])

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    result = {"shape": {"tokens": tokens, "hidden": hidden_size, "vocab": vocab},
              "chunk_size": LOGPROB_OP_CHUNK,
              "logp_max_abs": float((chunked["logp"] - reference["logp"]).abs().max()),
              "grad_hidden_max_rel": rel(chunked["grad_hidden"], reference["grad_hidden"]),
              "grad_weight_max_rel": rel(chunked["grad_weight"], reference["grad_weight"]),
              "seconds": {"chunked": chunked["seconds"], "plain": reference["seconds"]}}
    if gpu:
        # The op's docstring: 1.25 x chunk x vocab FP32 in the forward, an FP32 copy of the
        # weight (fp32 head) and an FP32 weight-gradient accumulator; plus the bf16 gradients.
        bound = (1.25 * LOGPROB_OP_CHUNK * vocab * 4 + 2 * vocab * hidden_size * 4
                 + (tokens + vocab) * hidden_size * 2 + tokens * 8)
        result["peak_extra_bytes"] = {"chunked": chunked["peak_extra_bytes"],
                                      "plain": reference["peak_extra_bytes"],
                                      "chunked_bound": int(bound)}
        expect(chunked["peak_extra_bytes"] <= 1.25 * bound, "the chunked op's peak memory "
               f"{chunked['peak_extra_bytes'] / 2**30:.2f} GiB exceeds its documented bound "
               f"{bound / 2**30:.2f} GiB", result)
    expect(result["logp_max_abs"] <= LOGPROB_OP_TOLERANCE["logp_max_abs"]
           and max(result["grad_hidden_max_rel"], result["grad_weight_max_rel"])
           <= LOGPROB_OP_TOLERANCE["grad_max_rel"],
           f"the chunked FP32 log-prob op differs from a plain log-softmax: {result}", result)
    return result


def stage_device_collectives(ctx: Context) -> dict:
    """The process group the trainer runs on (NCCL with a GPU) reduces, broadcasts and gathers
    tensors made on megatron_rl.platform.collective_device(), and micro-batches reach the
    platform's device in one move (MicroBatch.to)."""
    import torch
    import torch.distributed as dist

    from megatron_rl.platform import collective_device, device
    from megatron_rl.trainer import ParallelLayout, init_parallel, pack_micro_batches

    init_parallel(ParallelLayout(), seed=1234)
    where = collective_device()
    result = {"backend": str(dist.get_backend()), "collective_device": str(where),
              "device": str(device()), "world_size": dist.get_world_size()}
    value = torch.arange(4, dtype=torch.float32, device=where)
    dist.all_reduce(value)
    dist.broadcast(value, src=0)
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value)
    result["all_reduce"] = value.tolist()
    expect(value.tolist() == [0.0, 1.0, 2.0, 3.0] and all(torch.equal(g, value) for g in gathered),
           "collectives on the collective device gave wrong values", result)
    sequences = bare_sequences()
    batch = make_batch(sequences, [torch.zeros(len(s) - 1) for s in sequences])
    micro = pack_micro_batches(batch, list(range(len(sequences))),
                               max_tokens=MICRO_BATCH_MAX_TOKENS, pad_to_multiple=1)[0].to(device())
    result["micro_batch_devices"] = sorted({str(t.device) for t in (
        micro.input_ids, micro.position_ids, micro.loss_mask, micro.padding_mask)})
    expect(result["micro_batch_devices"] == [str(device())], "a micro-batch's tensors are not "
           f"all on {device()}: {result['micro_batch_devices']}", result)
    if ctx.mode == "gpu":
        expect(result["backend"] == "nccl" and where.type == "cuda",
               f"the trainer's collectives run on {result['backend']} / {where}", result)
    return result


def check_device_collectives(ctx: Context) -> dict:
    """Dry run: a packed micro-batch moves to the platform's device in one call."""
    import torch

    from megatron_rl.platform import activate_cpu_compat, device

    activate_cpu_compat()
    from megatron_rl.trainer import pack_micro_batches

    sequences = bare_sequences()
    batch = make_batch(sequences, [torch.zeros(len(s) - 1) for s in sequences])
    micro = pack_micro_batches(batch, list(range(len(sequences))),
                               max_tokens=MICRO_BATCH_MAX_TOKENS, pad_to_multiple=1)[0].to(device())
    return {"device": str(device()), "micro_batch_devices": sorted({str(t.device) for t in (
        micro.input_ids, micro.position_ids, micro.loss_mask, micro.padding_mask)})}


def stage_offload(ctx: Context) -> dict:
    """Colocated offload (RLTrainer.offload_training_state): after a train step, memory_allocated
    falls by the gradient buffers and optimizer state it reports, counted independently before;
    the reload raises it by as much and the next step runs."""
    import torch

    sequences = bare_sequences()
    trainer = padded_trainer_class()(bare_settings(precision="bf16"))
    batch = make_batch(sequences, plain_logprobs(trainer, sequences))
    try:
        result = {"train_step_loss": trainer.train_step(batch).loss}
        torch.cuda.synchronize()
        trained = mem_info()
        result["offload_expected_bytes"] = expected = offload_bytes(trainer)
        result["offload_reported_bytes"] = trainer.offload_training_state()
        offloaded = mem_info()
        trainer.reload_training_state()
        reloaded = mem_info()
        result["step_after_reload"] = trainer.train_step(batch).loss
        result["offload_allocated_change"] = allocated_change(trained, offloaded)
        result["reload_allocated_change"] = allocated_change(offloaded, reloaded)
        result["memory"] = {"trained": trained, "offloaded": offloaded, "reloaded": reloaded}
    finally:
        del trainer
        release(ctx)
    expect(result["offload_reported_bytes"] == expected and expected > 0, "the trainer's "
           f"offload reports {result['offload_reported_bytes']} bytes, its gradient buffers "
           f"and optimizer state hold {expected}", result)
    expect(within_offload_tolerance(-result["offload_allocated_change"], expected),
           f"the offload lowered memory_allocated by {-result['offload_allocated_change']} "
           f"bytes, {expected} expected", result)
    expect(within_offload_tolerance(result["reload_allocated_change"], expected),
           f"the reload raised memory_allocated by {result['reload_allocated_change']} bytes, "
           f"{expected} expected", result)
    expect(math.isfinite(result["step_after_reload"]), "the step after the reload is not "
           "finite", result)
    return result


def check_offload(ctx: Context) -> dict:
    """Dry run: the colocated recipe's trainer offloads between steps."""
    result = check_colocated(ctx)
    return {"colocated_trainer_offloads": result["colocated_trainer_offloads"]}


def check_bare_moe_layer(ctx: Context) -> dict:
    return check_moe_layer(ctx, use_transformer_engine=False)


def stage_bare_moe_layer(ctx: Context) -> dict:
    return stage_moe_layer(ctx, use_transformer_engine=False)


# ----------------------------------------------------------------------------- the runner

RUNNERS: dict[str, dict[str, Callable[[Context], dict]]] = {
    "gpu": {"imports": stage_imports, "trainer": stage_trainer, "sglang": stage_sglang,
            "colocated": stage_colocated, "moe_layer": stage_moe_layer,
            "fp8_serving": stage_fp8_serving,
            "bare_imports": stage_bare_imports, "bare_trainer": stage_bare_trainer,
            "logprob_op": stage_logprob_op, "device_collectives": stage_device_collectives,
            "offload": stage_offload, "bare_moe_layer": stage_bare_moe_layer},
    "dry_run": {"imports": stage_imports, "trainer": check_trainer, "sglang": check_sglang,
                "colocated": check_colocated, "moe_layer": check_moe_layer,
                "fp8_serving": check_fp8_serving,
                "bare_imports": stage_bare_imports, "bare_trainer": check_bare_trainer,
                "logprob_op": stage_logprob_op, "device_collectives": check_device_collectives,
                "offload": check_offload, "bare_moe_layer": check_bare_moe_layer},
    "cpu": {"imports": stage_imports, "trainer": stage_trainer_on_cpu, "sglang": check_sglang,
            "colocated": check_colocated, "moe_layer": check_moe_layer,
            "fp8_serving": check_fp8_serving,
            "bare_imports": stage_bare_imports, "bare_trainer": stage_bare_trainer,
            "logprob_op": stage_logprob_op, "device_collectives": stage_device_collectives,
            "offload": check_offload, "bare_moe_layer": check_bare_moe_layer},
}


def budget_s(stage: str) -> float:
    return {**STAGE_BUDGET_S, **BARE_BUDGET_S}[stage]
RECORD_FIELDS = ("stage", "index", "mode", "status", "started", "seconds", "budget_s", "result",
                 "error", "traceback")


@contextlib.contextmanager
def _budget(seconds: float):
    """StageTimeout in this (main) thread after `seconds` (between Python bytecodes: a call
    blocked in C is caught by the run's faulthandler deadline instead)."""
    def expire(signum, frame):
        raise StageTimeout(f"over its {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def run(ctx: Context, stages: list[str], output: Path) -> list[dict]:
    """Run `stages` in STAGES order, fail-fast, appending each stage's record to `output`."""
    records, failed = [], None
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w") as out:
        for index, name in enumerate(s for s in TIERS[ctx.tier] if s in stages):
            record = dict.fromkeys(RECORD_FIELDS)
            record.update(stage=name, index=index, mode=ctx.mode,
                          budget_s=budget_s(name),
                          started=datetime.datetime.now(datetime.timezone.utc).isoformat())
            start = time.perf_counter()
            if failed is not None:
                record.update(status="not_run", error=f"stage {failed} failed first", result={})
            else:
                try:
                    with _budget(budget_s(name)):
                        record["result"] = RUNNERS[ctx.mode][name](ctx)
                    record["status"] = "ok"
                except Exception as exc:  # noqa: BLE001 (recorded; the later stages do not run)
                    record.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                                  traceback=traceback.format_exc()[-6000:],
                                  result=getattr(exc, "result", {}))
                    failed = name
            record["seconds"] = time.perf_counter() - start
            record = _jsonable(record)
            out.write(json.dumps(record) + "\n")
            out.flush()
            records.append(record)
            print(f"gpu_smoke: {index + 1}. {name}: {record['status']} "
                  f"({record['seconds']:.1f} s)"
                  + (f": {record['error']}" if record["status"] == "failed" else ""), flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=sorted(TIERS), default="image",
                        help="image: the GPU image (SGLang, Transformer Engine; a real "
                        "cluster's check); bare: a GPU machine with only its PyTorch and the "
                        "wheels tools/bare_wheels.py carries")
    parser.add_argument("--output", default=None,
                        help="JSON Lines: one record per stage (default "
                        "runs/gpu_smoke.jsonl, or OUTPUT_DIR/gpu_smoke_<tier>.jsonl)")
    parser.add_argument("--output-dir", default=None,
                        help="write OUTPUT_DIR/gpu_smoke_<tier>.jsonl")
    parser.add_argument("--stages", default=None,
                        help="comma-separated subset of the tier's stages (run in their order); "
                        f"image: {','.join(STAGES)}; bare: {','.join(BARE_STAGES)}")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: every stage's configuration only (CI, the image build)")
    parser.add_argument("--cpu", action="store_true",
                        help="with --dry-run: also run stage 2's RLTrainer path on CPU")
    args = parser.parse_args(argv)
    tier_stages = TIERS[args.tier]
    stages = [s for s in (args.stages or ",".join(tier_stages)).split(",") if s]
    unknown = sorted(set(stages) - set(tier_stages))
    if unknown:
        parser.error(f"unknown stages {unknown} for --tier {args.tier}; choose from "
                     f"{','.join(tier_stages)}")
    if args.output is not None and args.output_dir is not None:
        parser.error("pass --output or --output-dir, not both")
    output = Path(args.output) if args.output else \
        Path(args.output_dir) / f"gpu_smoke_{args.tier}.jsonl" if args.output_dir else \
        Path("runs/gpu_smoke.jsonl")
    time_limit_s = TIME_LIMIT_S if args.tier == "image" else BARE_TIME_LIMIT_S
    if args.cpu and not args.dry_run:
        parser.error("--cpu is the CPU stand-in of a dry run: pass --dry-run --cpu")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: run on a GPU machine (the Dockerfile's image), or "
                     "pass --dry-run to check the stages' configuration on CPU")
    mode = "cpu" if args.cpu else "dry_run" if args.dry_run else "gpu"
    if mode == "gpu":
        # Before CUDA starts: the trainer's variables (in-memory hand-over: no expandable
        # segments); the engines get theirs from megatron_rl.rollout.sglang_launch.
        from megatron_rl.platform import environment

        for key, value in environment.trainer_environment(
                cuda_ipc=args.tier == "image").items():
            os.environ.setdefault(key, value)
        # A call blocked in C (a hung collective) never returns to the stage's alarm: dump every
        # thread's stack and exit once the whole run is over its limit.
        faulthandler.dump_traceback_later(time_limit_s + 60, exit=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as work:
        ctx = Context(mode=mode, work=Path(work), tier=args.tier)
        try:
            records = run(ctx, stages, output)
        finally:
            for generator in list(ctx.generators):
                generator.shutdown()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                from megatron_rl.platform import destroy_distributed

                destroy_distributed()
    faulthandler.cancel_dump_traceback_later()
    total = time.perf_counter() - started
    failed = [r["stage"] for r in records if r["status"] == "failed"]
    over = mode == "gpu" and total > time_limit_s
    print(f"gpu_smoke: {output}: {total:.0f} s"
          f"{f', OVER the {time_limit_s} s limit' if over else ''}; "
          f"{'failed: ' + ', '.join(failed) if failed else 'all stages ok'}")
    return 1 if failed or over else 0


if __name__ == "__main__":
    sys.exit(main())
