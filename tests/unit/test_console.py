"""Entry-point output (megatron_rl/console.py): the known harmless third-party warnings are
silenced by exact category / logger and message, in child processes too; our own and unknown
warnings still show; -v / MEGATRON_RL_VERBOSE=1 shows everything. Each case runs in a fresh
interpreter, since warning filters are process-wide."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.console import KNOWN_WARNINGS, verbose_requested

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import logging, subprocess, sys, warnings
from megatron_rl.console import quiet_known_warnings
quiet_known_warnings(verbose={verbose})
logging.basicConfig(format="LOG %(message)s")
warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
warnings.warn("Apex is not installed. Falling back to Torch Norm", RuntimeWarning)
warnings.warn("megatron_rl: a warning of our own", UserWarning)
gpt = logging.getLogger("megatron.core.models.gpt.gpt_model")
gpt.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
gpt.warning("GPTModel found something else")
logging.getLogger("somebody.else").warning("GPTModel IS DEPRECATED. from another logger")
child = ("import warnings; warnings.warn('The pynvml package is deprecated. Please install "
         "nvidia-ml-py instead. More.', FutureWarning)")
subprocess.run([sys.executable, "-c", child], check=True)
"""


def _run(verbose: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(verbose=verbose)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_known_warnings_are_silenced_and_the_rest_show():
    err = _run(verbose=False)
    # Silenced: the exact category + message, the exact logger + message, in a child process.
    assert "UserWarning: Apex is not installed" not in err
    assert "LOG GPTModel IS DEPRECATED. GPTModel is only" not in err
    assert "pynvml" not in err
    # Still shown: the same text under another category or logger, our own, an unknown one.
    assert "RuntimeWarning: Apex is not installed" in err
    assert "a warning of our own" in err
    assert "LOG GPTModel found something else" in err
    assert "LOG GPTModel IS DEPRECATED. from another logger" in err


def test_verbose_shows_everything():
    err = _run(verbose=True)
    assert "UserWarning: Apex is not installed" in err
    assert "LOG GPTModel IS DEPRECATED. GPTModel is only" in err
    assert "pynvml" in err


def test_verbose_flag_and_environment_variable(monkeypatch):
    monkeypatch.delenv("MEGATRON_RL_VERBOSE", raising=False)
    assert verbose_requested(["fit", "-v", "run"]) == (True, ["fit", "run"])
    assert verbose_requested(["fit", "run"]) == (False, ["fit", "run"])
    monkeypatch.setenv("MEGATRON_RL_VERBOSE", "1")
    assert verbose_requested(["fit"]) == (True, ["fit"])


def test_every_known_warning_says_why_it_is_harmless():
    for known in KNOWN_WARNINGS:
        assert len(known.prefix) >= 20 and len(known.why) >= 20, known
