"""The measured form of a hardware profile (megatron_rl/simulation/measured.py): the
non-negative least-squares fits against coefficients chosen by hand, the JSON the benchmark
(benchmarks/cpu_profile.py) writes and the `cpu` profile loads, and the timing classes using the
fits in place of the roofline."""
import json

import pytest

from megatron_rl.scaling.cost import PRESETS
from megatron_rl.simulation import EngineTiming, TrainerTiming, get_profile
from megatron_rl.simulation.measured import LinearFit, MeasuredCosts, fit_linear
from megatron_rl.simulation.profiles import CPU_PROFILE_JSON, cpu_profile

pytestmark = pytest.mark.unit


def test_fit_recovers_the_coefficients_of_exact_linear_data():
    # step = 4 ms + 0.8 ms x batch + 0.2 us x context token, on a grid like the benchmark's.
    rows = [[b, b * (p + 17)] for b in (1, 4, 16, 48) for p in (32, 96)]
    seconds = [0.004 + 0.0008 * b + 2e-7 * c for b, c in rows]
    fit = fit_linear(["batch", "context_tokens"], rows, seconds)
    assert fit.intercept == pytest.approx(0.004, rel=1e-9)
    assert fit.coefficients["batch"] == pytest.approx(0.0008, rel=1e-9)
    assert fit.coefficients["context_tokens"] == pytest.approx(2e-7, rel=1e-6)
    assert fit.max_relative_error < 1e-9 and fit.num_samples == 8
    assert fit(batch=10, context_tokens=1000) == pytest.approx(0.004 + 0.008 + 2e-4)


def test_fit_never_gives_a_negative_coefficient():
    # Times that fall with the variable (noise on a flat cost): plain least squares would give
    # a slope of -0.1; non-negative least squares clamps it to 0, leaving the mean as the
    # intercept: (1.0 + 0.9 + 0.8 + 0.7) / 4 = 0.85.
    fit = fit_linear(["tokens"], [[0], [1], [2], [3]], [1.0, 0.9, 0.8, 0.7])
    assert fit.coefficients["tokens"] == 0.0
    assert fit.intercept == pytest.approx(0.85)
    assert fit.max_relative_error == pytest.approx(0.15 / 0.7)


def test_fit_and_call_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="2 samples cannot fit 3 coefficients"):
        fit_linear(["batch", "context_tokens"], [[1, 10], [2, 20]], [0.1, 0.2])
    fit = LinearFit(intercept=1.0, coefficients={"tokens": 2.0})
    with pytest.raises(ValueError, match="do not match"):
        fit(batch=3)


def _costs() -> MeasuredCosts:
    return MeasuredCosts(
        decode_step=LinearFit(intercept=0.004, coefficients={"batch": 0.001,
                                                             "context_tokens": 1e-6}),
        prefill=LinearFit(intercept=0.01, coefficients={"tokens": 2e-5}),
        train_step=LinearFit(intercept=0.02, coefficients={"tokens": 8e-5}),
        score=LinearFit(intercept=0.005, coefficients={"tokens": 4e-5}),
        weight_update_s=0.07, engine_start_s=21.0, provenance={"date": "2026-12-05"})


def test_cpu_profile_loads_the_benchmarks_json_and_times_with_it(tmp_path):
    path = tmp_path / "cpu_profile.json"
    path.write_text(json.dumps(_costs().to_json()))
    profile = cpu_profile(path)
    assert profile.measured and profile.measured_costs == _costs()
    model = PRESETS["paper-8b"]  # only its bytes (KV room: 4 devices) matter; the fits time
    engine = EngineTiming(model=model, profile=profile, devices_per_engine=4)
    # 4 ms + 16 x 1 ms + 1600 x 1 us = 21.6 ms
    assert engine.decode_step_seconds(16, 1600) == pytest.approx(0.0216)
    assert engine.prefill_seconds(500) == pytest.approx(0.01 + 0.01)
    assert engine.weight_load_seconds(123e6) == 0.07  # one whole update, whatever the bytes
    assert engine.init_group_seconds == 0.0  # the real run joins its group once
    trainer = TrainerTiming(model=model, profile=profile, num_devices=1)
    assert trainer.train_step_seconds(1000) == pytest.approx(0.02 + 0.08)
    assert trainer.score_seconds(1000) == pytest.approx(0.005 + 0.04)


def test_cpu_profile_without_its_json_is_the_placeholder(tmp_path):
    profile = cpu_profile(tmp_path / "absent.json")
    assert not profile.measured and profile.measured_costs is None
    engine = EngineTiming(model=PRESETS["paper-8b"], profile=profile, devices_per_engine=4)
    assert engine.init_group_seconds == 2.0  # the roofline profile's default


def test_a_malformed_json_names_the_benchmark(tmp_path):
    path = tmp_path / "cpu_profile.json"
    data = _costs().to_json()
    del data["engine"]["decode_step_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="decode_step_s.*benchmarks/cpu_profile.py"):
        cpu_profile(path)


def test_the_committed_cpu_profile_is_measured():
    """megatron_rl/simulation/cpu_profile.json (benchmarks/cpu_profile.py's output) is what the
    `cpu` profile uses, with where and when it was measured."""
    assert CPU_PROFILE_JSON.is_file()
    costs = get_profile("cpu").measured_costs
    assert get_profile("cpu").measured and costs == MeasuredCosts.load(CPU_PROFILE_JSON)
    assert {"date", "machine", "load_average_before", "command"} <= set(costs.provenance)
    # The tiny model's decode step grows with the batch (measured: ~5 ms at 1, ~50 at 48).
    assert costs.decode_step_seconds(48, 48 * 100) > costs.decode_step_seconds(1, 100) > 0
