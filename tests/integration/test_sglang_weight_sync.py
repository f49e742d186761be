"""Real SGLang CPU servers (one tiny Llama-3-style, one tiny Qwen3-MoE; each started once per
test session and reset to its launch state before every test: tests/integration/conftest.py)
driven through megatron_rl.rollout, and the weight sync from a 2-rank Megatron trainer (torchrun
subprocess: TP2 for Llama, TP2+SP x EP2 for the MoE). The Llama run also syncs through the
colocated-tensor and disk transports.

References: the trainer's own FP32 log-probs (Megatron at TP2, computed without any gather) and
transformers' greedy decoding of the synced weights. Tolerance: generator and trainer log-probs
agree to 1e-4 per token (both fp32; measured ~1e-6), also for completions sampled at T = 0.7,
whose recorded log-probs are log softmax(logits / T) and which the trainer scores at the same T.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _workers import run_worker, still_alive  # noqa: E402

LOGPROB_TOLERANCE = 1e-4


def _check_sync_results(result: dict) -> None:
    # Before any sync the generator serves its own (different) random weights.
    assert result["stale_max_diff"] > 0.1
    sync1 = result["sync1"]
    assert sync1["version"] == 1 and sync1["num_buckets"] > 1 and sync1["cache_flushed"]
    assert result["generator_version_1"] == 1 and result["server_version_1"] == "1"
    # After the sync: the generator's log-probs are the trainer's FP32 log-probs.
    assert result["synced_max_diff"] < LOGPROB_TOLERANCE
    # Greedy decoding equals transformers' on the same weights; tokens carry version 1.
    assert result["greedy_generator"] == result["greedy_transformers"]
    assert all(v == 1 for versions in result["greedy_versions"] for v in versions)
    # The mismatch metric in the trainer's step equals the independent per-token mean, ~0.
    assert result["step_logp_mismatch"] == pytest.approx(result["independent_mismatch"],
                                                         abs=1e-6)
    assert result["step_logp_mismatch"] < LOGPROB_TOLERANCE and not result["step_skipped"]
    # Sampled at T = 0.7: the trainer's head at the same T gives the generator's log-probs, per
    # token and in the step's metric; scoring at T = 1 instead is far off.
    tempered = result["tempered"]
    assert tempered["max_diff"] < LOGPROB_TOLERANCE, tempered
    assert tempered["step_logp_mismatch"] == pytest.approx(tempered["independent_mismatch"],
                                                           abs=1e-6)
    assert tempered["step_logp_mismatch"] < LOGPROB_TOLERANCE, tempered
    # ... and the step's max is the largest per-token difference (all ranks, max-reduced).
    assert tempered["step_logp_mismatch_max"] == pytest.approx(tempered["max_diff"], abs=1e-6)
    assert tempered["untempered_max_diff"] > 0.01, tempered
    # The step moved the trainer; the generator lagged until sync 2 made it follow.
    assert result["trainer_moved"] > 0.01
    assert result["before_sync2_max_diff"] > 0.01
    assert result["sync2_version"] == 2 and result["server_version_2"] == "2"
    assert result["synced2_max_diff"] < LOGPROB_TOLERANCE
    # A sync to a dead server: a clear error on every rank, nothing changed, next sync works.
    assert "does not answer" in result["dead_error"] and "127.0.0.1" in result["dead_error"]
    assert result["dead_sync_version"] == 0
    assert result["trainer_changed_by_dead_sync"] == 0.0
    assert result["sync3_version"] == 3 and result["synced3_max_diff"] < LOGPROB_TOLERANCE


def _run_worker(generator, layout: str, directory: Path) -> dict:
    return run_worker("_weight_sync_worker.py", generator.server.settings.model_path,
                      generator.url, layout, num_ranks=2, directory=directory, timeout_s=400,
                      api_key=generator.server.settings.api_key)


def test_weight_sync_llama_tp2(llama_generator, tmp_path):
    result = _run_worker(llama_generator, "tp2", tmp_path)
    _check_sync_results(result)
    # The fallback transports reach the same server: colocated tensors (shared memory, reused
    # bucket buffers) and an HF folder on disk; each after a step that moved the trainer.
    for transport in ("tensor", "disk"):
        got = result["transports"][transport]
        assert got["trainer_moved"] > 0.01, transport
        assert got["synced_max_diff"] < LOGPROB_TOLERANCE, (transport, got)
        assert got["version"] == 1 and got["server_version"] == "1"
    assert result["transports"]["tensor"]["num_buckets"] > 1


def test_weight_sync_qwen3_moe_tp2_ep2(qwen3_moe_generator, tmp_path):
    _check_sync_results(_run_worker(qwen3_moe_generator, "tp2_ep2", tmp_path))


def test_generate_samples_logprobs_and_score_agree(llama_generator):
    """n samples per prompt with per-token log-probs; scoring the sampled sequence gives the
    same log-probs (prefill vs decode of the same weights)."""
    from megatron_rl.rollout import SamplingParams

    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    results = llama_generator.generate(prompts, SamplingParams(max_new_tokens=5, num_samples=3,
                                                               seed=11, ignore_eos=True))
    assert [(r.prompt_index, r.sample_index) for r in results] == \
        [(p, k) for p in range(2) for k in range(3)]
    for r in results:
        assert r.prompt_token_ids == tuple(prompts[r.prompt_index])
        assert len(r.token_ids) == 5 and r.finish_reason == "length"
        assert all(lp <= 0.0 for lp in r.logprobs)
        assert set(r.versions) == {int(llama_generator.server_weight_version())}
    (scored,) = llama_generator.score([list(results[0].prompt_token_ids + results[0].token_ids)])
    torch.testing.assert_close(scored[-5:], torch.tensor(results[0].logprobs), atol=1e-4,
                               rtol=0)


def _generate_in_background(generator, num_prompts: int, max_new_tokens: int):
    from megatron_rl.rollout import SamplingParams

    outputs, errors = [], []

    def run():
        try:
            outputs.extend(generator.generate(
                [[3, 4, 5 + i] for i in range(num_prompts)],
                SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)))
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outputs, errors


def test_pause_in_place_and_continue(llama_generator):
    """Requests running when the generator pauses in place finish after `resume` (they are not
    aborted) with all their tokens."""
    thread, outputs, errors = _generate_in_background(llama_generator, 16, 240)
    time.sleep(0.3)
    llama_generator.pause("in_place")
    try:
        time.sleep(1.5)
        assert thread.is_alive()  # paused: neither finished nor aborted
    finally:
        llama_generator.resume()
    thread.join(timeout=120)
    assert not errors and len(outputs) == 16
    assert all(r.finish_reason == "length" and len(r.token_ids) == 240 for r in outputs)


def test_abort_ends_running_requests(llama_generator):
    thread, outputs, errors = _generate_in_background(llama_generator, 16, 240)
    time.sleep(0.3)
    llama_generator.abort()
    thread.join(timeout=60)
    assert not errors and len(outputs) == 16
    aborted = [r for r in outputs if r.finish_reason == "abort"]
    assert aborted and all(len(r.token_ids) < 240 for r in aborted)


def test_server_error_message_reaches_the_caller(llama_generator):
    """A weight update outside begin/end: SGLang's own explanation is in our error."""
    from megatron_rl.rollout import GeneratorError, TensorSpec

    with pytest.raises(GeneratorError, match="begin_weight_update"):
        llama_generator.update_weights_from_distributed(
            [TensorSpec(name="model.norm.weight", dtype=torch.float32, shape=(64,))],
            group_name="none", version=99)
    assert llama_generator.is_healthy()


def test_graceful_shutdown_ends_every_process_and_removes_its_files(tiny_llama_server):
    """The shared server's last test ends it as on GPU (`shutdown(graceful=True)`: SIGTERM to
    the server process alone): SGLang drains and ends its own processes, without going through
    its crash path; the server's temporary directory (its ZMQ sockets) is removed. (On CPU the
    default is a SIGKILL of the whole group, which ends every other server of the suite.)"""
    import psutil

    tiny_llama_server.fresh()
    server, tiny_llama_server.server = tiny_llama_server.server, None  # this test ends it
    children = psutil.Process(server.process.pid).children(recursive=True)
    processes = [psutil.Process(server.process.pid), *children]
    # Fix 12's default on CPU: scheduler and detokenizer forked from the server process itself.
    scheduler = [p for p in children if "sglang::scheduler" in " ".join(p.cmdline())]
    assert len(scheduler) == 1 and scheduler[0].ppid() == server.process.pid, \
        [(p.pid, p.ppid(), " ".join(p.cmdline())[:80]) for p in children]
    assert not any("multiprocessing.forkserver" in " ".join(p.cmdline()) for p in children)
    scratch = Path(server.scratch_dir)
    assert any(p.is_socket() for p in scratch.iterdir())  # SGLang's sockets are there
    server.shutdown(graceful=True, timeout_s=120)
    assert server.process.returncode == 0  # it ended itself: no SIGKILL was needed
    log = Path(server.log_path).read_text(errors="replace")
    assert "Application shutdown complete" in log and "SIGQUIT received" not in log, log[-3000:]
    alive = still_alive(processes, timeout_s=60)
    assert not alive, [" ".join(p.cmdline()) for p in alive]
    assert not scratch.exists()
