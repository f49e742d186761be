"""The `megatron-rl` entry point dispatches to each job's own `main` and explains what is missing."""
import subprocess
import sys

import pytest

from megatron_rl import cli

pytestmark = pytest.mark.unit


def test_usage_lists_every_subcommand(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("train", "fit", "cost", "convert"):
        assert f"  {name}" in out


def test_unknown_and_planned_subcommands_are_clear_errors(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown subcommand 'trian'" in capsys.readouterr().err
    assert cli.main(["eval"]) == 2
    assert "not available yet" in capsys.readouterr().err


def test_train_usage_and_config_errors(capsys, tmp_path):
    assert cli.main(["train"]) == 0
    assert "usage: megatron-rl train RECIPE.yaml" in capsys.readouterr().out
    assert cli.main(["train", "examples/configs/tiny_pipeline.yaml", "rollout.top_k=3"]) == 2
    assert "rollout.top_k: unknown field" in capsys.readouterr().err
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\n")
    assert cli.main(["train", str(recipe)]) == 2  # the defaults name no checkpoint
    assert "model.hf_checkpoint: megatron-rl train needs the HF checkpoint" \
        in capsys.readouterr().err


def test_console_script_runs_a_subcommand():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "cost", "--preset", "paper-8b"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "generator : trainer" in out.stdout
