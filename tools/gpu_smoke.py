#!/usr/bin/env python
"""The GPU paths on one NVIDIA GPU, in under 8 minutes, written to a JSON report.

Usage: python tools/gpu_smoke.py [--output runs/gpu_smoke.json] [--dry-run] [--sections ...]

Sections (each timed; one that fails is recorded with its error and the others still run; the exit
status is 1 if any failed):
- te_slice: a 2-layer slice of Llama-4 Scout (its widths, `--experts` routed experts, chunked
  attention + q/k L2 norm) built with the Transformer Engine layer spec, forward and backward in
  bf16 and, where the GPU supports it, FP8 (MXFP8 block scaling on Blackwell, delayed scaling on
  Hopper / Ada), each against the same weights in fp32 (TE layers in fp32): relative error of the
  output and of every gradient, step time, peak memory.
- logprob_head: the chunked FP32 log-prob op (megatron_rl/ops/logprobs.py) against a plain bf16
  LM head that materialises [tokens, vocab] logits, at Scout's vocabulary: peak memory, time of
  forward + backward, and each one's error against an fp64 reference on a subset of tokens.
- sglang_sync: an SGLang CUDA engine serving a dense Llama (~1.2 B parameters, bf16) beside a
  Megatron trainer of the same model on the same GPU: generate (tokens/s), the weight sync
  (seconds, GiB/s) against a raw copy of the same bytes, and the generator/trainer log-prob
  mismatch on the generator's own samples after the sync. NCCL refuses two ranks of one group
  on one GPU, so with one GPU the sync uses the colocated in-memory transport (CUDA IPC) and the
  baseline is a device-to-device copy of the same bytes; with two or more GPUs the engine runs on
  GPU 1, the sync goes over NCCL and the baseline is a raw NCCL broadcast GPU 0 -> GPU 1.

`--dry-run` (CPU, CI) runs every import and configuration path without a GPU: the slice's
TransformerConfig and TE layer spec (placeholder classes where TE is absent), the precision and
FP8 selections, the log-prob op at a tiny size against the bf16-style head, the SGLang server
arguments (through SGLang's own parser) and the weight-sync settings. The Dockerfile runs it at the end of the build.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECTIONS = ("te_slice", "logprob_head", "sglang_sync")
TIME_LIMIT_S = 480.0  # the promise: the whole smoke test in under 8 minutes
SCOUT_VOCAB = 202048
SCOUT_HIDDEN = 5120
# The sglang_sync model: Llama-3.2-1B's widths (a dense Llama the registry's "llama" family maps).
SYNC_MODEL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SmokeSettings:
    dry_run: bool = False
    experts: int = 4  # routed experts in the Scout slice (Scout has 16; fewer keeps it small)
    sequence_length: int = 4096  # te_slice tokens (one sequence)
    logprob_tokens: int = 8192
    logprob_chunk: int = 1024
    reference_tokens: int = 256  # logprob_head rows checked against fp64
    bucket_mb: int = 512
    num_syncs: int = 3
    mem_fraction_static: float = 0.3  # the engine's share of the GPU (the trainer shares it)


# ----------------------------------------------------------------------------- helpers

def _cuda_timed(fn, *, repeats: int = 3) -> tuple[float, object]:
    """Median seconds of `fn()` over `repeats` runs after one warm-up, and its last result."""
    import torch

    result = fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], result


def _peak_gib(fn) -> tuple[float, object]:
    """Peak GPU memory above what was allocated before `fn()`, in GiB, and its result."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30, result


def _relative_error(value, reference) -> float:
    value, reference = value.double(), reference.double()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), num_gpus=torch.cuda.device_count(),
                    compute_capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory
                                         / 2**30, 1),
                    nccl=str(torch.cuda.nccl.version()))
    for package in ("megatron-core", "transformer-engine", "sglang", "sglang-kernel",
                    "flashinfer-python", "apex"):
        try:
            import importlib.metadata as md

            info[package] = md.version(package)
        except Exception:  # noqa: BLE001 (absent on CPU)
            info[package] = None
    return info


def fp8_choice() -> dict:
    """Which FP8 recipe this GPU runs (None with the reason when it has none): MXFP8 block
    scaling from compute capability 10 (Blackwell), per-tensor delayed scaling from 8.9 (Ada,
    Hopper); Transformer Engine's own check has the last word where this TE version offers it."""
    import importlib

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
        check = getattr(module, "check_mxfp8_support" if recipe == "mxfp8" else
                        "check_fp8_support", None)
        if check is not None:
            supported, reason = check()
            if not supported and recipe == "mxfp8":  # Blackwell without MXFP8: per-tensor
                return {"recipe": "delayed", "reason": f"Transformer Engine: MXFP8 {reason}"}
            if not supported:
                return {"recipe": None, "reason": f"Transformer Engine: {reason}"}
            return {"recipe": recipe, "reason": f"{module_name}.{check.__name__}: supported"}
    return {"recipe": recipe, "reason": f"compute capability {capability} (no TE check found)"}


# ----------------------------------------------------------------------------- te_slice

def slice_config(settings: SmokeSettings, precision: str, fp8_recipe: str | None, *,
                 te_available: bool):
    """The Scout slice's TransformerConfig for one precision (TE layer spec)."""
    from megatron_rl.trainer.model import precision_overrides
    from models import get_model_family

    choice = precision_overrides(precision, fp8_recipe=fp8_recipe, use_transformer_engine=True,
                                 transformer_engine_available=te_available)
    config = get_model_family("llama4").transformer_config(
        "scout", use_transformer_engine=True, num_layers=2, num_moe_experts=settings.experts,
        hidden_dropout=0.0, attention_dropout=0.0,
        # Plain .grad (no DDP wrapper to allocate main_grad for TE's fused accumulation).
        gradient_accumulation_fusion=False, **choice.overrides)
    return choice, config


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


def te_slice_dry_run(settings: SmokeSettings) -> dict:
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    from megatron_rl.trainer.model import precision_overrides
    from models import get_model_family

    result = {}
    for precision in ("fp32", "bf16"):
        _, config = slice_config(settings, precision, None, te_available=True)
        result[precision] = {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                             "num_moe_experts": config.num_moe_experts,
                             "params_dtype": str(config.params_dtype)}
    spec = get_model_family("llama4").layer_spec(config, use_transformer_engine=True, pp_rank=0)
    classes = _spec_classes(spec.submodules.layer_specs[0])
    result["layer_spec"] = classes
    result["te_placeholders"] = sorted(k for k, v in classes.items() if v == "MagicMock")
    # FP8: the fields each recipe sets (TransformerConfig itself checks TE's version, GPU only).
    result["fp8_fields"] = {
        recipe: precision_overrides("bf16", fp8_recipe=recipe, use_transformer_engine=True,
                                    transformer_engine_available=True).overrides
        for recipe in ("delayed", "mxfp8")}
    result["fp8_fields"] = {k: {f: str(v) for f, v in o.items() if f.startswith("fp8")}
                            for k, o in result["fp8_fields"].items()}
    return result


def te_slice(settings: SmokeSettings) -> dict:
    import torch

    from megatron_rl.platform import has_transformer_engine, init_distributed
    from models import get_model_family

    if not has_transformer_engine():
        raise RuntimeError("Transformer Engine does not import: run inside the Dockerfile's image")
    torch.cuda.empty_cache()
    init_distributed(seed=1234)
    family = get_model_family("llama4")
    fp8 = fp8_choice()
    device = torch.device("cuda")
    generator = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, SCOUT_VOCAB, (1, settings.sequence_length), generator=generator)
    tokens = tokens.to(device)
    positions = torch.arange(settings.sequence_length, device=device)[None]
    projection = torch.randn(SCOUT_HIDDEN, generator=generator).to(device)

    def build(precision: str, recipe: str | None):
        _, config = slice_config(settings, precision, recipe, te_available=True)
        # Hidden states out (post_process=False): the LM head is logprob_head's subject.
        return family.build_model(config, pre_process=True, post_process=False,
                                  use_transformer_engine=True).to(device)

    def step(model):
        model.zero_grad(set_to_none=True)
        hidden = model(tokens, positions, None)  # [seq, 1, hidden]
        loss = (hidden.float() @ projection).square().mean()
        loss.backward()
        return hidden.detach().float(), {n: p.grad.detach().float().clone()
                                         for n, p in model.named_parameters()
                                         if p.grad is not None}

    reference_model = build("fp32", None)
    state = {k: v.detach().cpu() for k, v in reference_model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}  # TE FP8 meta
    ref_s, (ref_out, ref_grads) = _cuda_timed(lambda: step(reference_model))
    result = {"fp8": fp8, "num_parameters": sum(p.numel() for p in reference_model.parameters()),
              "sequence_length": settings.sequence_length, "experts": settings.experts,
              "fp32": {"step_s": ref_s}}
    del reference_model
    torch.cuda.empty_cache()
    runs = [("bf16", None)] + ([("fp8_" + fp8["recipe"], fp8["recipe"])] if fp8["recipe"]
                               else [])
    for name, recipe in runs:
        model = build("bf16", recipe)
        loaded = model.load_state_dict(state, strict=False)
        missing = [k for k in loaded.missing_keys if not k.endswith("_extra_state")]
        if missing or loaded.unexpected_keys:
            raise RuntimeError(f"{name} slice: the fp32 weights do not fit: missing {missing}, "
                               f"unexpected {loaded.unexpected_keys}")
        peak, (seconds, (out, grads)) = _peak_gib(lambda: _cuda_timed(lambda: step(model)))
        errors = {n: _relative_error(g, ref_grads[n]) for n, g in grads.items()}
        worst = max(errors, key=errors.get)
        result[name] = {"step_s": seconds, "peak_gib": peak,
                        "output_rel_err": _relative_error(out, ref_out),
                        "grad_rel_err_median": sorted(errors.values())[len(errors) // 2],
                        "grad_rel_err_max": errors[worst], "grad_rel_err_worst": worst}
        del model, out, grads
        torch.cuda.empty_cache()
    return result


# ----------------------------------------------------------------------------- logprob_head

def _bf16_head_logprobs(hidden, weight, targets):
    """The plain head: [tokens, vocab] logits in bf16, log-softmax in FP32 (materialised)."""
    import torch

    logits = hidden @ weight.t()  # [tokens, vocab] in the inputs' dtype
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


def _fp64_reference(hidden, weight, targets):
    import torch

    logits = hidden.double() @ weight.double().t()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def logprob_head(settings: SmokeSettings) -> dict:
    import torch

    from megatron_rl.ops.logprobs import chunked_logprobs

    device = "cpu" if settings.dry_run else "cuda"
    if not settings.dry_run:
        torch.cuda.empty_cache()  # what te_slice left cached would count in no peak, but crowd
    tokens, vocab, width = ((64, 512, 32) if settings.dry_run else
                            (settings.logprob_tokens, SCOUT_VOCAB, SCOUT_HIDDEN))
    chunk = 16 if settings.dry_run else settings.logprob_chunk
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(tokens, width, generator=generator)).to(device, torch.bfloat16)
    weight = (torch.randn(vocab, width, generator=generator) * width ** -0.5).to(
        device, torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=generator).to(device)

    def chunked():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, _ = chunked_logprobs(h, w, targets, chunk_size=chunk, compute_entropy=False)
        logp.sum().backward()
        return logp.detach()

    def plain():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = _bf16_head_logprobs(h, w, targets)
        logp.sum().backward()
        return logp.detach()

    rows = slice(0, min(settings.reference_tokens, tokens))
    reference = _fp64_reference(hidden[rows], weight, targets[rows])
    result = {"tokens": tokens, "vocab": vocab, "hidden": width, "chunk_size": chunk,
              "plain_logits_gib": tokens * vocab * 4 / 2**30}
    for name, fn in (("chunked_fp32", chunked), ("bf16_head", plain)):
        if settings.dry_run:
            seconds, peak, logp = None, None, fn()
        else:
            peak, (seconds, logp) = _peak_gib(lambda fn=fn: _cuda_timed(fn))
        result[name] = {"seconds": seconds, "peak_gib": peak,
                        "max_abs_err_vs_fp64": float((logp[rows].double() - reference)
                                                     .abs().max())}
    if not settings.dry_run:
        result["memory_ratio"] = result["bf16_head"]["peak_gib"] / result["chunked_fp32"][
            "peak_gib"]
        result["time_ratio"] = result["chunked_fp32"]["seconds"] / result["bf16_head"][
            "seconds"]
    return result


# ----------------------------------------------------------------------------- sglang_sync

def _save_sync_model(directory: Path) -> Path:
    """A random dense Llama in bf16 (the registry's llama family, SYNC_MODEL's widths)."""
    import torch
    from transformers import LlamaForCausalLM

    from models import get_model_family

    family = get_model_family("llama")
    config = family.converter().hf_text_config_from_dict(dict(
        family.hf_config("tiny"), **SYNC_MODEL, initializer_range=0.02,
        max_position_embeddings=131072))
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("cuda" if torch.cuda.is_available() else "meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if torch.cuda.is_available():
        model.save_pretrained(directory)
    else:  # dry run: config only (server arguments are built from it)
        directory.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(directory)
    return directory


def sync_plan(settings: SmokeSettings, model_dir: Path, num_gpus: int) -> dict:
    """Transport, server and weight-sync settings for this machine's GPU count."""
    import torch

    from megatron_rl.rollout import SGLangServerSettings
    from megatron_rl.weight_sync import WeightSyncSettings

    separate_gpu = num_gpus >= 2
    server = SGLangServerSettings(
        model_path=str(model_dir), dtype="bfloat16", device="cuda",
        mem_fraction_static=settings.mem_fraction_static, context_length=4096,
        visible_devices=("1",) if separate_gpu else ("0",), startup_timeout_s=300,
        request_timeout_s=300, log_path=str(model_dir.parent / "sglang.log"))
    sync = WeightSyncSettings(transport="distributed" if separate_gpu else "tensor",
                              dtype=torch.bfloat16, bucket_bytes=settings.bucket_mb * 2**20,
                              backend="nccl" if separate_gpu else None, timeout_s=300)
    return {"server": server, "sync": sync,
            "baseline": "nccl_broadcast" if separate_gpu else "device_copy"}


def parse_with_sglang(args: list[str]) -> dict:
    """The server arguments through SGLang's own command-line parser (every flag must exist in
    the installed SGLang, every value must parse) -> the parsed fields."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return vars(parser.parse_args(args))


def _nccl_broadcast_worker(rank: int, port: int, num_bytes: int, bucket_bytes: int, queue):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    buffer = torch.ones(min(bucket_bytes, num_bytes), dtype=torch.uint8, device="cuda")
    dist.broadcast(buffer, src=0)  # warm-up: connection and channels
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        sent = 0
        while sent < num_bytes:
            size = min(bucket_bytes, num_bytes - sent)
            dist.broadcast(buffer[:size], src=0)
            sent += size
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(sorted(times)[1])
    dist.destroy_process_group()


def raw_baseline_seconds(kind: str, num_bytes: int, bucket_bytes: int) -> float:
    """Seconds to move `num_bytes` in buckets without gather, conversion or loading."""
    import torch

    if kind == "device_copy":
        source = torch.ones(min(bucket_bytes, num_bytes), dtype=torch.uint8, device="cuda")
        target = torch.empty_like(source)

        def copy():
            sent = 0
            while sent < num_bytes:
                size = min(bucket_bytes, num_bytes - sent)
                target[:size].copy_(source[:size])
                sent += size

        seconds, _ = _cuda_timed(copy)
        return seconds
    import torch.multiprocessing as mp

    from megatron_rl.rollout.sglang_server import free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(_nccl_broadcast_worker, nprocs=2, join=True, start_method="spawn",
                       args=(free_port(), num_bytes, bucket_bytes, queue))
    return queue.get(timeout=60)


def sglang_sync(settings: SmokeSettings) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as work:
        return _sglang_sync_in(settings, Path(work) / "model")


def _sglang_sync_in(settings: SmokeSettings, model_dir: Path) -> dict:
    import torch

    from megatron_rl.rollout import SamplingParams, SGLangGenerator
    from megatron_rl.trainer import (OptimizerSettings, RLTrainer, TrainBatch,
                                     TrainerSettings)
    from megatron_rl.weight_sync import WeightSync
    from models import model_family_for_hf_config

    if settings.dry_run:
        _save_sync_model(model_dir)
        plan = sync_plan(settings, model_dir, num_gpus=1)
        plan2 = sync_plan(settings, model_dir, num_gpus=2)
        family = model_family_for_hf_config(json.loads((model_dir / "config.json").read_text()))
        parsed = parse_with_sglang(plan["server"].server_args(port=30000))
        return {"server_args": plan["server"].server_args(port=30000),
                "sglang_parsed": {k: str(parsed[k]) for k in (
                    "device", "dtype", "mem_fraction_static", "enable_fp32_lm_head")},
                "transport_1_gpu": plan["sync"].transport, "baseline_1_gpu": plan["baseline"],
                "transport_2_gpus": plan2["sync"].transport,
                "baseline_2_gpus": plan2["baseline"], "family": family.family.name,
                "num_weight_groups": len(family.weight_groups())}
    started = time.perf_counter()
    _save_sync_model(model_dir)
    torch.cuda.empty_cache()
    plan = sync_plan(settings, model_dir, num_gpus=torch.cuda.device_count())
    generator = SGLangGenerator.launch(plan["server"])
    result = {"transport": plan["sync"].transport, "baseline": plan["baseline"],
              "model": SYNC_MODEL}
    try:
        result["server_start_s"] = time.perf_counter() - started
        family = model_family_for_hf_config(json.loads((model_dir / "config.json").read_text()))
        trainer = RLTrainer(TrainerSettings(
            model_name="llama", model_size="-", precision="bf16",
            optimizer=OptimizerSettings(use_distributed_optimizer=False),
            micro_batch_max_tokens=8192), family=family)
        prompts = [[int(t) for t in torch.randint(10, 30000, (64,))] for _ in range(16)]
        params = SamplingParams(max_new_tokens=256, temperature=1.0, num_samples=4, seed=1,
                                ignore_eos=True)
        start = time.perf_counter()
        generator.generate(prompts, params)
        seconds = time.perf_counter() - start
        result["generate"] = {"sequences": 64, "new_tokens": 64 * 256, "seconds": seconds,
                              "tokens_per_s": 64 * 256 / seconds}
        sync = WeightSync(trainer.model, family.weight_groups(), [generator], plan["sync"],
                          hf_vocab_size=family.hf_config.vocab_size)
        sync.sync()  # warm-up: group creation, first-touch allocations
        reports = sorted((sync.sync() for _ in range(settings.num_syncs)),
                         key=lambda r: r.seconds)
        report = reports[len(reports) // 2]
        raw = raw_baseline_seconds(plan["baseline"], report.num_bytes,
                                   settings.bucket_mb * 2**20)
        result["sync"] = {"num_bytes": report.num_bytes, "num_buckets": report.num_buckets,
                          "seconds": report.seconds,
                          "gib_per_s": report.num_bytes / 2**30 / report.seconds,
                          "baseline_seconds": raw,
                          "baseline_gib_per_s": report.num_bytes / 2**30 / raw,
                          "ratio_to_baseline": raw / report.seconds,
                          "split_s": {k: getattr(report, k) for k in (
                              "gather_s", "convert_s", "transfer_s", "load_s", "control_s")}}
        sampled = generator.generate(prompts[:8], SamplingParams(
            max_new_tokens=128, temperature=1.0, num_samples=2, seed=2, ignore_eos=True))
        batch = _generator_batch(sampled, TrainBatch)
        scored = trainer.score(batch)
        result["logp_mismatch"] = {"mean_abs": scored.abs_logp_diff_sum
                                   / max(scored.num_loss_tokens, 1),
                                   "max_abs": scored.abs_logp_diff_max,
                                   "num_tokens": scored.num_loss_tokens}
        sync.close()
    finally:
        generator.shutdown()
    return result


def _generator_batch(results, batch_cls):
    """A TrainBatch of the generator's samples, its log-probs as the old ones."""
    import torch

    ids, masks, old = [], [], []
    for r in results:
        prompt, completion = list(r.prompt_token_ids), list(r.token_ids)
        ids.append(torch.tensor(prompt + completion))
        masks.append(torch.tensor([0.0] * len(prompt) + [1.0] * len(completion)))
        old.append(torch.tensor([0.0] * len(prompt) + list(r.logprobs)))
    return batch_cls(token_ids=ids, loss_mask=masks, old_logprobs=old,
                     advantages=torch.zeros(len(results)),
                     prompt_ids=torch.tensor([r.prompt_index for r in results]),
                     sample_ids=torch.arange(len(results)))


# ----------------------------------------------------------------------------- main

def run(settings: SmokeSettings, sections: list[str]) -> dict:
    report = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "dry_run": settings.dry_run, "settings": dataclasses.asdict(settings),
              "environment": environment(), "sections": {}}
    runners = {"te_slice": te_slice_dry_run if settings.dry_run else te_slice,
               "logprob_head": logprob_head, "sglang_sync": sglang_sync}
    started = time.perf_counter()
    for name in sections:
        section_start = time.perf_counter()
        try:
            entry = {"status": "ok", **runners[name](settings)}
        except Exception as exc:  # noqa: BLE001 (recorded; the other sections still run)
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()[-4000:]}
        entry["section_s"] = time.perf_counter() - section_start
        report["sections"][name] = entry
        print(f"gpu_smoke: {name}: {entry['status']} ({entry['section_s']:.1f} s)"
              + (f": {entry['error']}" if entry["status"] != "ok" else ""), flush=True)
    report["total_s"] = time.perf_counter() - started
    report["within_time_limit"] = report["total_s"] < TIME_LIMIT_S
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/gpu_smoke.json", help="the JSON report")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: imports and configuration paths only (CI)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    defaults = SmokeSettings()
    parser.add_argument("--experts", type=int, default=defaults.experts)
    parser.add_argument("--sequence-length", type=int, default=defaults.sequence_length)
    parser.add_argument("--logprob-tokens", type=int, default=defaults.logprob_tokens)
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: run on a GPU machine (the Dockerfile's image), or "
                     "pass --dry-run to check the configuration paths on CPU")
    settings = SmokeSettings(dry_run=args.dry_run, experts=args.experts,
                             sequence_length=args.sequence_length,
                             logprob_tokens=args.logprob_tokens)
    report = run(settings, sections)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(output)
    failed = [n for n, s in report["sections"].items() if s["status"] != "ok"]
    print(f"gpu_smoke: report {output} ({report['total_s']:.0f} s"
          f"{'' if report['within_time_limit'] else ', OVER the 8-minute limit'}); "
          f"{'failed: ' + ', '.join(failed) if failed else 'all sections ok'}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
