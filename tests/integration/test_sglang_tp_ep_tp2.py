"""A tensor-parallel SGLang CPU engine (tiny Qwen3-MoE, fp32, tp_size 2 x ep_size 1: attention and
every expert split across both ranks), started once for this module, and the resharding weight
sync into it from an expert-parallel Megatron trainer.

- Engine layout: greedy tokens equal transformers' on the launch weights, prompt log-probs within
  1e-4.
- Trainer TP1 x EP2 (ETP1) -> engine TP2 x EP1 (a 2-rank torchrun, _tp_ep_sync_worker.py): each
  trainer rank holds 2 whole experts, each engine rank loads half of every expert from the full
  HF tensors; after sync 1, and after a train step and sync 2, the engine's log-probs equal the
  trainer's FP32 log-probs (1e-4; measured ~1e-6) and versions advance.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _hf_families import save_tiny_qwen3_moe  # noqa: E402
from _tp_ep_engines import check_engine_layout, check_sync, engine_fixtures  # noqa: E402
from _workers import run_worker  # noqa: E402


engine, fresh_engine = engine_fixtures("qwen3_moe_tp2", save_tiny_qwen3_moe, dtype="float32",
                                        tp_size=2, ep_size=1)


def test_engine_tp2_matches_transformers(fresh_engine):
    check_engine_layout(fresh_engine)


def test_sync_from_trainer_ep2_into_engine_tp2(fresh_engine, tmp_path):
    result = run_worker("_tp_ep_sync_worker.py", fresh_engine.server.settings.model_path,
                        fresh_engine.url, "ep2", num_ranks=2, directory=tmp_path, timeout_s=600)
    check_sync(result, engine_ranks=[2])
