"""Trainer side of tests/integration/test_sglang_inflight.py: one torchrun rank (TP1 Megatron
trainer) that trains and pushes weights through the real WeightSync into a live SGLang CPU
server while it generates.

Usage: torchrun --nproc-per-node 1 _inflight_worker.py MODEL_DIR GENERATOR_URL OUT_JSON

Each round: a train step (old weights -> new weights), 4 concurrent 200-token requests admitted
under the old version, and a sync to the new version about a quarter of the way through them.
Every output token is then checked against the weights of the version it is labelled with:
tokens labelled old against the trainer's full recompute under the old weights; tokens labelled
new against what in place means (KV of the earlier tokens from the old weights, the new weights
from the update on: transformers with the old model's KV cache fed to the new model), and, after
a retract, against the trainer's full recompute under the new weights. Rounds: in place; in place
with the first loading attempt failing after two buckets (retried while paused); in place with
every attempt failing (the generator is failed and stays paused; a fresh client and sync
recover it); retract; abort (then resubmission). Plus the prefix-cache check (hazard 2) after
the first round. Rank 0 writes everything measured to OUT_JSON; the pytest side asserts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _hf_families import family_for  # noqa: E402
from _workers import ENGINE_KEY_ENV  # noqa: E402
from _weight_sync_worker import make_trainer, sampled_batch, trainer_logprobs  # noqa: E402

from megatron_rl.rollout import SamplingParams, SGLangGenerator  # noqa: E402

API_KEY = os.environ.get(ENGINE_KEY_ENV)  # the server's, if it has one
NUM_TOKENS = 200
NUM_REQUESTS = 4
# Hazard 2: a 40-token prompt whose KV a finished version-1 request leaves in the prefix cache.
CACHE_PROMPT = [(7 * i + 3) % 300 + 2 for i in range(40)]
PARAMS_SHORT = SamplingParams(max_new_tokens=8, seed=21, ignore_eos=True)


def long_prompts(round_index: int) -> list[list[int]]:
    """Distinct first tokens per round and request (ids < the tiny vocabulary of 320: an id out
    of range crashes the SGLang server)."""
    return [[5 + 4 * round_index + i, 17, 42, 99, 7, 250, 3, 64] for i in range(NUM_REQUESTS)]


def snapshot(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


@contextlib.contextmanager
def trainer_weights(trainer, values):
    """The trainer's parameters temporarily set to `values` (a snapshot), for scoring."""
    current = snapshot(trainer)
    with torch.no_grad():
        for p, v in zip(trainer.model.parameters(), values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(trainer.model.parameters(), current):
                p.copy_(v)


def full_logprobs(trainer, results) -> list[torch.Tensor]:
    """The trainer's FP32 log-probs of each result's output tokens, whole sequence recomputed."""
    sequences = [list(r.prompt_token_ids) + list(r.token_ids) for r in results]
    per_token = trainer_logprobs(trainer, sequences)
    return [lp[len(r.prompt_token_ids) - 1:] for lp, r in zip(per_token, results)]


def hf_model(model_dir: str, state: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def mixed_logprobs(old_model, new_model, result, first_new: int) -> torch.Tensor:
    """In-place semantics: output token j was produced by the forward at position
    len(prompt) + j - 1. Tokens before `first_new` came from the old weights, which also
    computed the KV of their positions; the new weights compute every position from
    len(prompt) + first_new - 1 on, attending to the old KV. Returns [num tokens] (NaN before
    first_new)."""
    prompt, tokens = list(result.prompt_token_ids), list(result.token_ids)
    ids = torch.tensor([prompt + tokens])
    split = len(prompt) + first_new - 1
    out = torch.full((len(tokens),), float("nan"))
    if first_new >= len(tokens):
        return out
    with torch.no_grad():
        if split > 0:
            cache = old_model(ids[:, :split], use_cache=True).past_key_values
            logits = new_model(ids[:, split:], past_key_values=cache, use_cache=True).logits[0]
        else:
            logits = new_model(ids).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)  # row i predicts position split + i + 1
    for j in range(first_new, len(tokens)):
        out[j] = logp[j - first_new, tokens[j]]
    return out


def max_abs(pairs) -> float:
    values = [abs(a - b) for a, b in pairs]
    return max(values) if values else 0.0


def generate_in_background(generator, prompts, max_new_tokens: int, extra_key: str, seed: int):
    box: dict = {}

    def run():
        try:
            box["results"] = generator.generate(prompts, SamplingParams(
                max_new_tokens=max_new_tokens, seed=seed, ignore_eos=True), extra_key=extra_key)
        except Exception as exc:  # noqa: BLE001 (reported)
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def capture_meta(generator) -> list:
    """Keep every raw /generate answer of `generator` (meta_info: cached_tokens)."""
    seen: list = []
    original = generator._request

    def request(method, path, payload=None, **kwargs):
        answer = original(method, path, payload, **kwargs)
        if path == "/generate":
            seen.extend(answer)
        return answer

    generator._request = request
    return seen


def inject_failures(sync, failing_attempts):
    """The sync's transports raise before the third bucket of the attempts listed (0-based);
    the first two buckets have then loaded: a partial load."""
    state = {"attempt": -1}
    make = sync._make_transport

    def wrap(transport):
        state["attempt"] += 1
        attempt, sent = state["attempt"], [0]
        send = transport.send

        def failing_send(bucket, **kwargs):
            if attempt in failing_attempts and sent[0] == 2:
                raise RuntimeError(f"injected: bucket 3 of attempt {attempt + 1} lost")
            sent[0] += 1
            return send(bucket, **kwargs)

        transport.send = failing_send
        return transport

    sync.transport = wrap(sync.transport)
    sync._make_transport = lambda: wrap(make())
    return lambda: setattr(sync, "_make_transport", make)


class Run:
    def __init__(self, model_dir: str, url: str):
        from megatron_rl.weight_sync import WeightSync, WeightSyncSettings

        self.model_dir, self.url = model_dir, url
        self.family = family_for(model_dir)
        self.trainer = make_trainer(self.family)
        self.generator = SGLangGenerator(url, request_timeout_s=240, max_retries=2,
                                         api_key=API_KEY)
        # Small buckets (16 KiB): a sync takes many buckets, so a failure can leave a partial
        # load behind.
        self.settings = WeightSyncSettings(bucket_bytes=16 * 2**10, timeout_s=120)
        self.sync = self.new_sync(self.generator)
        self.batch = None
        self.delay_s = 1.0

    def new_sync(self, generator):
        from megatron_rl.weight_sync import WeightSync

        return WeightSync(self.trainer.model, self.family.weight_groups(), [generator],
                          self.settings, hf_vocab_size=self.family.hf_config.vocab_size)

    def start(self) -> dict:
        """Version 1 = the trainer's weights; a batch to train on; the timing of one round."""
        report = self.sync.sync()
        sampled = self.generator.generate([[5, 17, 42, 99], [200, 4, 31]], SamplingParams(
            max_new_tokens=6, num_samples=2, seed=3), extra_key="v1")
        self.batch = sampled_batch(sampled)
        tick = time.perf_counter()
        self.generator.generate(long_prompts(20), SamplingParams(
            max_new_tokens=NUM_TOKENS, seed=1, ignore_eos=True), extra_key="v1")
        generation_s = time.perf_counter() - tick
        # Update about a quarter of the way through the next generations.
        self.delay_s = 0.25 * generation_s
        return {"version": report.version, "buckets": report.num_buckets,
                "generation_s": generation_s,
                "tokens_per_s": NUM_REQUESTS * NUM_TOKENS / generation_s}

    def generate_round(self, index: int, old_version: int):
        """Start the round's requests and return (thread, box) about a quarter of the way
        through them, so that the update lands mid-generation. The delay comes from one timed
        generation; when the machine then runs faster and the requests finish before the delay
        is up, the round is started again (same seeds, same weights: the same tokens) with a
        quarter of the delay. (SGLang's /v1/loads, polled for the running batch instead, never
        showed the round's requests on the loaded CI machine.)"""
        for _ in range(4):
            thread, box = generate_in_background(self.generator, long_prompts(index),
                                                 NUM_TOKENS, f"v{old_version}", seed=100 + index)
            thread.join(timeout=self.delay_s)
            if thread.is_alive():
                return thread, box
            self.delay_s /= 4
        raise RuntimeError(f"round {index}: the requests finished before every delay tried")

    def train(self):
        """One train step; returns (old trainer snapshot, old HF state, new HF state)."""
        old, old_hf = snapshot(self.trainer), self.sync.hf_state_dict()
        self.trainer.train_step(self.batch)
        return old, old_hf, self.sync.hf_state_dict()

    def check_tokens(self, results, old_version: int, old, old_hf, new_hf,
                     *, mixed: bool) -> dict:
        """Per token: labelled old vs the old weights; labelled new vs the in-place (mixed-KV)
        reference when `mixed`, and vs the new weights' full recompute."""
        new_version = old_version + 1
        full_new = full_logprobs(self.trainer, results)
        with trainer_weights(self.trainer, old):
            full_old = full_logprobs(self.trainer, results)
        old_model, new_model = (hf_model(self.model_dir, old_hf), hf_model(self.model_dir, new_hf)) \
            if mixed else (None, None)
        first_new, labels_ok = [], True
        old_pairs, mixed_pairs, new_full_pairs, new_old_pairs, edge_pairs = [], [], [], [], []
        for r, f_new, f_old in zip(results, full_new, full_old):
            u = next((j for j, v in enumerate(r.versions) if v != old_version), len(r.versions))
            first_new.append(u)
            labels_ok &= r.versions == (old_version,) * u + (new_version,) * (len(r.versions) - u)
            gen = list(r.logprobs)
            old_pairs += [(gen[j], float(f_old[j])) for j in range(u)]
            new_full_pairs += [(gen[j], float(f_new[j])) for j in range(u, len(gen))]
            new_old_pairs += [(gen[j], float(f_old[j])) for j in range(u, len(gen))]
            if mixed:
                ref = mixed_logprobs(old_model, new_model, r, u)
                mixed_pairs += [(gen[j], float(ref[j])) for j in range(u, len(gen))]
                if 0 < u < len(gen):  # the first token labelled new, the last labelled old
                    edge_pairs.append((gen[u], float(ref[u]), float(f_old[u]), gen[u - 1],
                                       float(f_old[u - 1])))
        return {
            "first_new": first_new, "labels_monotone": labels_ok,
            "finish": [r.finish_reason for r in results],
            "lengths": [len(r.token_ids) for r in results],
            "num_old_tokens": len(old_pairs), "num_new_tokens": len(new_full_pairs),
            "old_vs_old_weights": max_abs(old_pairs),
            "new_vs_in_place_reference": max_abs(mixed_pairs) if mixed else None,
            "new_vs_new_weights_full": max_abs(new_full_pairs),
            "new_vs_old_weights_full": max_abs(new_old_pairs),
            # The first token labelled new against the in-place reference and against the old
            # weights (a label one token late, as with the overlap schedule, matches the old).
            "edge_new_vs_reference": max_abs((e[0], e[1]) for e in edge_pairs),
            "edge_new_vs_old_weights": max((abs(e[0] - e[2]) for e in edge_pairs),
                                           default=None),
            "edge_last_old_vs_old_weights": max_abs((e[3], e[4]) for e in edge_pairs),
        }

    def in_place_round(self, index: int, *, pause_mode: str = "in_place",
                       failing_attempts=(), recover: bool = False) -> dict:
        old, old_hf, new_hf = self.train()
        old_version = self.sync.version
        self.sync.settings = dataclasses.replace(self.settings, pause_mode=pause_mode)
        thread, box = self.generate_round(index, old_version)
        restore = inject_failures(self.sync, set(failing_attempts)) if failing_attempts \
            else lambda: None
        out: dict = {"pause_mode": pause_mode}
        try:
            report = self.sync.sync()
            out.update(version=report.version, attempts=report.attempts,
                       sync_s=report.seconds, cache_flushed=report.cache_flushed)
        except Exception as exc:  # noqa: BLE001 (the failing round expects it)
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            restore()
        out["generating_when_synced"] = thread.is_alive() or "error" in box
        if recover:
            # The failed generator stays paused: its requests make no progress.
            time.sleep(1.5)
            out["paused_after_failure"] = thread.is_alive()
            out["generator_failure"] = self.generator.failure
            try:
                self.generator.check_health()
            except Exception as exc:  # noqa: BLE001
                out["failed_client_error"] = f"{type(exc).__name__}: {exc}"
            # Recovery: a fresh client and sync load the whole model again, then continue.
            failed_version = self.sync.version
            self.generator = SGLangGenerator(self.url, request_timeout_s=240, max_retries=2,
                                             api_key=API_KEY)
            self.sync.close()
            self.sync = self.new_sync(self.generator)
            self.sync.version = failed_version
            report = self.sync.sync()
            out.update(recovered_version=report.version, recovered_flushed=report.cache_flushed)
        thread.join(timeout=300)
        if "error" in box or thread.is_alive():
            out["generation_error"] = box.get("error", "still running")
            return out
        out.update(self.check_tokens(box["results"], old_version, old, old_hf, new_hf,
                                     mixed=pause_mode == "in_place"))
        return out

    def abort_round(self, index: int) -> dict:
        """abort: running requests end with their partial outputs (all old tokens); their
        resubmission after the update recomputes everything with the new weights."""
        self.sync.settings = dataclasses.replace(self.settings, pause_mode="abort")
        for _ in range(3):  # a loaded machine: the requests may end before the abort lands
            old, old_hf, new_hf = self.train()
            old_version = self.sync.version
            thread, box = self.generate_round(index, old_version)
            report = self.sync.sync()
            thread.join(timeout=300)
            results = box["results"]
            if any(r.finish_reason == "abort" for r in results):
                break
            self.delay_s /= 4  # all finished before the update: again, with a new step
        out = {"version": report.version, "cache_flushed": report.cache_flushed,
               "finish": [r.finish_reason for r in results],
               "lengths": [len(r.token_ids) for r in results],
               "all_old": all(set(r.versions) <= {old_version} for r in results)}
        with trainer_weights(self.trainer, old):
            full_old = full_logprobs(self.trainer, results)
        out["partial_vs_old_weights"] = max_abs(
            (g, float(f)) for r, fo in zip(results, full_old) for g, f in zip(r.logprobs, fo))
        # Resubmission, under the same admission key (its cache was flushed with the update).
        client = SGLangGenerator(self.url, request_timeout_s=240, api_key=API_KEY)
        meta = capture_meta(client)
        again = client.generate([list(r.prompt_token_ids) + list(r.token_ids) for r in results],
                                SamplingParams(max_new_tokens=16, seed=7, ignore_eos=True),
                                extra_key=f"v{old_version}")
        full_new = full_logprobs(self.trainer, again)
        out.update(
            resubmitted_cached_tokens=[m["meta_info"]["cached_tokens"] for m in meta],
            resubmitted_versions=sorted({v for r in again for v in r.versions}),
            resubmitted_vs_new_weights=max_abs(
                (g, float(f)) for r, fn in zip(again, full_new) for g, f in zip(r.logprobs, fn)))
        return out

    def prefix_cache_check(self, version: int) -> dict:
        """Hazard 2: the prompt of a request finished under the previous version, asked again
        under the new version's key (no cache hit, the new weights) and, as a control, under
        the old key (the stale KV is there and is reused)."""
        client = SGLangGenerator(self.url, request_timeout_s=240, api_key=API_KEY)
        meta = capture_meta(client)
        new = client.generate([CACHE_PROMPT], PARAMS_SHORT, extra_key=f"v{version}")[0]
        stale = client.generate([CACHE_PROMPT], PARAMS_SHORT, extra_key=f"v{version - 1}")[0]
        (full_new,) = full_logprobs(self.trainer, [new])
        (full_stale,) = full_logprobs(self.trainer, [stale])
        return {"prompt_tokens": len(CACHE_PROMPT),
                "new_key_cached_tokens": meta[0]["meta_info"]["cached_tokens"],
                "old_key_cached_tokens": meta[1]["meta_info"]["cached_tokens"],
                "new_key_versions": sorted(set(new.versions)),
                "new_key_vs_new_weights": max_abs(zip(new.logprobs, full_new.tolist())),
                "old_key_vs_new_weights": max_abs(zip(stale.logprobs, full_stale.tolist()))}


def main() -> None:
    model_dir, url, out_path = sys.argv[1:4]
    run = Run(model_dir, url)
    result: dict = {"start": run.start()}
    # A finished version-1 request leaves CACHE_PROMPT's KV in the prefix cache ("v1").
    run.generator.generate([CACHE_PROMPT], PARAMS_SHORT, extra_key="v1")
    result["in_place"] = run.in_place_round(0)
    result["prefix_cache"] = run.prefix_cache_check(run.sync.version)
    result["retried"] = run.in_place_round(1, failing_attempts=(0,))
    result["failed"] = run.in_place_round(2, failing_attempts=(0, 1, 2), recover=True)
    result["retract"] = run.in_place_round(3, pause_mode="retract")
    result["abort"] = run.abort_round(4)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    run.sync.close()
    from megatron_rl.platform import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main()
