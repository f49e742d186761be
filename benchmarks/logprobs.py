"""Peak memory and time of chunked vs naive FP32 log-probs + entropy at the LM head, forward and
backward (grads for hidden and weight), with the naive full-[tokens, vocab] FP32 path as the
baseline measured in the same run. With --torch-lce, also torch's own chunked
F.linear_cross_entropy (reduction="none"; log-probs only, no entropy) as a library reference.

Each measurement runs in a fresh subprocess so that peaks do not mix. The worker allocates the
inputs, then measures the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs)
of the forward and of the backward separately, as growth above the inputs. "peak" is the larger of
the two; "working" subtracts what every variant must return (the [vocab, hidden] weight grad, the
hidden grad, log-probs, entropy) from the backward peak, i.e. the memory the method itself needs
(exact for chunked, whose backward allocates the weight grad first; a lower bound for naive).
Runs alternate between the variants; the best wall and CPU time of each are kept, to damp the
noise of other processes on a shared machine (--threads 1 damps it further). The workers also
save their results, and every variant is checked against naive.

Target shape: vocab 202,048, hidden 5,120, 8,192 tokens. On a 2-core / 24 GB machine that shape
does not fit (the FP32 weight and its gradient alone are 7.7 GiB; naive needs 3 x 6.2 GiB more
and ~50 TFLOP of GEMMs), so the defaults keep the vocab and scale hidden and tokens; the output
says so. Pass --hidden 5120 --tokens 8192 --chunk-size 1024 to run the target shape elsewhere.

    .venv/bin/python benchmarks/logprobs.py
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TARGET_VOCAB, TARGET_HIDDEN, TARGET_TOKENS = 202_048, 5_120, 8_192
TARGET_MEMORY_RATIO, TARGET_TIME_RATIO = 1 / 8, 1.3
VARIANTS = ("naive", "chunked", "torch_lce")
GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Shape:
    num_tokens: int
    hidden_size: int
    vocab_size: int
    chunk_size: int
    num_threads: int  # torch intra-op threads in the workers; 0: torch's default


@dataclass(frozen=True, slots=True)
class Measurement:
    variant: str
    seconds: float
    cpu_seconds: float  # user + system time of all threads: less sensitive to other processes
    forward_peak_bytes: int  # high-water mark growth above the inputs during the forward
    backward_peak_bytes: int  # the same during the backward (saved tensors of the forward included)
    output_bytes: int  # grads for hidden and weight, log-probs, entropy: what every variant returns

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    @property
    def working_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes - self.output_bytes)


def naive_logprobs(hidden, weight, targets):
    log_probs = torch.log_softmax(hidden.float() @ weight.float().t(), dim=-1)  # [T, V] FP32
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return log_probs.gather(1, targets.unsqueeze(-1)).squeeze(-1), entropy.detach()


def torch_lce_logprobs(hidden, weight, targets, chunk_size):
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size, chunking_method=None)
    loss = torch.nn.functional.linear_cross_entropy(
        hidden, weight, targets, reduction="none", options=options
    )
    return -loss, None


class _ResidentSetPeak:
    """Linux resident-set high-water mark that can be reset (writing 5 to /proc/self/clear_refs)."""

    @staticmethod
    def _status_bytes(field: str) -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
        raise RuntimeError(f"{field} missing from /proc/self/status: this benchmark needs Linux")

    def reset(self) -> int:
        """Resets the high-water mark to the current resident set; returns that."""
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return self._status_bytes("VmRSS")

    def peak(self) -> int:
        return self._status_bytes("VmHWM")


def measure(variant: str, shape: Shape, results_path: Path) -> Measurement:
    """Runs in its own process: inputs, then one forward + backward under the memory probe."""
    from megatron_rl.ops import chunked_logprobs

    if shape.num_threads:
        torch.set_num_threads(shape.num_threads)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(shape.num_tokens, shape.hidden_size, generator=gen).requires_grad_(True)
    weight = torch.randn(shape.vocab_size, shape.hidden_size, generator=gen).mul_(0.05)
    weight.requires_grad_(True)
    targets = torch.randint(0, shape.vocab_size, (shape.num_tokens,), generator=gen)
    grad_out = torch.randn(shape.num_tokens, generator=gen)
    gc.collect()
    rss = _ResidentSetPeak()
    baseline = rss.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    if variant == "naive":
        logprobs, entropy = naive_logprobs(hidden, weight, targets)
    elif variant == "chunked":
        logprobs, entropy = chunked_logprobs(hidden, weight, targets, chunk_size=shape.chunk_size)
    else:
        logprobs, entropy = torch_lce_logprobs(hidden, weight, targets, shape.chunk_size)
    forward_peak = rss.peak() - baseline
    rss.reset()
    (logprobs * grad_out).sum().backward()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    backward_peak = rss.peak() - baseline
    # The [vocab, hidden] weight grad is compared through a fixed random projection.
    projection = torch.randn(shape.hidden_size, generator=torch.Generator().manual_seed(1))
    results = {"logprobs": logprobs.detach(), "grad_hidden": hidden.grad,
               "grad_weight_projected": weight.grad @ projection}
    if entropy is not None:
        results["entropy"] = entropy
    torch.save(results, results_path)
    outputs = (hidden.grad, weight.grad, logprobs, logprobs)  # entropy is as big as log-probs
    return Measurement(
        variant=variant,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        output_bytes=sum(t.numel() * t.element_size() for t in outputs),
    )


def run_in_subprocess(variant: str, shape: Shape, results_path: Path) -> Measurement:
    cmd = [sys.executable, __file__, "--worker", variant, "--results", str(results_path),
           "--tokens", str(shape.num_tokens), "--hidden", str(shape.hidden_size),
           "--vocab", str(shape.vocab_size), "--chunk-size", str(shape.chunk_size),
           "--threads", str(shape.num_threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} worker failed:\n{done.stderr[-3000:]}")
    return Measurement(**json.loads(done.stdout.strip().splitlines()[-1]))


@dataclass(frozen=True, slots=True)
class Summary:
    wall_seconds: float  # best of the runs
    cpu_seconds: float  # best of the runs
    memory: Measurement  # the run with the highest peak (peaks repeat; keep the worst)


def summarise(measurements: list[Measurement]) -> Summary:
    return Summary(
        wall_seconds=min(m.seconds for m in measurements),
        cpu_seconds=min(m.cpu_seconds for m in measurements),
        memory=max(measurements, key=lambda m: m.peak_bytes),
    )


def _max_relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def print_header(shape: Shape) -> None:
    num_threads = shape.num_threads or torch.get_num_threads()
    print(f"vocab {shape.vocab_size:,}, hidden {shape.hidden_size:,}, tokens {shape.num_tokens:,}, "
          f"chunk_size {shape.chunk_size:,}, {num_threads} threads; FP32 inputs; "
          "forward + backward (grads for hidden and weight)")
    target = (TARGET_VOCAB, TARGET_HIDDEN, TARGET_TOKENS)
    if (shape.vocab_size, shape.hidden_size, shape.num_tokens) != target:
        print(f"SCALED from the target vocab {TARGET_VOCAB:,} / hidden {TARGET_HIDDEN:,} / tokens "
              f"{TARGET_TOKENS:,}: there the FP32 weight + its grad alone are "
              f"{2 * TARGET_VOCAB * TARGET_HIDDEN * 4 / GIB:.1f} GiB and one [tokens, vocab] FP32 "
              f"tensor is {TARGET_TOKENS * TARGET_VOCAB * 4 / GIB:.1f} GiB: too much for this "
              "machine.")


def report(shape: Shape, runs: dict[str, list[Measurement]], results: dict[str, dict]) -> None:
    logits_bytes = shape.num_tokens * shape.vocab_size * 4
    print_header(shape)
    print(f"one [tokens, vocab] FP32 tensor: {logits_bytes / GIB:.2f} GiB; "
          f"outputs every variant returns: {runs['naive'][0].output_bytes / GIB:.2f} GiB")
    for variant, measurements in runs.items():
        each = (f"{m.seconds:.1f}/{m.cpu_seconds:.1f}/{m.peak_bytes / GIB:.2f}"
                for m in measurements)
        print(f"{variant} runs (wall s / cpu s / peak GiB): " + ", ".join(each))
    header = (f"{'variant':<10}{'wall s':>8}{'cpu s':>8}{'fwd GiB':>9}{'bwd GiB':>9}"
              f"{'peak GiB':>10}{'working GiB':>13}{'working/[T,V]':>15}")
    print(header + "\n" + "-" * len(header))
    summaries = {variant: summarise(measurements) for variant, measurements in runs.items()}
    for variant, s in summaries.items():
        m = s.memory
        print(f"{variant:<10}{s.wall_seconds:>8.1f}{s.cpu_seconds:>8.1f}"
              f"{m.forward_peak_bytes / GIB:>9.3f}{m.backward_peak_bytes / GIB:>9.3f}"
              f"{m.peak_bytes / GIB:>10.3f}{m.working_bytes / GIB:>13.3f}"
              f"{m.working_bytes / logits_bytes:>15.2f}")
    naive = summaries["naive"]
    for variant, s in summaries.items():
        if variant == "naive":
            continue
        working = s.memory.working_bytes / naive.memory.working_bytes
        wall, cpu = s.wall_seconds / naive.wall_seconds, s.cpu_seconds / naive.cpu_seconds
        print(f"{variant} / naive: working memory {working:.3f}x, peak incl. outputs "
              f"{s.memory.peak_bytes / naive.memory.peak_bytes:.3f}x, wall time {wall:.2f}x, "
              f"cpu time {cpu:.2f}x")
        if variant == "chunked":
            verdicts = [("memory", working, TARGET_MEMORY_RATIO),
                        ("wall time", wall, TARGET_TIME_RATIO), ("cpu time", cpu, TARGET_TIME_RATIO)]
            print(f"  target (working memory <= {TARGET_MEMORY_RATIO:.3f}x at time <= "
                  f"{TARGET_TIME_RATIO}x): " + ", ".join(
                      f"{name} {'met' if ratio <= limit else 'MISSED'}"
                      for name, ratio, limit in verdicts))
        differences = (
            f"{name} {_max_relative_difference(results[variant][name], value):.1e}"
            for name, value in results["naive"].items() if name in results[variant]
        )
        print("  vs naive, max |difference| / max |naive|: " + ", ".join(differences))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=TARGET_VOCAB)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per variant")
    parser.add_argument("--torch-lce", action="store_true",
                        help="also run torch's chunked F.linear_cross_entropy (no entropy)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = Shape(args.tokens, args.hidden, args.vocab, args.chunk_size, args.threads)
    if args.worker:
        print(json.dumps(asdict(measure(args.worker, shape, args.results))))
        return
    variants = VARIANTS if args.torch_lce else VARIANTS[:2]
    runs: dict[str, list[Measurement]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for variant, measurements in runs.items():
                measurements.append(run_in_subprocess(variant, shape, Path(tmp) / f"{variant}.pt"))
        results = {variant: torch.load(Path(tmp) / f"{variant}.pt") for variant in runs}
    report(shape, runs, results)


if __name__ == "__main__":
    main()
