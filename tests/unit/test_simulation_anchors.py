"""What the check against published figures adds to the simulator (docs/simulation.md, "Against
published figures"): the H20 (the verl runs' GPU), the published models' shapes
(simulation/anchors.py) against their published parameter counts, and the colocated simulated
cluster (simulation/cluster.py): engines and trainer on the same devices, never at once."""
from __future__ import annotations

import contextlib
import types

import pytest

from megatron_rl.config import load_config
from megatron_rl.scaling.cost import PRESETS, decode_step, kv_bytes_per_token

pytestmark = pytest.mark.unit


def test_the_h20_has_its_reported_figures_and_a_profile():
    from megatron_rl.scaling.hardware import ACCELERATORS
    from megatron_rl.simulation.profiles import get_profile

    h20 = ACCELERATORS["H20"]
    assert (h20.bf16_tflops, h20.fp8_tflops, h20.hbm_gb_per_s, h20.memory_gb) == (
        148.0, 296.0, 4000.0, 96.0)
    profile = get_profile("H20")
    assert profile.accelerator is h20
    assert (profile.devices_per_node, profile.nvlink_domain, profile.nvlink_gb_per_s) \
        == (8, 8, 450.0)
    # A batch-1 decode step of a 7.6B bf16 model on one H20 reads its 15.2 GB at 60 % of 4 TB/s,
    # plus the fixed cost of its 28 layers at 99.1 us each (one device: no TP term).
    from megatron_rl.simulation.anchors import SHAPES

    model = SHAPES["qwen2.5-math-7b"].cost_config(hardware="H20")
    seconds, bound, _ = decode_step(model, h20, 1, 1, 0)
    assert bound == "memory"
    assert seconds == pytest.approx(2 * 7.6156e9 / (4000e9 * 0.6) + 28 * 99.1e-6, rel=1e-4)


def test_the_decode_floor_defaults_are_the_section_19_fit(monkeypatch):
    """cost.py's decode_layer_overhead_us / decode_tp_layer_overhead_us are the least-squares
    fit of benchmarks/decode_floor_fit.py to SGLang's batch-1 decode speeds on H20 (ANCHOR_FIGURES
    section 19), and with them each fitted row comes within 5 % of its published speed (the
    roofline alone is 2.6-6x too fast). By hand for Qwen3-30B-A3B bf16 on one H20: published
    step (2049 / 137.18 - prefill) / 2048 = 7.29 ms; modelled 2.84 ms of roofline + 48 x 99.1 us."""
    import importlib.util
    import sys
    from pathlib import Path

    from megatron_rl.scaling.cost import CostConfig

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_floor_fit.py"
    spec = importlib.util.spec_from_file_location("decode_floor_fit", path)
    fit = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decode_floor_fit", fit)  # its dataclass looks itself up
    spec.loader.exec_module(fit)
    knobs = fit.fit()
    defaults = CostConfig()
    assert defaults.decode_layer_overhead_us == pytest.approx(
        knobs["decode_layer_overhead_us"], abs=0.05)
    assert defaults.decode_tp_layer_overhead_us == pytest.approx(
        knobs["decode_tp_layer_overhead_us"], abs=0.05)
    for row in fit.FIT_ROWS:
        assert fit.modelled_speed(row, **knobs) == pytest.approx(row.speed, rel=0.05)
        assert fit.modelled_speed(row, **fit.ROOFLINE) > 2.5 * row.speed
    qwen30b = fit.FIT_ROWS[0]
    assert fit.published_step(qwen30b) == pytest.approx(7.29e-3, abs=0.01e-3)
    assert fit.modelled_step(qwen30b) == pytest.approx(2.84e-3 + 48 * 99.1e-6, abs=0.01e-3)


def test_the_trainer_floor_default_is_the_verl_fit(monkeypatch):
    """cost.py's train_min_tokens_per_device is the fit of benchmarks/trainer_floor_fit.py to
    verl's update_actor (ANCHOR_FIGURES section 1), and the trainer it models scales as verl's
    colocated one did: linear from 32 to 64 H20s (270 -> 133 s published), then no faster
    (114 s on 128). By hand: 512 x 16 samples of 1400 tokens in 16 optimizer steps are 716,800
    tokens an optimizer step, 22,400 a device on 32 GPUs (linear: 6N x 11.47M / (32 x 148 TFLOP/s
    x 0.4)), 5,600 on 128, under the floor: 6N x 9,216 x 16 / (148 TFLOP/s x 0.4), as on 256;
    the trainer stops scaling at ceil(716,800 / 9,216) = 78 devices. The simulated trainer
    (simulation/trainer.py) times its steps and its scoring with the same formula."""
    import dataclasses
    import importlib.util
    import sys
    from pathlib import Path

    from megatron_rl.scaling.cost import CostConfig, estimate_cost
    from megatron_rl.simulation.anchors import SHAPES
    from megatron_rl.simulation.profiles import get_profile
    from megatron_rl.simulation.trainer import TrainerTiming

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_floor_fit.py"
    spec = importlib.util.spec_from_file_location("trainer_floor_fit", path)
    fit = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "trainer_floor_fit", fit)  # its dataclass looks itself up
    spec.loader.exec_module(fit)
    floor = CostConfig().train_min_tokens_per_device
    assert floor == pytest.approx(fit.fit(), abs=1.0)
    assert fit.loss(floor) < 0.75 * fit.loss(0.0)

    config = SHAPES["qwen2.5-math-7b"].cost_config(
        hardware="H20", num_prompts_per_step=512, samples_per_prompt=16, prompt_tokens=200,
        generated_tokens=1200, optimizer_steps_per_step=16)
    report = estimate_cost(config)
    six_n, peak = 6 * config.num_active_params, 148e12 * 0.4
    tokens = 512 * 16 * 1400
    assert report.train_seconds(32) == pytest.approx(six_n * tokens / (32 * peak), rel=1e-3)
    assert report.train_seconds(64) == pytest.approx(report.train_seconds(32) / 2, rel=1e-9)
    assert report.train_seconds(128) == pytest.approx(six_n * 9216 * 16 / peak, rel=1e-3)
    assert report.train_seconds(128) == report.train_seconds(256)
    assert report.train_seconds(128) == pytest.approx(113.81, rel=0.01)  # the fitted row
    assert report.trainer_scaling_limit == 78
    linear = estimate_cost(dataclasses.replace(config, train_min_tokens_per_device=0.0))
    assert linear.train_seconds(128) == pytest.approx(report.train_seconds(32) / 4, rel=1e-9)
    assert linear.trainer_scaling_limit == 0

    for devices in (32, 128):  # linear, then floored
        timing = TrainerTiming(model=config, profile=get_profile("H20"), num_devices=devices)
        assert timing.train_step_seconds(tokens) == report.train_seconds(devices)
        assert timing.score_seconds(tokens) == pytest.approx(report.train_seconds(devices) / 3,
                                                             rel=1e-9)


@pytest.mark.parametrize("name", ["qwen2.5-math-7b", "qwen3-30b-a3b", "qwen3-235b-a22b",
                                  "deepseek-v3"])
def test_the_shapes_count_their_published_parameters(name):
    from megatron_rl.simulation.anchors import SHAPES

    shape = SHAPES[name]
    assert shape.total_params == pytest.approx(shape.published_total, rel=0.02)
    if shape.moe:
        assert shape.active_params == pytest.approx(shape.published_active, rel=0.03)
    else:
        assert shape.active_params == shape.total_params
    config = shape.cost_config()
    assert config.total_params == shape.total_params
    assert config.num_active_params == shape.active_params


def test_qwen2_5_7b_by_hand():
    """Qwen2.5-7B's model card: 6.53B parameters without the embeddings; by hand: attention
    3584 x (3584 + 2 x 512) x 2 + biases, FFN 3 x 3584 x 18944, two norms, 28 layers."""
    from megatron_rl.simulation.anchors import SHAPES

    shape = SHAPES["qwen2.5-math-7b"]
    per_layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512) + 3 * 3584 * 18944 \
        + 2 * 3584
    embeddings = 2 * 152064 * 3584 + 3584  # untied input and output, final norm
    assert shape.total_params == 28 * per_layer + embeddings
    assert (shape.total_params - embeddings) / 1e9 == pytest.approx(6.53, abs=0.01)


def test_deepseek_v3_caches_the_mla_latent():
    """MLA keeps kv_lora_rank 512 + the RoPE key 64 per token and layer (bf16), not K and V of
    128 heads: 61 x 576 x 2 bytes."""
    from megatron_rl.simulation.anchors import SHAPES

    assert kv_bytes_per_token(SHAPES["deepseek-v3"].cost_config()) == 61 * 576 * 2
    qwen = SHAPES["qwen3-235b-a22b"]
    assert kv_bytes_per_token(qwen.cost_config()) == 2 * 94 * 4 * 128 * 2


@pytest.fixture
def colocated(tmp_path):
    from megatron_rl.simulation.cluster import SimulatedCluster, SimulationSettings
    from megatron_rl.simulation.simulate import stand_in_model

    model = stand_in_model(tmp_path / "model", context=4096)
    cfg = load_config("examples/configs/tiny_pipeline.yaml", [
        f"output_dir={tmp_path}", f"model.hf_checkpoint={model}", "cluster.colocated=true",
        "rollout.num_generators=2", "rollout.tp_size=2", "parallelism.world_size=4",
        "rollout.max_off_policyness=0", "rollout.health_check_timeout_s=2"])
    with contextlib.ExitStack() as stack:
        yield SimulatedCluster.start(cfg, tmp_path, stack, SimulationSettings(
            hardware="H100", model=PRESETS["paper-8b"], time_scale=1000.0))


def _batch(tokens: int):
    import torch

    return types.SimpleNamespace(token_ids=[torch.ones(tokens, dtype=torch.long)],
                                 loss_mask=[torch.ones(tokens, dtype=torch.bool)])


def test_colocated_engines_and_trainer_share_the_devices(colocated):
    from megatron_rl.simulation.cluster import offload_seconds

    layout = colocated.layout
    assert layout.colocated and colocated.num_devices == 4 == layout.num_trainer_ranks
    assert colocated.trainer_timing.num_devices == 4  # the trainer uses every device
    # The engines' memory is what the trainer's bf16 parameters (8.03e9 x 2 / 4 devices) leave.
    paper = PRESETS["paper-8b"]
    assert colocated.engine_timing.model.mem_fraction_static == pytest.approx(
        paper.mem_fraction_static - 2 * 8.03e9 / 4 / 80e9)
    # A train step takes its compute plus the optimizer state (12 B a parameter over the 4
    # devices) to the host and back over PCIe Gen5 (64 GB/s at the profile's 0.8). Its compute:
    # 1000 tokens are 250 a device, under the trainer floor (cost.train_min_tokens_per_device,
    # 9,216 tokens a device): the step takes as long as 9,216 tokens on one device would.
    trainers = colocated.trainers
    trainers.train_step(_batch(1000))
    assert offload_seconds(trainers.timing) == pytest.approx(12 * 8.03e9 / 4 / (64e9 * 0.8))
    assert trainers.modelled_s["offload"] == pytest.approx(2 * offload_seconds(trainers.timing))
    assert trainers.modelled_s["train"] == pytest.approx(6 * 8.03e9 * 9216 / (989.5e12 * 0.4))
    [(began, ended)] = trainers.train_spans
    assert ended > began
    assert "old_logprob" not in trainers.modelled_s  # this project's driver: no such pass
    # A baseline that recomputes the old policy's log-probs (verl's old_log_prob phase) adds a
    # forward pass over the batch before the step: 2N a token at train_mfu over the 4 devices,
    # floored as the step is.
    colocated.settings.recompute_old_logprobs = True
    trainers.train_step(_batch(1000))
    assert trainers.modelled_s["old_logprob"] == pytest.approx(2 * 8.03e9 * 9216 / (989.5e12 * 0.4))
    assert trainers.modelled_s["train"] == pytest.approx(2 * 6 * 8.03e9 * 9216 / (989.5e12 * 0.4))
    # The weight hand-over: each device loads its engine's shard (bf16 weights / 2 devices).
    report = trainers.sync_weights()
    assert report.num_bytes == int(2 * 8.03e9) // 2
    assert {e.weight_version for e in colocated.generators.engines} == {1}


def test_a_colocated_train_step_refuses_an_engine_that_still_generates(colocated):
    """The real driver releases the engines only once no group generates; a train step that
    found an engine holding a request would overlap generation and training on one device."""
    import time

    import aiohttp

    from megatron_rl.simulation.cluster import ColocatedOverlap

    engine = colocated.generators.engines[1]

    async def post(path, body):
        async with aiohttp.ClientSession(headers={
                "Authorization": f"Bearer {colocated.api_key}"}) as session:
            async with session.post(f"{engine.url}{path}", json=body) as response:
                assert response.status == 200, await response.text()

    colocated.trainers.train_step(_batch(10))  # idle engines: fine
    # Paused (SGLang's /pause_generation), the engine holds the request it is sent, queued.
    colocated.loop.call(post("/pause_generation", {"mode": "in_place"}))
    colocated.loop.submit(post("/generate", {"input_ids": [1, 2, 3],
                                             "sampling_params": {"max_new_tokens": 8}}))
    deadline = time.monotonic() + 10
    while engine.num_running + engine.num_queued == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ColocatedOverlap, match="generator-1"):
        colocated.trainers.train_step(_batch(10))
    colocated.loop.call(post("/continue_generation", {}))  # it finishes; the fixture stops it
    while engine.num_running + engine.num_queued and time.monotonic() < deadline:
        time.sleep(0.01)
