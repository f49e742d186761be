"""Fix 12 of megatron_rl/platform/sglang_cpu.py: SGLang's children are forked from the server
process only when no thread a fork would copy mid-work runs there. Checked against threads this
test starts: a Python thread and a native OpenMP pool thread."""
import ast
import os
import subprocess
import sys
import threading

import pytest

from megatron_rl.platform.sglang_cpu import (CHILD_START_ENV, child_start_method,
                                             threads_unsafe_to_fork)

pytestmark = pytest.mark.unit


def _with_thread(name: str):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name=name, daemon=True)
    thread.start()
    return stop, thread


def test_a_python_thread_is_unsafe():
    stop, thread = _with_thread("busy-worker")
    try:
        found = threads_unsafe_to_fork()
    finally:
        stop.set()
        thread.join()
    assert "busy-worker" in found
    assert "busy-worker" not in threads_unsafe_to_fork()  # ended threads are not listed


def test_a_native_thread_pool_is_seen():
    """An OpenMP pool of two threads shows as a native thread (not a Python one). In a fresh
    process: this one's pool may already run, with any number of threads."""
    code = ("import torch\n"
            "from megatron_rl.platform.sglang_cpu import threads_unsafe_to_fork\n"
            "before = threads_unsafe_to_fork()\n"
            "a = torch.randn(512, 512)\n"
            "for _ in range(3):\n"
            "    (a @ a).sum()\n"
            "print(repr((before, threads_unsafe_to_fork())))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="2",
                                                OPENBLAS_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert before == []  # one thread for numpy's OpenBLAS, and torch's pool not started yet
    assert after and all(name.startswith("native thread") for name in after), after


def test_the_start_method_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.delenv(CHILD_START_ENV, raising=False)
    assert child_start_method() == "fork"
    for method in ("fork", "forkserver", "spawn"):
        monkeypatch.setenv(CHILD_START_ENV, method)
        assert child_start_method() == method
    monkeypatch.setenv(CHILD_START_ENV, "thread")
    with pytest.raises(ValueError, match="fork.*forkserver.*spawn"):
        child_start_method()
