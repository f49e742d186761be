"""The checkpoint the generators load: model.hf_checkpoint itself (rollout.precision bf16), or,
with rollout.precision fp8, an FP8 copy of it written once per run in
<output_dir>/served_fp8 (the run directory, which every node of a run reads: the trainer's start
checkpoint lives there too). The trainer keeps starting from the bf16 model.hf_checkpoint.

The copy is what an FP8 checkpoint on disk is for SGLang 0.5.23: config.json with a
`quantization_config` ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [n, n]} and "scale_fmt": "ue8m0" when asked; the keys
sglang/srt/layers/quantization/fp8.py Fp8Config.from_config reads), and safetensors shards of the
same names in which every tensor SGLang holds in FP8 (megatron_rl.weight_sync.fp8.fp8_quantized)
is replaced by its fp8 weight and scale from the weight sync's own quantiser (Llama-4's fused
experts unfused per expert first), the rest copied as they are; the tokenizer and every other
file copied. The engines start from it, so their FP8 parameters hold the start weights before
the first sync, and every later sync writes the same layout into them.

A resume (or a restarted driver) reuses the copy when its content key matches: the source
files (names, sizes, modification times) and the quantization_config. It is written into a
temporary folder and renamed into place, so a crash never leaves a half-written copy that a
later run would take.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from megatron_rl.weight_sync.fp8 import SERVED_FP8_DIR as SERVED_DIR

KEY_FILE = "megatron_rl_served.json"  # the content key of a finished copy


def served_model_dir(rollout, model_dir: str, out: Path) -> str:
    """The folder the generators load (absolute): `model_dir` for bf16; for fp8 the FP8 copy in
    `out`/served_fp8, written unless an up-to-date one is there."""
    from megatron_rl.weight_sync.fp8 import served_quantization_config

    quantization_config = served_quantization_config(rollout)
    if quantization_config is None:
        return model_dir
    return str(write_fp8_checkpoint(model_dir, Path(out) / SERVED_DIR, quantization_config))


def content_key(source: Path, quantization_config: dict) -> str:
    """What the copy is made of: every source file's name, size and modification time, and the
    quantization_config."""
    digest = hashlib.sha256(json.dumps(quantization_config, sort_keys=True).encode())
    for path in sorted(p for p in source.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def write_fp8_checkpoint(source: str | Path, target: str | Path,
                         quantization_config: dict) -> Path:
    """`source` (a bf16 / fp32 HF checkpoint) as an FP8 checkpoint in `target` for SGLang's FP8
    loader; returns `target`, absolute. Nothing is written when `target` holds a finished copy
    with the same content key."""
    source, target = Path(source).resolve(), Path(target).resolve()
    key = content_key(source, quantization_config)
    if _read_key(target) == key:
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    quantiser = _Quantiser(config, quantization_config)
    weight_map = {}
    from megatron_rl.console import notice, progress

    shards = sorted(p for p in source.iterdir() if p.name.endswith(".safetensors"))
    # Once per run (a resume reuses it), but long for a large model: Scout's ~200 GB are read,
    # quantised on the CPU and written again before the engines can start.
    notice(f"writing the generators' FP8 copy of {source} into {target} "
           f"({sum(p.stat().st_size for p in shards) / 1e9:.1f} GB in {len(shards)} shard(s))")
    for path in progress(shards, desc="FP8 copy", unit="shard", line_every_s=30):
        for name in quantiser.write_shard(path, staging / path.name):
            weight_map[name] = path.name
    for path in sorted(source.iterdir()):
        if path.name.endswith(".safetensors"):
            continue  # quantised above
        elif path.name == "config.json" or path.name.endswith(".safetensors.index.json"):
            continue  # written below
        elif path.is_file():
            shutil.copy2(path, staging / path.name)
    config["quantization_config"] = quantization_config
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    if len(set(weight_map.values())) > 1:
        (staging / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    (staging / KEY_FILE).write_text(json.dumps({"source": str(source), "key": key,
                                                "quantization_config": quantization_config}))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _read_key(target: Path) -> str | None:
    try:
        return json.loads((target / KEY_FILE).read_text())["key"]
    except (OSError, ValueError, KeyError):
        return None


class _Quantiser:
    """The weight sync's FP8 step applied to a checkpoint's tensors (weight_sync/fp8.py)."""

    def __init__(self, config: dict, quantization_config: dict):
        from megatron_rl.weight_sync import fp8

        self.fp8 = fp8
        self.quantization_config = quantization_config
        self.layout = fp8.Fp8Layout.from_quantization_config(quantization_config)
        text = config.get("text_config") or config
        self.llama4 = text.get("model_type") == "llama4_text"
        if self.llama4:
            head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
            fp8.check_llama4_block_rows(self.layout, head_dim)

    def write_shard(self, source: Path, target: Path) -> list[str]:
        """One safetensors shard quantised into `target`; returns the names written."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        out = {}
        with safe_open(str(source), framework="pt") as handle:
            names = list(handle.keys())
            # The sync's own step (fp8_quantized, Llama-4's experts unfused, quantize_named).
            quantiser = self.fp8.SyncQuantiser(self.quantization_config, names)
            for name in names:
                tensor = handle.get_tensor(name)
                if name in quantiser.quantised and name.rpartition(".")[2] != "weight" \
                        and not self.llama4:  # a fused expert tensor
                    raise ValueError(f"{source.name}: {name} is a fused expert tensor of "
                                     "a model that is not Llama-4; only Llama-4's fused "
                                     "layout is known here (others store experts one by "
                                     "one: `experts.{e}.gate_proj.weight`)")
                out.update(quantiser.quantize(name, tensor) or {name: tensor})
        save_file({n: t.contiguous() for n, t in out.items()}, str(target),
                  metadata={"format": "pt"})
        return list(out)
