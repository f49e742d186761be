"""The `megatron-rl` entry point dispatches to each job's own `main` and explains what is missing."""
import subprocess
import sys

import pytest

from megatron_rl import cli

pytestmark = pytest.mark.unit


def test_usage_lists_every_subcommand(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("fit", "cost", "convert"):
        assert f"  {name}" in out


def test_unknown_and_planned_subcommands_are_clear_errors(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown subcommand 'trian'" in capsys.readouterr().err
    assert cli.main(["train"]) == 2
    assert "make demo" in capsys.readouterr().err


def test_console_script_runs_a_subcommand():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "cost", "--preset", "paper-8b"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "generator : trainer" in out.stdout
