"""The GPU image's Dockerfile installs what CI tests: every `name==version` it names agrees with
requirements/ (install.sh, base.txt, the SGLang list, constraints.txt), SGLang's CUDA-only
dependencies carry the pins SGLang itself declares (read from the installed sglang's metadata, the
version requirements/ pins), the base is NGC's PyTorch image, the requirement files it installs
exist, and it installs megatron-core, SGLang and this package. The image is not built in CI (no
GPU, no Docker daemon): this is the part of it that can drift silently.
"""
from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
# name==version, optionally with [extras], inside or outside quotes.
_PIN = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[\w,-]+\])?==([\w.+!-]+)")
# Left to the container on purpose (compiled against its CUDA torch) or not needed on GPU.
CONTAINER_OWNED = {"torch", "torchaudio", "torchcodec", "torchvision", "triton"}
MULTIMODAL_ONLY = {"av", "decord2"}  # SGLang's video decoders (aarch64 markers); text-only here


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for name, version in _PIN.findall(line):
            pins[_normalise(name)] = version
    return pins


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _ci_pins() -> dict[str, str]:
    """Every pin of requirements/: its files and the install script's command lines."""
    pins = {}
    for path in sorted(REQUIREMENTS.iterdir()):
        if path.suffix in (".txt", ".sh"):
            for name, version in _pins(path.read_text()).items():
                assert pins.setdefault(name, version) == version, \
                    f"requirements/ pins {name} twice: {pins[name]} and {version} ({path.name})"
    return pins


def test_dockerfile_pins_agree_with_requirements():
    ci = _ci_pins()
    docker = _pins(_dockerfile())
    shared = {name for name in docker if name in ci}
    assert {"megatron-core", "sglang", "numpy"} <= shared, shared
    wrong = {name: (docker[name], ci[name]) for name in shared if docker[name] != ci[name]}
    assert not wrong, f"Dockerfile pins differ from requirements/ (Dockerfile, CI): {wrong}"


def test_sglang_cuda_dependencies_carry_sglangs_own_pins():
    """What the Dockerfile adds beyond requirements/ is SGLang's CUDA-only dependency list, at the
    versions SGLang 0.5.23 declares; nothing else is added, and the container keeps torch."""
    ci = _ci_pins()
    assert md.version("sglang") == ci["sglang"]
    declared = {}
    for requirement in md.requires("sglang") or []:
        if "extra ==" in requirement:
            continue
        name = _normalise(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0])
        declared[name] = requirement
    dockerfile = _dockerfile()
    added = {name: version for name, version in _pins(dockerfile).items() if name not in ci}
    assert added, "the Dockerfile adds no SGLang CUDA kernels"
    for name, version in added.items():
        assert name in declared, f"Dockerfile installs {name}=={version}, which neither " \
            "requirements/ nor SGLang's dependency list names"
        assert f"=={version}" in declared[name], (name, version, declared[name])
    # Every CUDA-only dependency SGLang declares is installed (pinned or not), except the
    # container's own builds and the video decoders.
    named = dockerfile.replace("_", "-").lower()
    missing = [name for name in declared
               if name not in ci and name not in CONTAINER_OWNED | MULTIMODAL_ONLY
               and name not in named]
    assert not missing, f"SGLang's CUDA dependencies the Dockerfile leaves out: {missing}"
    assert not (set(_pins(dockerfile)) & CONTAINER_OWNED), "pip must not replace the " \
        "container's torch / triton / torchvision"


def test_dockerfile_structure():
    text = _dockerfile()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M)
    assert base and base.group(1).startswith("nvcr.io/nvidia/pytorch:"), base
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    installed_files = set(re.findall(r"-r (requirements/[\w.-]+)", text))
    for path in installed_files | {"requirements/constraints.txt"}:  # what the image reads
        assert (ROOT / path).is_file(), f"the Dockerfile reads {path}, which does not exist"
    assert installed_files == {"requirements/base.txt",
                               "requirements/sglang-0.5.23-cpu-nodeps.txt"}, installed_files
    assert "pip install --no-deps -e ." in text  # this package
    # The container's torch is kept: every pip call runs under the one constraints file.
    assert "ENV PIP_CONSTRAINT=/opt/megatron_rl/requirements/gpu-constraints.txt" in text
    assert text.index("ENV PIP_CONSTRAINT=") < text.index("pip install ")
    assert "tools/gpu_smoke.py --dry-run" in text and (ROOT / "tools" / "gpu_smoke.py").is_file()
