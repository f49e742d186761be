"""Completions at the regime's length on the real stack (issue 29): `megatron-rl train` with one
SGLang CPU generator and one Megatron trainer rank under Ray, reasoning-gym arithmetic graded by
its own scorer, and every completion thinking for 16384 tokens until the forced interruption
fires, then answering.

The model is the one-layer tiny Llama (`tiny_long`: one KV head, a 32k context): SGLang's CPU
decode gathers every layer's cached keys and values of the whole context at every step, so at 16k
tokens that gather, not the model, is what a step costs (two 16k completions at once: ~100 s
with it, ~370 s with the four-layer `tiny`). The thinking budget is not drawn (min = max =
16384), and the model never ends a completion by itself (`--never-stops` of
tools/make_tiny_checkpoint.py: its `</s>` and `</think>` are never sampled; a random model
samples one about every 256 tokens), so every completion runs to it.

rollout.deterministic: the generator runs one request at a time, so step 1's group is generated
first and step 2's group after it, on the same engine; while step 2's first completion is being
generated, step 1 trains on the first group and pushes version 1 into the engine in flight (a
pause in place): that completion's tokens are labelled version 0 up to the update and version 1
after it. Checked against independent references: the completions' own shape (budget, phrase,
lengths: output_dir/rollout_samples), the per-token versions over the whole length, the
trainer's log-probs against the generator's over every position of the 16k sequences (the
max |logp_train - logp_gen|, fp32 both sides: a RoPE or position mismatch past the original 8k
context would show here), and the trainer's micro-batches (one per 16.5k-token sequence, under
train.micro_batch_max_tokens).
"""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: add the helpers
from _checks import ROOT, run_train, scalars  # noqa: E402

# Four 16.4k-token completions, one at a time: 4 minutes alone, more in the suite's streams;
# the run's own bound is 1800 s, pytest.ini's 900 s hang guard is raised above it.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

THINKING_BUDGET = 16384
SOLUTION_BUDGET = 40  # the interruption phrase takes 24 tokens of it
MAX_PROMPT_TOKENS = 80


def test_16k_token_completions_are_interrupted_updated_in_flight_and_trained(tmp_path):
    import subprocess

    model = tmp_path / "tiny_long"
    subprocess.run([sys.executable, "tools/make_tiny_checkpoint.py", str(model), "--size",
                    "tiny_long", "--never-stops"], cwd=ROOT, check=True, capture_output=True,
                   timeout=300)
    out = tmp_path / "run"
    longest = MAX_PROMPT_TOKENS + THINKING_BUDGET + SOLUTION_BUDGET
    rc, stdout, stderr, _ = run_train([
        "examples/configs/tiny_pipeline.yaml", f"output_dir={out}",
        f"model.hf_checkpoint={model}", "model.size=tiny_long",
        f"rollout.max_prompt_tokens={MAX_PROMPT_TOKENS}",
        f"rollout.thinking_budget={THINKING_BUDGET}",
        f"rollout.thinking_budget_min={THINKING_BUDGET}",
        f"rollout.solution_budget={SOLUTION_BUDGET}", "rollout.samples_per_prompt=2",
        "rollout.max_off_policyness=1", "rollout.deterministic=true",
        "train.global_batch_size=2", "train.num_steps=2",
        f"train.micro_batch_max_tokens={longest}",  # one 16.5k sequence per micro-batch
        "eval.at_step_zero=false", "eval.interval_steps=0", "checkpoint.interval_steps=0",
        "logging.progress_bar=false", "logging.rollout_samples=true",
        # The random policy solves nothing: keep the zero-variance groups, so both steps train.
        "algorithm.zero_variance_filter=false"], timeout=1800)
    assert rc == 0, stdout[-4000:] + stderr[-4000:]

    samples = {step: [json.loads(line) for line in
                      (out / "rollout_samples" / f"step_{step:06d}.jsonl").read_text()
                      .splitlines()] for step in (1, 2)}
    for step, lines in samples.items():
        assert len(lines) == 2, (step, lines)
        for s in lines:
            # The interruption fired at the budget: 16384 sampled thinking tokens, the phrase
            # (inserted, not trained on), then at most the rest of the solution budget.
            assert s["thinking_budget"] == THINKING_BUDGET and s["interrupted"], s
            assert THINKING_BUDGET < s["completion_tokens"] <= THINKING_BUDGET + SOLUTION_BUDGET
            assert s["loss_tokens"] >= THINKING_BUDGET, s
            assert sum(n for _, n in s["versions"]) == s["loss_tokens"], s
            order = [v for v, _ in s["versions"]]
            assert order == sorted(order), s  # versions only move forward along a completion
    # Step 1 trained on completions wholly of version 0; step 2's first completion was being
    # generated when version 1 arrived: version 0 tokens, then version 1 tokens, in one
    # completion. Its later tokens (at least the ones after the update) are version 1.
    assert all(s["versions"] == [[0, s["loss_tokens"]]] for s in samples[1]), samples[1]
    spanning = [s for s in samples[2] if [v for v, _ in s["versions"]] == [0, 1]]
    assert spanning, samples[2]
    assert all(min(n for _, n in s["versions"]) > 0 for s in spanning)

    metrics = scalars(out / "tensorboard")
    assert metrics["rollout/interruption_rate"] == {1: 1.0, 2: 1.0}, metrics
    assert metrics["train/micro_batches"] == {1: 2.0, 2: 2.0}, metrics["train/micro_batches"]
    # Generator and trainer agree on every token of the 16k sequences (fp32 on both sides).
    for step in (1, 2):
        assert metrics["train/logp_mismatch_max"][step] < 1e-3, metrics["train/logp_mismatch_max"]
        assert metrics["train/logp_mismatch_mean"][step] < 1e-4, \
            metrics["train/logp_mismatch_mean"]
    print(f"\nlongest sequence {longest} tokens; step 2's spanning completion(s): "
          + "; ".join(str(s["versions"]) for s in spanning)
          + f"; logp mismatch max {metrics['train/logp_mismatch_max']}")
