"""An expert-parallel SGLang CPU engine (tiny Qwen3-MoE, fp32, tp_size 2 x ep_size 2: attention
tensor-parallel over both ranks, each rank holding 2 of the 4 experts whole), started once for
this module, and the resharding weight sync into it from Megatron trainers of other layouts.

- Engine layout: greedy tokens equal transformers' on the launch weights, prompt log-probs within
  1e-4 (measured ~7e-7). This needs megatron_rl/platform/sglang_cpu.py fix 9: SGLang's native
  MoE path fails on the -1 ids its dispatcher gives experts another EP rank owns.
- Trainer TP2 (+SP) x EP1 -> engine TP2 x EP2 (a 2-rank torchrun, _tp_ep_sync_worker.py; 4
  compute processes with the engine's 2 ranks): the weight-update group is the trainer's sender
  plus both engine ranks, every engine rank loads its shard of the full HF tensors; after sync 1,
  and after a train step and sync 2, the engine's log-probs equal the trainer's FP32 log-probs
  (1e-4; measured ~1e-6) and versions advance.
- Trainer PP2 -> that engine and a second, single-rank engine of the same model at once: each
  stage's sender has its own weight-update group over all three engine ranks, and SGLang serves
  one weight request per engine at a time in arrival order, so unless the stages' buckets go out
  in one cluster-wide order, one engine can take stage 0's bucket while the other takes stage
  1's, each waiting in a broadcast that needs the other (the Scout recipe's PP2 x 14 engines;
  issue 30 item 5). Same checks, on both engines.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _hf_families import save_tiny_qwen3_moe  # noqa: E402
from _tp_ep_engines import check_engine_layout, check_sync, engine_fixtures, reset  # noqa: E402
from _workers import run_worker  # noqa: E402


engine, fresh_engine = engine_fixtures("qwen3_moe_tp2_ep2", save_tiny_qwen3_moe, dtype="float32",
                                        tp_size=2, ep_size=2)


def test_engine_tp2_ep2_matches_transformers(fresh_engine):
    check_engine_layout(fresh_engine)


@pytest.fixture(scope="module")
def second_engine(engine, tmp_path_factory):
    """A single-rank engine of the module engine's model (a fixed KV cache: sized by memory
    fraction, a CPU engine takes most of the machine's memory)."""
    from megatron_rl.rollout import SGLangGenerator, SGLangServerSettings

    generator = SGLangGenerator.launch(SGLangServerSettings(
        model_path=engine.server.settings.model_path, dtype="float32", max_total_tokens=4096,
        startup_timeout_s=600, request_timeout_s=240,
        log_path=str(tmp_path_factory.mktemp("second_engine") / "server.log")))
    try:
        yield generator
    finally:
        generator.shutdown()


def test_sync_into_engine_tp2_ep2(fresh_engine, tmp_path):
    result = run_worker("_tp_ep_sync_worker.py", fresh_engine.server.settings.model_path,
                        fresh_engine.url, "tp2", num_ranks=2, directory=tmp_path, timeout_s=600)
    check_sync(result, engine_ranks=[2])


def test_pp2_sync_into_two_engines_at_once(fresh_engine, second_engine, tmp_path):
    reset(second_engine)
    result = run_worker("_tp_ep_sync_worker.py", fresh_engine.server.settings.model_path,
                        f"{fresh_engine.url},{second_engine.url}", "pp2", num_ranks=2,
                        directory=tmp_path, timeout_s=600)
    check_sync(result, engine_ranks=[2, 1])
