"""`megatron-rl train` with colocated placement on the real stack (Ray, one SGLang CPU engine in
the bundle of the one Megatron rank): each step releases the engine's memory through SGLang's own
endpoints before training, resumes the weights' memory, loads the new weights, resumes the rest.
The run's data is a dataset in verl's RL layout, as a user brings it (docs/data.md): a Parquet
file written with pyarrow whose prompts are chat conversations (a system prompt and the question),
`reward_model.ground_truth` answers and `data_source` "openai/gsm8k" (graded as math by
math-verify), served by the tiny Llama whose tokenizer is given a chat template. The other layouts
(a saved `datasets` split, question/answer JSON Lines, our own) reach the same run path through
`load_run_prompts`, checked in tests/unit/test_data_run_prompts.py and test_data_layouts.py.

The trainer frees its gradient buffers after every step (RLTrainer.offload_training_state;
its optimizer state stays where it is on CPU) and reports it. The independent check of
colocation is parity: with the synchronous schedule every step's samples
come from the weights the trainer held, so the train/generator log-prob mismatch stays at float
noise on every step, which it would not if the release / resume cycle or the load into resumed
memory lost or corrupted weights (or the KV cache of old weights were reused). Of the data: the
step-0 validation graded the held-out verl rows (ids "openai/gsm8k/train/<index>", their question
as the prompt) with math-verify's 0 / 1 rewards against the ground truth, and the run printed no
traceback or third-party noise."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: add the helpers
from _checks import (console_noise, processes_left, run_train,  # noqa: E402
                     scalars as read_scalars, tiny_llama_checkpoint)

pytestmark = pytest.mark.e2e

SYSTEM = "Answer briefly."
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _verl_parquet(path: Path, num_rows: int) -> dict[str, dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"What is {i} + {i + 3}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i + 3)},
             "extra_info": {"split": "train", "index": i}} for i in range(num_rows)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return {f"openai/gsm8k/train/{i}": row for i, row in enumerate(rows)}


def test_megatron_rl_train_colocated_synchronous_on_verl_parquet_with_chat_prompts(tmp_path):
    from transformers import AutoTokenizer

    checkpoint = tiny_llama_checkpoint(tmp_path / "tiny_llama")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(checkpoint)
    rows = _verl_parquet(tmp_path / "gsm8k_train.parquet", 24)
    out = tmp_path / "run"
    rc, stdout, stderr, pid = run_train(
        ["examples/configs/tiny_pipeline.yaml", f"output_dir={out}",
         f"model.hf_checkpoint={checkpoint}", f"data.prompts={tmp_path / 'gsm8k_train.parquet'}",
         "logging.progress_bar=false", "cluster.colocated=true", "rollout.max_off_policyness=0",
         "train.num_steps=3", "eval.at_step_zero=true", "eval.interval_steps=0",
         "checkpoint.interval_steps=0",
         "algorithm.zero_variance_filter=false"],  # the random policy solves nothing
        timeout=1200)
    assert rc == 0, stdout[-3000:] + stderr[-6000:]
    noise = console_noise(stdout + stderr)
    assert not noise, "\n".join(noise[:20])
    scalars = read_scalars(out / "tensorboard")
    assert sorted(scalars["colocated/release_seconds"]) == [1, 2, 3]  # released every step
    # The trainer freed its gradient buffers after every step (the CPU part of its offload).
    offloaded = scalars["colocated/trainer_offloaded_gib"]
    assert sorted(offloaded) == [1, 2, 3] and min(offloaded.values()) > 0, offloaded
    assert set(scalars["weight_sync/version"].values()) == {1.0, 2.0, 3.0}
    assert set(scalars["train/skipped"].values()) == {0.0}
    assert max(scalars["rollout/staleness/max_lag"].values()) == 0  # synchronous
    mismatch = scalars["train/logp_mismatch_mean"]
    assert sorted(mismatch) == [1, 2, 3] and max(mismatch.values()) < 1e-4, mismatch
    # The mismatch metrics (issue 40) every step, corrections off: nothing masked, the median
    # ratio ~1, and |k1| = |mean log r| <= mean |log r| (logp_mismatch_mean).
    kl_k1 = scalars["train/mismatch/kl_k1"]
    assert sorted(kl_k1) == [1, 2, 3], kl_k1
    assert all(abs(kl_k1[s]) <= mismatch[s] * (1 + 1e-6) + 1e-12 for s in kl_k1), (kl_k1, mismatch)
    assert set(scalars["train/mismatch/masked_token_fraction"].values()) == {0.0}
    assert all(abs(v - 1) < 1e-3 for v in scalars["train/mismatch/ratio_p50"].values())
    log = (out / "generator-0.log").read_text()
    assert "/release_memory_occupation" in log and "/resume_memory_occupation" in log

    steps = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps[:3]] == [1, 2, 3] and len(steps[0]["trained"]) == 4
    samples = [json.loads(line) for line in
               (out / "validation_samples" / "step_000000.jsonl").read_text().splitlines()]
    assert len(samples) == 8 * 2  # the recipe's 8 held-out prompts, 2 samples each
    for sample in samples:
        row = rows[sample["prompt_id"]]
        assert sample["task"] == "math" and sample["prompt"] == row["prompt"][-1]["content"]
        assert sample["reward"] in (0.0, 1.0)
    left = processes_left(model_dir=checkpoint, driver_pid=pid)
    assert not left, f"processes outlived the run: {left}"
