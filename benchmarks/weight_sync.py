"""Weight-sync throughput: a full trainer -> generator sync vs a raw torch.distributed broadcast
of the same number of bytes, measured in the same run.

Setup: a dense Llama-3 HF model of a few hundred MB (fp32; the models registry's "llama" family,
its tiny config resized) served by one SGLang CPU server, at engine TP1 and then engine TP2 (one
server at a time; at TP2 the weight-update group has both engine ranks, each receives every
bucket and loads its half); a 2-rank Megatron trainer (TP1 or TP2, torchrun) built by that family
from the same HF config. The full sync gathers the TP shards, converts names and layouts with the
mapping, packs buckets and broadcasts them over the gloo weight-update group to the server, which
loads them. The baseline broadcasts the same bytes, in the same bucket sizes, from trainer rank 0
to trainer rank 1 over gloo (one sender, one receiver, loopback: the same transport without
gather, conversion or loading). Syncs and baseline broadcasts alternate (`--repeats`, >= 3), so
that noise hits both alike. Prints, per (engine TP, trainer TP, bucket size): the sync's bytes/s,
the baseline's, their ratio, the sync's spread (min-max seconds), its time split, and the floor a
sync cannot go below (transfer + load: SGLang receives a bucket, then loads it, on one thread).

Run: .venv/bin/python benchmarks/weight_sync.py [--hidden 1024 --layers 6 --buckets 64,256
     --engine-tp 1,2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def save_model(directory: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import LlamaForCausalLM

    from models import get_model_family

    family = get_model_family("llama")
    config = family.converter().hf_text_config_from_dict(dict(
        family.hf_config("tiny"), vocab_size=vocab, hidden_size=hidden,
        intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64,
        initializer_range=0.02))
    with torch.device("meta"):
        num_params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return num_params * 4


def worker(args) -> None:
    import statistics

    import torch.distributed as dist

    from megatron_rl.rollout import SGLangGenerator
    from megatron_rl.trainer import (OptimizerSettings, ParallelLayout, RLTrainer,
                                     TrainerSettings)
    from megatron_rl.weight_sync import WeightSync, WeightSyncSettings
    from models import model_family_for_hf_config

    family = model_family_for_hf_config(json.loads((Path(args.model_dir) / "config.json")
                                                   .read_text()))
    generator = SGLangGenerator(args.url, num_ranks=None, request_timeout_s=600)
    rows, raw_buffers = [], {}
    for tp in [int(t) for t in args.tp.split(",")]:
        # 2 trainer ranks either way (TP1: two data-parallel replicas, one of them sends).
        trainer = RLTrainer(TrainerSettings(
            model_name="bench", model_size="-", precision="fp32",
            layout=ParallelLayout(tensor_model_parallel_size=tp),
            optimizer=OptimizerSettings(use_distributed_optimizer=False)), family=family)
        for bucket_mb in [int(b) for b in args.buckets.split(",")]:
            sync = WeightSync(trainer.model, family.weight_groups(), [generator],
                              WeightSyncSettings(bucket_bytes=bucket_mb * 2**20, timeout_s=600),
                              hf_vocab_size=family.hf_config.vocab_size)
            sync.sync()  # warm-up: group creation, first-touch allocations
            reports, raws = [], []
            for _ in range(args.repeats):  # alternate, so that noise hits both alike
                reports.append(sync.sync())
                num_bytes = torch.tensor([reports[-1].num_bytes])
                dist.broadcast(num_bytes, src=0)
                raws.append(raw_broadcast_seconds(int(num_bytes), bucket_mb * 2**20,
                                                  raw_buffers))
            report = sorted(reports, key=lambda r: r.seconds)[len(reports) // 2]  # the median
            if dist.get_rank() == 0:
                rows.append(dict(engine_tp=generator.num_ranks, tp=tp, bucket_mb=bucket_mb,
                                 num_bytes=report.num_bytes, num_buckets=report.num_buckets,
                                 sync_s=report.seconds,
                                 sync_min_s=min(r.seconds for r in reports),
                                 sync_max_s=max(r.seconds for r in reports),
                                 raw_s=statistics.median(raws), gather_s=report.gather_s,
                                 convert_s=report.convert_s, transfer_s=report.transfer_s,
                                 load_s=report.load_s, control_s=report.control_s))
            sync.close()
        del trainer
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()


def raw_broadcast_seconds(num_bytes: int, bucket_bytes: int, buffers: dict) -> float:
    """Broadcast `num_bytes` from rank 0 to rank 1 (gloo, the trainer world) in buckets, from and
    into one warm buffer (allocated and touched before the clock starts: the best case)."""
    import torch.distributed as dist

    size = min(bucket_bytes, num_bytes)
    buffer = buffers.get(size)
    if buffer is None:
        buffer = buffers[size] = torch.ones(size, dtype=torch.uint8)
        dist.broadcast(buffer, src=0)  # warm-up: connection and pages on both ranks
    dist.barrier()
    start = time.perf_counter()
    sent = 0
    while sent < num_bytes:
        chunk = min(bucket_bytes, num_bytes - sent)
        dist.broadcast(buffer[:chunk], src=0)
        sent += chunk
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--buckets", default="64,256", help="bucket sizes in MiB")
    parser.add_argument("--tp", default="1,2", help="trainer tensor-parallel sizes (2 ranks)")
    parser.add_argument("--engine-tp", default="1,2", help="SGLang engine tp_size, one server "
                        "after the other")
    parser.add_argument("--repeats", type=int, default=3, help="alternating syncs and raw "
                        "broadcasts per row (>= 3); the table shows medians and the spread")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be >= 3 (a median and a spread)")
    if args.worker:
        return worker(args)

    from megatron_rl.rollout import SGLangGenerator, SGLangServerSettings

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_bytes = save_model(model_dir, args.hidden, args.layers, args.vocab)
        print(f"model: {model_bytes / 2**20:.0f} MiB fp32 (hidden {args.hidden}, "
              f"{args.layers} layers, vocab {args.vocab})", flush=True)
        rows = []
        for engine_tp in [int(t) for t in args.engine_tp.split(",")]:
            rows += run_engine(args, model_dir, engine_tp, Path(tmp))
    print_table(rows)


def run_engine(args, model_dir: Path, engine_tp: int, tmp: Path) -> list[dict]:
    """Serve the model at `engine_tp` (CPU: one core per rank, set by SGLangServerSettings) and
    run the trainer launch against it; its rows."""
    from megatron_rl.rollout import SGLangGenerator, SGLangServerSettings

    generator = SGLangGenerator.launch(SGLangServerSettings(
        model_path=str(model_dir), dtype="float32", tp_size=engine_tp, mem_fraction_static=0.2,
        max_total_tokens=2048, startup_timeout_s=600,
        log_path=str(tmp / f"sglang_tp{engine_tp}.log")))
    try:
        out = tmp / f"rows_tp{engine_tp}.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                        "2", "--master-port", "29741", __file__, "--worker", "--model-dir",
                        str(model_dir), "--url", generator.url, "--out", str(out),
                        "--buckets", args.buckets, "--tp", args.tp,
                        "--repeats", str(args.repeats)], check=True, env=env, cwd=ROOT,
                       timeout=1800)
        return json.loads(out.read_text())
    finally:
        generator.shutdown()


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="weight sync vs raw gloo broadcast of the same bytes (same run; medians)")
    for column in ("engine TP", "trainer TP", "bucket MiB", "MiB", "buckets", "sync MiB/s",
                   "raw MiB/s", "ratio", "sync s", "spread s", "gather s", "convert s",
                   "transfer s", "load s", "floor s", "control s"):
        table.add_column(column, justify="right")
    for row in rows:
        mib = row["num_bytes"] / 2**20
        table.add_row(str(row["engine_tp"]), str(row["tp"]), str(row["bucket_mb"]), f"{mib:.0f}",
                      str(row["num_buckets"]), f"{mib / row['sync_s']:.0f}",
                      f"{mib / row['raw_s']:.0f}", f"{row['raw_s'] / row['sync_s']:.2f}x",
                      f"{row['sync_s']:.2f}", f"{row['sync_min_s']:.2f}-{row['sync_max_s']:.2f}",
                      f"{row['gather_s']:.2f}", f"{row['convert_s']:.2f}",
                      f"{row['transfer_s']:.2f}", f"{row['load_s']:.2f}",
                      f"{row['transfer_s'] + row['load_s']:.2f}", f"{row['control_s']:.2f}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
