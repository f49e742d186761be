"""Checkpoint conversion throughput (GB/s) and peak memory against model size.

A synthetic Llama-4 checkpoint of ~2.3 GB (fp32, 5 MoE layers x 16 experts; the largest tensor is
one layer's fused `gate_up_proj`, ~268 MB) is written shard by shard with random values, then
converted HF -> Megatron and Megatron -> HF, each in a fresh subprocess that reports its peak
resident set (ru_maxrss). The baseline is the same subprocess converting the tiny Llama-4 (imports,
process group, layout: the fixed overhead). Acceptance: peak RSS - baseline < 3 x largest tensor,
i.e. memory follows the largest tensor, not the model. The synthetic files are deleted afterwards.

Run: .venv/bin/python benchmarks/convert.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = dict(  # Llama4TextConfig fields; every layer MoE with a shared expert
    vocab_size=32000, hidden_size=1024, intermediate_size=2048, intermediate_size_mlp=4096,
    num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
    tie_word_embeddings=False, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})

# Runs in the subprocess: one conversion, then its peak RSS and the report as one JSON line.
_CHILD = """
import json, resource, sys, torch
sys.path.insert(0, {root!r})
from megatron_rl import convert
direction, source, target = sys.argv[1:4]
convert_fn = {{"hf-to-megatron": convert.convert_hf_to_megatron,
              "megatron-to-hf": convert.convert_megatron_to_hf}}[direction]
report = convert_fn(source, target, progress=False)
print(json.dumps({{"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "bytes": report.num_bytes, "seconds": report.seconds}}))
"""


def _write_synthetic(directory: Path, config: dict) -> tuple[int, int]:
    """Random weights, one safetensors shard per layer (never the whole model in memory).
    Returns (total bytes, largest tensor bytes)."""
    from safetensors.torch import save_file
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    hf_config = Llama4TextConfig(**config)
    with torch.device("meta"):
        meta_model = Llama4ForCausalLM(hf_config)
    shapes = {n: (t.shape, t.dtype) for n, t in meta_model.state_dict().items()}
    shards: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "other"
        shards.setdefault(layer, []).append(name)
    weight_map, total, largest = {}, 0, 0
    generator = torch.Generator().manual_seed(0)
    for i, (shard, names) in enumerate(shards.items()):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: 0.02 * torch.randn(shapes[n][0], generator=generator) for n in names}
        save_file(tensors, directory / file, metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file
            total += tensor.nbytes
            largest = max(largest, tensor.nbytes)
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config_json = hf_config.to_dict()
    config_json["architectures"] = ["Llama4ForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config_json))
    return total, largest


def _run(direction: str, source: Path, target: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(REPO_ROOT)), direction,
                             str(source), str(target)], env=env, capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{direction} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    import models
    from transformers import Llama4ForCausalLM

    root = Path(tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        tiny = root / "tiny"
        Llama4ForCausalLM(models.get_model_family("llama4").converter().hf_text_config_from_dict(
            models.get_model_family("llama4").hf_config("tiny"))).save_pretrained(tiny)
        baseline = {"hf-to-megatron": _run("hf-to-megatron", tiny, root / "tiny_mg")}
        baseline["megatron-to-hf"] = _run("megatron-to-hf", root / "tiny_mg", root / "tiny_back")
        synthetic = root / "synthetic"
        synthetic.mkdir()
        total, largest = _write_synthetic(synthetic, SYNTHETIC)
        results = {"hf-to-megatron": _run("hf-to-megatron", synthetic, root / "synthetic_mg")}
        shutil.rmtree(synthetic)  # keep disk use to two copies
        results["megatron-to-hf"] = _run("megatron-to-hf", root / "synthetic_mg",
                                         root / "synthetic_back")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = 1e9
    print(f"synthetic Llama-4 checkpoint: {total / gb:.2f} GB fp32, largest tensor "
          f"{largest / gb:.3f} GB ({total / largest:.1f}x smaller than the model)")
    print(f"{'direction':<16}{'GB/s':>8}{'peak RSS GB':>13}{'baseline GB':>13}"
          f"{'(peak-base)/largest':>21}{'peak/model':>12}{'< 3x?':>7}")
    for direction, run in results.items():
        extra = run["peak_rss"] - baseline[direction]["peak_rss"]
        ratio = extra / largest
        print(f"{direction:<16}{run['bytes'] / gb / run['seconds']:>8.2f}"
              f"{run['peak_rss'] / gb:>13.2f}{baseline[direction]['peak_rss'] / gb:>13.2f}"
              f"{ratio:>21.2f}{run['peak_rss'] / total:>12.2f}{'yes' if ratio < 3 else 'NO':>7}")


if __name__ == "__main__":
    main()
