"""The RLVR cost model against hand-computed values, its monotonicity, and `megatron-rl cost`."""
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.cli import main as megatron_rl_main
from megatron_rl.scaling.cost import (PRESETS, CostConfig, config_from_args, estimate_cost,
                                      token_counts)
from megatron_rl.scaling.hardware import ACCELERATORS

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# A small dense model on H100 whose every number is computed by hand below.
SMALL = CostConfig(total_params=1e9, num_layers=4, num_kv_heads=2, head_dim=64,
                   num_prompts_per_step=2, samples_per_prompt=4, prompt_tokens=100,
                   generated_tokens=1000, max_running_requests=16, train_mfu=0.5,
                   prefill_mfu=0.5, decode_mfu=0.5, decode_bandwidth_efficiency=0.5)


def test_small_dense_config_by_hand():
    r = estimate_cost(SMALL)
    assert r.num_samples == 8
    assert r.decode_flops == pytest.approx(2 * 1e9 * 1000 * 8)  # 1.6e13
    assert r.prefill_flops == pytest.approx(2 * 1e9 * 100 * 8)  # 1.6e12
    assert r.train_flops == pytest.approx(6 * 1e9 * 1100 * 8)  # 5.28e13
    h100_bf16, h100_bw = 989.5e12, 3350e9
    assert r.train_device_seconds == pytest.approx(5.28e13 / (h100_bf16 * 0.5))
    assert r.prefill_device_seconds == pytest.approx(1.6e12 / (h100_bf16 * 0.5))
    # Decode: 1 device; KV per token 2 (K,V) x 4 layers x 2 heads x 64 x 2 bytes = 2048 B; mean
    # context 100 + 1000/2 = 600 tokens; batch 16 (memory would allow far more).
    assert r.generator_devices_per_instance == 1 and r.decode_batch == 16
    assert r.decode_batch_memory_cap == math.floor((80e9 * 0.85 - 2e9 * 1.2) / (2048 * 600))
    # Weights + KV read per step, plus the fixed cost: 4 layers x 99.1 us (one device: no TP).
    step = (2e9 + 16 * 2048 * 600) / (h100_bw * 0.5) + 4 * 99.1e-6
    assert r.decode_bound == "memory"
    assert r.decode_step_seconds == pytest.approx(step)
    assert r.decode_device_seconds == pytest.approx(8 * 1000 / 16 * step)
    generator = 8 * 1000 / 16 * step + 1.6e12 / (h100_bf16 * 0.5)
    trainer = 5.28e13 / (h100_bf16 * 0.5)
    assert r.generator_to_trainer_ratio == pytest.approx(generator / trainer)
    assert r.gpu_hours_per_step == pytest.approx((generator + trainer) / 3600)
    assert r.gpu_hours_per_run == pytest.approx(1000 * (generator + trainer) / 3600)
    assert r.min_trainer_devices == 1 and r.min_generator_devices == 1


def test_moe_uses_active_params_for_flops_and_reads_touched_experts():
    scout = PRESETS["scout-gb200"]
    r = estimate_cost(scout)
    assert r.decode_flops == pytest.approx(2 * 17e9 * 12000 * 768)
    assert r.train_flops == pytest.approx(6 * 17e9 * (512 + 12000) * 768)
    assert r.experts_touched_fraction == pytest.approx(1 - (15 / 16) ** r.decode_batch)
    # With one sequence per step and top-1 routing, exactly the active parameters are read:
    # shared 109 - 16 x 92/15 = 10.87B plus one expert of 92/15 = 6.13B = 17B.
    single = estimate_cost(dataclasses.replace(scout, max_running_requests=1))
    assert single.experts_touched_fraction == pytest.approx(1 / 16)
    kv = 2 * 48 * 8 * 128 * 2 * (512 + 6000)
    gb200 = ACCELERATORS["GB200"]
    engine = single.generator_devices_per_instance
    assert engine == 4  # fixed cost: 48 layers x (99.1 us + 21.7 us of TP all-reduces)
    assert single.decode_step_seconds == pytest.approx(
        (17e9 * 2 + kv) / (engine * gb200.hbm_gb_per_s * 1e9 * 0.6) + 48 * 120.8e-6)


def test_min_devices_hold_the_model_copies():
    # 8B: 8.03e9 x 18 B x 1.2 = 173 GB -> 3 x 80 GB; generator 16 GB x 1.2 fits one H100.
    paper = estimate_cost(PRESETS["paper-8b"])
    assert (paper.min_trainer_devices, paper.min_generator_devices, paper.min_devices) == (3, 1, 4)
    # Scout: 109e9 x 18 x 1.2 = 2,354 GB -> 13 x 186 GB; +2 B/param reference -> 2,616 GB -> 15.
    scout = estimate_cost(PRESETS["scout-gb200"])
    assert scout.min_trainer_devices == 13
    assert estimate_cost(dataclasses.replace(PRESETS["scout-gb200"], reference_model=True)
                         ).min_trainer_devices == 15
    # Generator: 218 GB x 1.2 over 186 x 0.85 GB usable -> 2; auto engine keeps weights <= half.
    assert scout.min_generator_devices == 2 and scout.generator_devices_per_instance == 4


def test_multi_turn_prefill_exact_sum_by_hand():
    # P = 100, 3 turns of 100 generated tokens, 20 observation tokens before turns 2 and 3:
    # turn 1 prefills 100, turn 2 re-reads 100 + 100 + 20 = 220, turn 3 re-reads 340.
    config = dataclasses.replace(SMALL, prompt_tokens=100, generated_tokens=300, num_turns=3,
                                 observation_tokens=20)
    t = token_counts(config)
    assert t.prefill == 100 + 220 + 340
    assert t.decode == 300 and t.trained == 100 + 300 + 2 * 20
    assert t.rule_of_thumb_total == 300 * (1 + 3 / 2)
    assert t.mean_decode_context == pytest.approx((150 + 270 + 390) / 3)  # mean over turns
    # P = O = 0: the exact total is decode x (1 + (T-1)/2); the rule of thumb uses T/2.
    bare = token_counts(dataclasses.replace(config, prompt_tokens=0, observation_tokens=0,
                                            generated_tokens=400, num_turns=4))
    assert bare.prefill == 100 * (0 + 1 + 2 + 3)
    assert bare.decode + bare.prefill == 400 * (1 + 3 / 2)
    assert bare.rule_of_thumb_total == 400 * (1 + 4 / 2)
    # Prefix caching: the prompt once per group of 4, then only the new observation tokens.
    cached = token_counts(dataclasses.replace(config, prefix_caching=True))
    assert cached.prefill == 100 / 4 + 2 * 20
    report = estimate_cost(config)
    assert report.prefill_flops == pytest.approx(2 * 1e9 * 660 * 8)


def test_generator_share_grows_as_decode_efficiency_falls():
    for base in (SMALL, PRESETS["paper-8b"], PRESETS["scout-gb200"]):
        ratios = [estimate_cost(dataclasses.replace(base, decode_bandwidth_efficiency=e))
                  .generator_to_trainer_ratio for e in (0.9, 0.6, 0.3, 0.1)]
        assert all(lo < hi for lo, hi in zip(ratios, ratios[1:])), ratios
        assert ratios[-1] / ratios[0] > 4  # memory-bound decode: ~inversely proportional


def test_synchronous_rl_pays_the_long_tail():
    pipelined = estimate_cost(SMALL)
    synchronous = estimate_cost(dataclasses.replace(SMALL, pipeline_rl=False,
                                                    long_tail_factor=3.0))
    assert synchronous.decode_device_seconds == pytest.approx(
        3.0 * pipelined.decode_device_seconds)
    assert synchronous.train_device_seconds == pipelined.train_device_seconds


def test_layout_is_the_best_whole_engine_split():
    report = estimate_cost(dataclasses.replace(PRESETS["scout-gb200"], weight_sync_seconds=5.0))
    layout = report.layout
    assert layout.num_generator_devices + layout.num_trainer_devices == 72
    assert layout.num_generator_devices % report.generator_devices_per_instance == 0
    # Naive reference: try every split.
    best = min(
        (max(report.generator_device_seconds / g, report.train_device_seconds / (72 - g)) + 5.0, g)
        for g in range(1, 72)
        if g % report.generator_devices_per_instance == 0
        and 72 - g >= report.min_trainer_devices)
    assert layout.step_seconds == pytest.approx(best[0])
    assert layout.num_generator_devices == best[1]
    assert layout.gpu_hours_per_step == pytest.approx(72 * best[0] / 3600)


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match=r"train_mfu=0.0 must be in \(0, 1\]"):
        CostConfig(train_mfu=0.0)
    with pytest.raises(ValueError, match="unknown hardware 'A100'"):
        CostConfig(hardware="A100")
    with pytest.raises(ValueError, match="needs active_params"):
        CostConfig(num_experts=16)
    with pytest.raises(ValueError, match="generator_devices_per_instance=1 cannot hold"):
        estimate_cost(dataclasses.replace(PRESETS["scout-gb200"],
                                          generator_devices_per_instance=1))
    with pytest.raises(ValueError, match="total_devices=8 is too few"):
        estimate_cost(dataclasses.replace(PRESETS["scout-gb200"], total_devices=8))


def test_hardware_table_is_consistent():
    for accelerator in ACCELERATORS.values():
        assert accelerator.peak_flops("fp8") == 2 * accelerator.peak_flops("bf16")
    with pytest.raises(ValueError, match="precision 'fp4'"):
        ACCELERATORS["H100"].peak_flops("fp4")


def test_cost_command_prints_the_table_and_applies_overrides(capsys):
    assert megatron_rl_main(["cost", "--preset", "paper-8b"]) == 0
    printed = capsys.readouterr().out
    assert "generator : trainer devices" in printed and "GPU-hours per step" in printed
    assert "layout on 80 devices" in printed
    config, as_json = config_from_args(["--preset", "scout-gb200", "--decode-bandwidth-efficiency",
                                        "0.3", "--no-pipeline-rl", "--json"])
    assert as_json and config.decode_bandwidth_efficiency == 0.3 and not config.pipeline_rl
    assert config.total_params == 109e9  # the rest of the preset is kept
    assert megatron_rl_main(["cost", "--generated-tokens", "4000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = estimate_cost(CostConfig(generated_tokens=4000))
    assert data["generator_to_trainer_ratio"] == pytest.approx(expected.generator_to_trainer_ratio)
    assert data["config"]["generated_tokens"] == 4000


def test_cost_command_errors_exit_2(capsys):
    assert megatron_rl_main(["cost", "--train-mfu", "1.5"]) == 2
    assert "train_mfu=1.5" in capsys.readouterr().err


def test_cost_tool_script(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "tools" / "cost_model.py"), "--preset",
                             "scout-gb200"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "RLVR cost model (GB200)" in result.stdout
