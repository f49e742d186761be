"""The simulator's timing models (megatron_rl/simulation: timing.py, trainer.py, profiles.py)
against `megatron-rl cost` (the same formulas must give the same figures) and against values
computed by hand from the spec sheets."""
import dataclasses

import pytest

from megatron_rl.scaling.cost import PRESETS, estimate_cost
from megatron_rl.scaling.hardware import ACCELERATORS
from megatron_rl.simulation import EngineTiming, TrainerTiming, get_profile
from megatron_rl.simulation.profiles import PROFILES

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("reference_model", [False, True])
def test_engine_and_trainer_times_are_the_cost_models(preset, reference_model):
    config = dataclasses.replace(PRESETS[preset], reference_model=reference_model)
    report = estimate_cost(config)
    profile = get_profile(config.hardware)
    engine = EngineTiming(model=config, profile=profile)
    assert engine.devices_per_engine == report.generator_devices_per_instance
    batch, context = report.decode_batch, report.tokens.mean_decode_context
    assert engine.decode_step_seconds(batch, batch * context) \
        == pytest.approx(report.decode_step_seconds, rel=1e-12)
    assert abs(engine.kv_capacity_tokens // context - report.decode_batch_memory_cap) <= 1
    assert engine.prefill_seconds(report.tokens.prefill * report.num_samples) \
        * engine.devices_per_engine == pytest.approx(report.prefill_device_seconds, rel=1e-12)
    trainer = TrainerTiming(model=config, profile=profile, num_devices=16)
    assert trainer.train_step_seconds(report.tokens.trained * report.num_samples) * 16 \
        == pytest.approx(report.train_device_seconds, rel=1e-12)


def test_paper_8b_on_h100_by_hand():
    """Llama-3.1-8B shape (8.03e9 params, 32 layers, 8 KV heads x 128, bf16) on H100 SXM:
    989.5 dense bf16 TFLOP/s, 3.35 TB/s HBM, 50 GB/s NIC, 10 GB/s storage per node; MFU 0.4
    train, 0.5 prefill, 0.6 of HBM in decode, 0.8 of a link."""
    profile = get_profile("H100")
    model = PRESETS["paper-8b"]
    engine = EngineTiming(model=model, profile=profile)
    weights = 8.03e9 * 2
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, bf16
    # Batch 1, 1000 tokens of context: weights + KV read at 60% of HBM bandwidth, plus the
    # step's fixed cost, 32 layers x 99.1 us (a one-device engine: no TP term).
    assert engine.devices_per_engine == 1
    assert engine.decode_step_seconds(1, 1000) == pytest.approx(
        (weights + 1000 * kv_per_token) / (3.35e12 * 0.6) + 32 * 99.1e-6)
    assert engine.prefill_seconds(4096) == pytest.approx(2 * 8.03e9 * 4096 / (989.5e12 * 0.5))
    assert engine.kv_capacity_tokens == int((80e9 * 0.85 - weights * 1.2) // kv_per_token)
    assert engine.weight_load_seconds(1e9) == pytest.approx(1e9 / (50e9 * 0.8))
    trainer = TrainerTiming(model=model, profile=profile, num_devices=16)
    assert trainer.train_step_seconds(1_000_000) == pytest.approx(
        6 * 8.03e9 * 1e6 / (989.5e12 * 0.4 * 16))
    assert trainer.score_seconds(1_000_000) == pytest.approx(
        2 * 8.03e9 * 1e6 / (989.5e12 * 0.4 * 16))
    assert trainer.checkpoint_seconds() == pytest.approx(8.03e9 * 18 / (2 * 10e9 * 0.8))
    assert trainer.weight_push_seconds() == pytest.approx(weights / (50e9 * 0.8))
    over_nvlink = TrainerTiming(model=model, profile=profile, num_devices=16,
                                weights_over_nvlink=True)
    assert over_nvlink.weight_push_seconds() == pytest.approx(weights / (450e9 * 0.8))


def test_profiles_use_the_cost_models_accelerators_and_the_cpu_one_is_measured():
    for name in ("H100", "H200", "B200", "GB200"):
        assert PROFILES[name].accelerator is ACCELERATORS[name]
    assert PROFILES["GB200"].nvlink_domain == 72 and PROFILES["H100"].nvlink_domain == 8
    assert PROFILES["cpu"].measured  # benchmarks/cpu_profile.py (test_simulation_measured.py)
    scout_on_cpu = PROFILES["cpu"].cost_config(PRESETS["scout-gb200"])
    assert scout_on_cpu.hardware == "GB200"  # the cost model has no cpu; the profile times
    assert PROFILES["B200"].cost_config(PRESETS["paper-8b"]).hardware == "B200"
    with pytest.raises(ValueError, match="choose one of H100, H200, B200, GB200, cpu"):
        get_profile("TPU")
    with pytest.raises(ValueError, match="leave no KV-cache memory"):
        EngineTiming(model=PRESETS["scout-gb200"], profile=get_profile("H100"),
                     devices_per_engine=1)
