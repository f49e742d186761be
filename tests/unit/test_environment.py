"""The pinned stack imports and has the versions requirements/ promises.

A broken or drifted install (another torch pulled in by a dependency, megatron-core resolved to
0.16 on Python 3.11, SGLang's CPU stack incomplete) must fail here, loudly, before any other test
produces a confusing error.
"""
import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==")
            pins[name.split("[")[0].strip().lower()] = version.strip()
    return pins


def test_torch_is_the_pinned_build():
    """torch 2.13.0 everywhere; on a machine without a GPU, the CPU build (a CUDA build there is
    the multi-GB wheel some dependency pulled in). A GPU machine (the Dockerfile's image) has
    its CUDA build, and the suite must pass there too."""
    import torch

    assert torch.__version__.split("+")[0] == "2.13.0"
    if not torch.cuda.is_available():
        assert torch.version.cuda is None, (
            f"torch {torch.__version__} is a CUDA {torch.version.cuda} build on a machine without "
            "a GPU: a dependency replaced the pinned CPU build; run `make clean-venv setup`")


def test_the_torch_check_holds_on_a_gpu_machine(monkeypatch):
    """The same check where CUDA is available (simulated: the predicate only; the GPU image's
    CUDA build of 2.13.0 passes it) must not demand a CPU-only machine."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    test_torch_is_the_pinned_build()


@pytest.mark.parametrize("req", ["base.txt", "sglang-0.5.23-cpu-nodeps.txt"])
def test_installed_versions_match_requirements(req):
    wrong = {}
    for name, version in _pins(ROOT / "requirements" / req).items():
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            wrong[name] = (version, "missing")
            continue
        if installed != version:
            wrong[name] = (version, installed)
    assert not wrong, f"(pinned, installed) differ; run `make clean-venv setup`: {wrong}"


def test_megatron_core_version_and_import():
    import megatron_rl  # noqa: F401  (makes megatron.core importable beside nvrx 0.4.1)
    import megatron.core
    from megatron.core import parallel_state  # noqa: F401

    assert md.version("megatron-core") == "0.19.2"


def test_nvidia_resiliency_ext_fault_tolerance_imports():
    from nvidia_resiliency_ext import fault_tolerance, inprocess  # noqa: F401

    assert md.version("nvidia-resiliency-ext") == "0.4.1"


def test_ray_transformers_versions():
    import ray
    import transformers

    assert ray.__version__ == "2.60.0"
    assert transformers.__version__ == "5.19.0"


def test_sglang_imports():
    """With the CPU engine where there is no GPU (CPU_STACK.md), as it is on a GPU machine."""
    import torch

    # A fresh interpreter: SGLang reads its environment at import time.
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    code = "import sglang, importlib.metadata as m; print(m.version('sglang'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "0.5.23"
