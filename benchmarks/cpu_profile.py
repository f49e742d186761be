"""Measures the simulator's `cpu` hardware profile on this machine: the real SGLang CPU engine and
the real Megatron trainer on the tiny recipe's model (examples/configs/tiny_pipeline.yaml: the
random tiny Llama of tools/make_tiny_checkpoint.py, fp32, the recipe's engine settings and
micro-batch size), and writes the fitted figures to megatron_rl/simulation/cpu_profile.json,
which the `cpu` profile loads (profiles.py; the fitted form is measured.py's).

Measured, each as the tiny run uses the machine (OMP_NUM_THREADS=1 for every process, as
`megatron-rl train` runs its engine and trainer rank; one process at a time here, while in a real
run the engine, the trainer rank, the driver and Ray share the 2 cores, so contention between
them is not in these figures):

- engine start: SGLangServer.launch with the recipe's settings until it answers;
- decode step vs batch and context: a batch of B prompts of P tokens generated to N = 1 and to
  N = 1 + DECODE_STEPS new tokens (ignore_eos, temperature 1, log-probs returned as the run asks);
  per step = the difference / DECODE_STEPS, at the mean context of those steps; fitted as
  a + b x batch + c x context tokens;
- prefill: the N = 1 call minus one fitted decode step, against the B x P prompt tokens
  (includes the HTTP round trip); fitted as a + b x tokens;
- weight update: pause (in place), begin, update_weights_from_disk (the whole tiny model), the
  version, end, continue, over HTTP (the real run sends the weights over gloo instead:
  benchmarks/simulate_vs_real.py prints its weight_sync/seconds beside the simulated one);
- trainer: RLTrainer built from the recipe (TrainerSettings.from_run_config), train_step and
  score (forward only) on batches of 4 prompts' samples at several sizes; fitted as
  a + b x tokens. In its own interpreter (the CPU shims patch process-wide torch state).

Every measurement is the median of `--repeats`; the JSON keeps the samples, the date, the
machine and the load average before and after.

Run: .venv/bin/python benchmarks/cpu_profile.py [--repeats 3] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's megatron_rl, not an installed one
RECIPE = ROOT / "examples" / "configs" / "tiny_pipeline.yaml"
DEFAULT_OUT = ROOT / "megatron_rl" / "simulation" / "cpu_profile.json"
DECODE_STEPS = 32
BATCHES = (1, 4, 16, 48)  # the tiny run has 16 (k = 0) to 48 (k = 2) requests in flight
PROMPT_TOKENS = (32, 96)
TRAIN_SEQUENCES = (8, 16, 32)  # the recipe's step is 16 sequences
TRAIN_SEQUENCE = (48, 56)  # prompt, completion tokens (the tiny run's typical lengths)


def _median_time(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_recipe(checkpoint: str):
    from megatron_rl.config import load_config

    return load_config(str(RECIPE), [f"model.hf_checkpoint={checkpoint}"])


def measure_engine(checkpoint: str, repeats: int, log_path: str) -> dict:
    """Start, decode, prefill and weight-update times of the recipe's SGLang CPU engine."""
    import numpy as np

    from megatron_rl.rollout import SamplingParams, SGLangGenerator, SGLangServer, \
        SGLangServerSettings

    cfg = load_recipe(checkpoint)
    settings = SGLangServerSettings.from_rollout_config(cfg.rollout, checkpoint,
                                                        random_seed=cfg.seed, log_path=log_path)
    start = time.perf_counter()
    server = SGLangServer.launch(settings)
    generator = SGLangGenerator(server.url, server=server)
    try:
        generator.generate([[5, 6, 7]], SamplingParams(max_new_tokens=1))
        start_s = time.perf_counter() - start
        rng = np.random.default_rng(0)
        vocab = 200  # well inside the tiny model's vocabulary
        decode, first = [], []
        for batch in BATCHES:
            for prompt in PROMPT_TOKENS:
                prompts = [rng.integers(3, vocab, prompt).tolist() for _ in range(batch)]

                def run(n: int):
                    generator.generate(prompts, SamplingParams(max_new_tokens=n,
                                                               ignore_eos=True))
                generator.generate(prompts, SamplingParams(max_new_tokens=1))  # warm shapes
                one = _median_time(lambda: run(1), repeats)
                many = _median_time(lambda: run(1 + DECODE_STEPS), repeats)
                step = (many - one) / DECODE_STEPS
                # Steps 2..1+DECODE_STEPS hold prompt + 1..DECODE_STEPS tokens per sequence.
                context = batch * (prompt + (1 + DECODE_STEPS) / 2)
                decode.append({"batch": batch, "prompt": prompt, "context_tokens": context,
                               "step_s": step})
                first.append({"batch": batch, "prompt": prompt, "first_s": one})
                print(f"  decode batch {batch:3d} prompt {prompt:3d}: step {step * 1e3:.2f} ms, "
                      f"first token {one * 1e3:.1f} ms", flush=True)

        def update():
            generator.pause("in_place")
            generator.begin_weight_update()
            generator.update_weights_from_disk(checkpoint, version=generator.weight_version + 1)
            generator.end_weight_update()
            generator.resume()
        update()  # the first load pays one-off costs
        weight_update_s = _median_time(update, max(repeats, 3))
    finally:
        generator.shutdown()
    return {"start_s": start_s, "decode": decode, "first": first,
            "weight_update_s": weight_update_s}


def measure_trainer(checkpoint: str, repeats: int) -> dict:
    """train_step and score times of the recipe's trainer rank at several batch sizes."""
    import torch

    from megatron_rl.trainer import RLTrainer, TrainBatch, TrainerSettings

    cfg = load_recipe(checkpoint)
    trainer = RLTrainer(TrainerSettings.from_run_config(cfg))
    prompt_len, completion_len = TRAIN_SEQUENCE
    samples = cfg.rollout.samples_per_prompt
    gen = torch.Generator().manual_seed(0)
    rows = []
    for count in TRAIN_SEQUENCES:
        ids, masks, old, prompts = [], [], [], []
        for i in range(count):
            ids.append(torch.randint(3, 200, (prompt_len + completion_len,), generator=gen))
            masks.append(torch.cat([torch.zeros(prompt_len), torch.ones(completion_len)]))
            old.append(-torch.rand(prompt_len + completion_len, generator=gen) - 5.0)
            prompts.append(i // samples)
        batch = TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old,
                           advantages=torch.randn(count, generator=gen),
                           prompt_ids=torch.tensor(prompts), sample_ids=torch.arange(count))
        trainer.train_step(batch)  # lazy optimizer state, first-call overheads
        tokens = count * (prompt_len + completion_len)
        train_s = _median_time(lambda: trainer.train_step(batch), repeats)
        score_s = _median_time(lambda: trainer.score(batch), repeats)
        rows.append({"sequences": count, "tokens": tokens, "train_s": train_s,
                     "score_s": score_s})
        print(f"  trainer {count:3d} sequences ({tokens} tokens): step {train_s * 1e3:.0f} ms, "
              f"score {score_s * 1e3:.0f} ms", flush=True)
    return {"rows": rows}


def fit(engine: dict, trainer: dict, provenance: dict):
    from megatron_rl.simulation.measured import MeasuredCosts, fit_linear

    decode = fit_linear(["batch", "context_tokens"],
                        [[d["batch"], d["context_tokens"]] for d in engine["decode"]],
                        [d["step_s"] for d in engine["decode"]])
    # The N = 1 call = prefill (with the HTTP round trip) + one decode step at the prompt.
    prefill_s = [f["first_s"] - decode(batch=f["batch"],
                                       context_tokens=f["batch"] * f["prompt"])
                 for f in engine["first"]]
    prefill = fit_linear(["tokens"], [[f["batch"] * f["prompt"]] for f in engine["first"]],
                         [max(s, 1e-6) for s in prefill_s])
    rows = trainer["rows"]
    return MeasuredCosts(
        decode_step=decode, prefill=prefill,
        train_step=fit_linear(["tokens"], [[r["tokens"]] for r in rows],
                              [r["train_s"] for r in rows]),
        score=fit_linear(["tokens"], [[r["tokens"]] for r in rows], [r["score_s"] for r in rows]),
        weight_update_s=engine["weight_update_s"], engine_start_s=engine["start_s"],
        provenance=provenance)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--part", choices=("all", "trainer"), default="all",
                        help=argparse.SUPPRESS)  # trainer: the child interpreter's part
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "trainer":
        print("TRAINER_JSON " + json.dumps(measure_trainer(args.checkpoint, args.repeats)))
        return 0

    os.environ["OMP_NUM_THREADS"] = "1"
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    load_before = os.getloadavg()
    print(f"command: {command}\nload average before: {load_before}", flush=True)
    with tempfile.TemporaryDirectory(prefix="cpu_profile-") as tmp:
        checkpoint = str(Path(tmp) / "tiny_llama_checkpoint")
        subprocess.run([sys.executable, "tools/make_tiny_checkpoint.py", checkpoint], cwd=ROOT,
                       check=True, capture_output=True)
        print("trainer (its own interpreter):", flush=True)
        child = subprocess.run([sys.executable, __file__, "--part", "trainer", "--checkpoint",
                                checkpoint, "--repeats", str(args.repeats)], cwd=ROOT,
                               capture_output=True, text=True, env=os.environ)
        lines = [line for line in child.stdout.splitlines() if line.startswith("TRAINER_JSON ")]
        if child.returncode != 0 or not lines:
            print(f"trainer measurement failed (rc {child.returncode}):\n{child.stderr[-4000:]}",
                  file=sys.stderr)
            return 1
        print("\n".join(line for line in child.stdout.splitlines()
                        if line.startswith("  trainer")), flush=True)
        trainer = json.loads(lines[-1].removeprefix("TRAINER_JSON "))
        print("engine:", flush=True)
        engine = measure_engine(checkpoint, args.repeats, str(Path(tmp) / "engine.log"))
    load_after = os.getloadavg()
    provenance = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "command": command, "recipe": str(RECIPE.relative_to(ROOT)),
        "threads_per_process": 1,
        "samples": {"engine": engine, "trainer": trainer}}
    costs = fit(engine, trainer, provenance)
    Path(args.out).write_text(json.dumps(costs.to_json(), indent=1) + "\n")
    d, p, t, s = costs.decode_step, costs.prefill, costs.train_step, costs.score
    print(f"decode step = {d.intercept * 1e3:.2f} ms + {d.coefficients['batch'] * 1e3:.3f} ms "
          f"x batch + {d.coefficients['context_tokens'] * 1e6:.3f} us x context tokens "
          f"(worst sample off by {d.max_relative_error:.0%})\n"
          f"prefill = {p.intercept * 1e3:.1f} ms + {p.coefficients['tokens'] * 1e6:.2f} us x "
          f"tokens (worst {p.max_relative_error:.0%})\n"
          f"train step = {t.intercept * 1e3:.0f} ms + {t.coefficients['tokens'] * 1e6:.1f} us x "
          f"tokens (worst {t.max_relative_error:.0%}); score = {s.intercept * 1e3:.0f} ms + "
          f"{s.coefficients['tokens'] * 1e6:.1f} us x tokens (worst {s.max_relative_error:.0%})\n"
          f"weight update {costs.weight_update_s * 1e3:.0f} ms; engine start "
          f"{costs.engine_start_s:.1f} s\nload average after: {load_after}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
