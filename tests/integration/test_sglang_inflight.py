"""In-flight weight updates against a live SGLang CPU server (docs/generators.md, "In-flight
updates"): the shared tiny Llama-3-style server (tests/integration/conftest.py; reset to its
launch state first; overlap schedule off: the default), a one-rank Megatron trainer
(tests/integration/_inflight_worker.py, one torchrun launch) that trains a step and pushes the new
weights through the real WeightSync while 4 requests of 200 tokens run.

Per token, SGLang's recorded log-prob must equal the log-prob under the weights of the version the
token is labelled with (tolerance 1e-4, as in test_sglang_weight_sync.py; both sides fp32):
- labelled old: the trainer's full recompute under the old weights;
- labelled new, in place: the old weights' KV for the earlier positions and the new weights from
  the update on (transformers, the old model's KV cache fed to the new model). A full recompute
  under either weights does not match them (hazard 3: that is what the behaviour policy was);
- labelled new, after a retract: the trainer's full recompute under the new weights.
No request is aborted (except in abort mode), every request mixes versions, and a load that
fails is retried or fails the generator without ever continuing it on a partial load.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _workers import run_worker  # noqa: E402

LOGPROB_TOLERANCE = 1e-4
NUM_TOKENS = 200


@pytest.fixture(scope="module")
def inflight(tiny_llama_server, tmp_path_factory) -> dict:
    """The worker's measurements (one trainer launch against the shared server, reset first)."""
    generator = tiny_llama_server.fresh()
    assert generator.server.settings.disable_overlap_schedule  # hazard 1: exact labels
    result = run_worker("_inflight_worker.py", generator.server.settings.model_path,
                        generator.url, num_ranks=1, directory=tmp_path_factory.mktemp("inflight"),
                        timeout_s=900, api_key=generator.server.settings.api_key)
    print(json.dumps(result, indent=1))  # the measured numbers, with pytest -s
    return result


def _check_in_place(got: dict) -> None:
    assert "generation_error" not in got, got
    assert got["finish"] == ["length"] * 4 and got["lengths"] == [NUM_TOKENS] * 4, got
    assert got["labels_monotone"], got
    # Every request mixes versions: the update landed mid-generation.
    assert all(0 < u < NUM_TOKENS for u in got["first_new"]), got["first_new"]
    assert got["old_vs_old_weights"] < LOGPROB_TOLERANCE, got
    assert got["new_vs_in_place_reference"] < LOGPROB_TOLERANCE, got
    # The label is exact at the boundary: the first token labelled new came from the new
    # weights, not from the old ones (with the overlap schedule it would have).
    assert got["edge_new_vs_reference"] < LOGPROB_TOLERANCE, got
    assert got["edge_new_vs_old_weights"] > 10 * LOGPROB_TOLERANCE, got
    # Hazard 3: no full recompute gives the behaviour policy's log-probs after the update.
    assert got["new_vs_new_weights_full"] > 100 * LOGPROB_TOLERANCE, got
    assert got["new_vs_old_weights_full"] > 100 * LOGPROB_TOLERANCE, got


def test_in_place_update_mid_generation_labels_every_token_with_its_weights(inflight):
    got = inflight["in_place"]
    assert got["version"] == 2 and got["attempts"] == 1 and got["generating_when_synced"]
    # Requests were paused in place: no flush (it would be refused) and none was aborted.
    assert not got["cache_flushed"]
    _check_in_place(got)


def test_prefix_cache_is_namespaced_by_version(inflight):
    """Hazard 2: a request of the new version sharing a finished old request's prompt starts
    from no cached KV and gets the new weights' log-probs; under the old key the stale KV is
    there (the control), and the log-probs are off."""
    got = inflight["prefix_cache"]
    assert got["new_key_cached_tokens"] == 0, got
    assert got["new_key_versions"] == [2], got
    assert got["new_key_vs_new_weights"] < LOGPROB_TOLERANCE, got
    assert got["old_key_cached_tokens"] >= got["prompt_tokens"] - 1, got
    assert got["old_key_vs_new_weights"] > 100 * LOGPROB_TOLERANCE, got


def test_a_failed_load_is_retried_while_requests_stay_paused(inflight):
    got = inflight["retried"]
    assert "error" not in got and got["attempts"] == 2 and got["version"] == 3, got
    # No token came from the half-loaded model between the attempts.
    _check_in_place(got)


def test_a_load_failing_every_attempt_fails_the_generator_and_never_resumes_it(inflight):
    got = inflight["failed"]
    assert "injected: bucket 3 of attempt 3" in got["error"], got
    assert "partially loaded" in got["error"] and "127.0.0.1" in got["error"], got
    assert "was failed by the weight sync" in got["failed_client_error"], got
    assert got["generator_failure"] and got["paused_after_failure"], got
    # A fresh client and sync reload everything; the paused requests then finish, and not one
    # of their tokens came from the partially loaded model.
    assert got["recovered_version"] == 4, got
    _check_in_place(got)


def test_retract_recomputes_the_kv_with_the_new_weights(inflight):
    """retract frees the running requests' KV but leaves their prompts' KV in the prefix cache:
    the sync flushes it, so after the update every token is the new weights' full recompute."""
    got = inflight["retract"]
    assert "generation_error" not in got and got["cache_flushed"], got
    assert got["finish"] == ["length"] * 4 and got["labels_monotone"], got
    assert all(0 < u < NUM_TOKENS for u in got["first_new"]), got["first_new"]
    assert got["old_vs_old_weights"] < LOGPROB_TOLERANCE, got
    assert got["new_vs_new_weights_full"] < LOGPROB_TOLERANCE, got


def test_abort_returns_partial_outputs_and_resubmissions_use_the_new_weights(inflight):
    got = inflight["abort"]
    assert got["finish"] == ["abort"] * 4 and got["all_old"] and got["cache_flushed"], got
    assert all(0 < n < NUM_TOKENS for n in got["lengths"]), got
    assert got["partial_vs_old_weights"] < LOGPROB_TOLERANCE, got
    assert got["resubmitted_cached_tokens"] == [0] * 4, got
    assert got["resubmitted_versions"] == [got["version"]], got
    assert got["resubmitted_vs_new_weights"] < LOGPROB_TOLERANCE, got
