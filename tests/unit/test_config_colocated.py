"""Colocated placement's configuration: what RunConfig and the server settings accept and what
they refuse with a message naming the fix (the run itself: tests/e2e/test_train_colocated.py)."""
import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.rollout import SGLangServerSettings

pytestmark = pytest.mark.unit

RECIPE = "examples/configs/tiny_pipeline.yaml"


def test_colocated_needs_a_synchronous_schedule_and_the_trainer_devices():
    with pytest.raises(ConfigError, match="rollout.max_off_policyness=0"):
        load_config(RECIPE, ["cluster.colocated=true", "rollout.max_off_policyness=2"])
    sync = load_config(RECIPE, ["cluster.colocated=true", "rollout.max_off_policyness=0"])
    assert sync.cluster.colocated
    ppo = load_config(RECIPE, ["cluster.colocated=true", "rollout.mode=ppo_off_policy",
                               "rollout.max_off_policyness=2"])
    assert ppo.rollout.mode == "ppo_off_policy"
    with pytest.raises(ConfigError, match="parallelism.world_size 1"):
        load_config(RECIPE, ["cluster.colocated=true", "rollout.max_off_policyness=0",
                             "rollout.num_generators=2"])


def test_colocated_server_gets_its_gpus_and_the_memory_saver(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    settings = SGLangServerSettings(model_path=str(tmp_path), device="cuda",
                                    enable_memory_saver=True, visible_devices=("2", "3"))
    assert "--enable-memory-saver" in settings.server_args(port=1)
    plain = SGLangServerSettings(model_path=str(tmp_path), device="cpu")
    assert "--enable-memory-saver" not in plain.server_args(port=1)


def test_colocated_needs_a_memory_fraction_for_the_engines():
    # Null leaves each engine SGLang's default share of a device the trainer also holds.
    with pytest.raises(ConfigError) as refused:
        load_config(RECIPE, ["cluster.colocated=true", "rollout.max_off_policyness=0",
                             "rollout.mem_fraction_static=null"])
    message = str(refused.value)
    assert "\n" not in message
    assert "cluster.colocated" in message and "rollout.mem_fraction_static" in message
    assert "megatron-rl plan" in message
    # Disaggregated engines own their devices: null stays SGLang's choice.
    plain = load_config(RECIPE, ["rollout.mem_fraction_static=null"])
    assert plain.rollout.mem_fraction_static is None and not plain.cluster.colocated


def test_colocated_trainer_offloads_between_steps():
    from megatron_rl.trainer import TrainerSettings

    colocated = load_config(RECIPE, ["cluster.colocated=true", "rollout.max_off_policyness=0"])
    assert TrainerSettings.from_run_config(colocated).offload_between_steps
    assert not TrainerSettings.from_run_config(load_config(RECIPE)).offload_between_steps
