"""megatron_rl.rollout.engine_lifetime on plain processes (the SGLang servers: the integration
test test_engine_lifetime.py): a launcher started from a thread that ends keeps its child; a
SIGKILLed launcher takes its child and the child's forked grandchild with it; a child whose
launcher died before it could tie itself exits at its tie. The module is standard-library only,
so the processes load it by path (no torch import: fast)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.rollout import engine_lifetime

pytestmark = pytest.mark.unit

MODULE = Path(engine_lifetime.__file__)
LOAD = ("import importlib.util, os, sys, threading, time\n"
        f"spec = importlib.util.spec_from_file_location('engine_lifetime', {str(MODULE)!r})\n"
        "lifetime = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(lifetime)\n")
# The engine: ties itself to its launcher, forks a grandchild, says it is ready, sleeps.
CHILD = LOAD + ("out = sys.argv[1]\n"
                "wait_for_orphaning = sys.argv[2] == 'late'\n"
                "if wait_for_orphaning:  # tie only once the launcher is gone\n"
                "    while os.getppid() == int(os.environ[lifetime.LAUNCHER_PID_ENV]):\n"
                "        time.sleep(0.01)\n"
                "    open(out + '.tying', 'w').close()\n"
                "lifetime.tie_to_launcher()\n"
                "lifetime.tie_forked_children()\n"
                "if wait_for_orphaning:\n"
                "    open(out + '.survived', 'w').close()\n"
                "if os.fork() == 0:\n"
                "    time.sleep(120); os._exit(0)\n"
                "open(out + '.ready', 'w').close()\n"
                "time.sleep(120)\n")
# The launcher: starts the engine from a thread that ends once the engine has tied itself (a
# pool thread, a Ray call), which must not end the engine.
LAUNCHER = LOAD + ("child = sys.argv[1:]\n"
                   "started = []\n"
                   "def launch():\n"
                   "    started.append(lifetime.popen([sys.executable, '-c', *child],\n"
                   "                                  env=dict(os.environ)))\n"
                   "    while child[-1] == 'early' and not os.path.exists(child[-2] + '.ready'):\n"
                   "        time.sleep(0.01)\n"
                   "thread = threading.Thread(target=launch)\n"
                   "thread.start(); thread.join()\n"
                   "print(started[0].pid, flush=True)\n"
                   "if child[-1] == 'late':\n"
                   "    os.kill(os.getpid(), 9)\n"
                   "time.sleep(120)\n")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _launch(tmp_path: Path, when: str) -> tuple[subprocess.Popen, int]:
    out = tmp_path / "engine"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD, str(out), when],
                                stdout=subprocess.PIPE, text=True)
    return launcher, int(launcher.stdout.readline())


def test_a_killed_launcher_takes_its_engine_and_the_engine_s_children(tmp_path):
    import psutil

    launcher, engine = _launch(tmp_path, "early")
    try:
        assert _wait_until(lambda: (tmp_path / "engine.ready").exists() or not _alive(engine))
        try:
            (grandchild,) = [c.pid for c in psutil.Process(engine).children()]
        except (psutil.NoSuchProcess, ValueError):
            pytest.fail("the engine died when the thread that launched it ended")
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert _wait_until(lambda: not _alive(engine) and not _alive(grandchild)), \
            "the engine or its child outlived the launcher"
    finally:
        for pid in (launcher.pid, engine):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_engine_whose_launcher_died_before_its_tie_exits_at_the_tie(tmp_path):
    launcher, engine = _launch(tmp_path, "late")
    launcher.wait()
    assert launcher.returncode == -signal.SIGKILL
    try:
        assert _wait_until(lambda: not _alive(engine)), "the orphaned engine lives on"
        assert (tmp_path / "engine.tying").exists()  # it reached the tie after the launcher died
        assert not (tmp_path / "engine.survived").exists()
    finally:
        if _alive(engine):
            os.kill(engine, signal.SIGKILL)
