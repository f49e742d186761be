"""The GPU image's files agree with each other and with what CI installs, offline: the Dockerfile
starts from SGLang's release image of the SGLang version CI pins and checks it holds the torch
SGLang 0.5.23 declares (its kernels are built against that torch); requirements/gpu-image.txt
(the one pip install set, resolved against PyPI by tests/integration/test_gpu_image.py) pins that
torch, CI's megatron-core and SGLang lists, and the Transformer Engine the Dockerfile compiles;
the steps run in the order that keeps the base's torch (constraints written before any install,
extensions built without build isolation); and tools/gpu_image.py's rules (which installed
packages are frozen, when FlashInfer's kernel wheels match, what the finished image must hold)
give the right answers on made-up package sets. The image itself is not built in CI (no GPU, no
Docker daemon).
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_image  # noqa: E402


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def dockerfile_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults (quotes removed)."""
    return {name: value.strip('"') for name, value in
            re.findall(r"^ARG (\w+)=(\S+)", _dockerfile(), re.M)}


def _install_sh_pin(name: str) -> str:
    found = re.findall(rf"(?<![\w.-]){re.escape(name)}==([\w.+!-]+)",
                       (ROOT / "requirements" / "install.sh").read_text())
    assert len(set(found)) == 1, (name, found)
    return found[0]


def _sglang_requirement(name: str) -> Requirement:
    """SGLang's own declared requirement of `name` (the installed sglang is CI's version)."""
    for text in md.requires("sglang") or []:
        requirement = Requirement(text)
        if requirement.name == name and requirement.marker is None:
            return requirement
    raise AssertionError(f"sglang declares no unconditional {name} requirement")


def test_the_base_is_sglangs_release_image_of_cis_version():
    args = dockerfile_args()
    sglang = _install_sh_pin("sglang")
    assert md.version("sglang") == sglang  # the metadata read below is that release's
    assert args["SGLANG_VERSION"] == sglang
    assert args["BASE_IMAGE"] == "lmsysorg/sglang:v${SGLANG_VERSION}"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", _dockerfile(), re.M)
    # The torch SGLang's kernels are compiled for: SGLang pins it exactly, and so does the image.
    assert str(_sglang_requirement("torch").specifier) == f"=={args['TORCH_VERSION']}"
    assert args["TORCH_VERSION"] != _install_sh_pin("torch")  # CI's CPU torch is another one
    assert args["PYTHON_VERSION"] == "3.12"  # SGLang's images; what the install set resolves for
    assert args["TORCH_CUDA_MAJOR"] == "13"  # PyPI's torch 2.14.1 is a CUDA 13.0 build
    assert SpecifierSet(md.metadata("sglang")["Requires-Python"]).contains(
        args["PYTHON_VERSION"] + ".0")


def test_image_requirements_pin_the_base_and_cis_versions():
    args = dockerfile_args()
    specifiers = gpu_image.requirement_specifiers()
    assert specifiers["torch"] == SpecifierSet(f"=={args['TORCH_VERSION']}")
    assert specifiers["sglang"] == SpecifierSet(f"=={args['SGLANG_VERSION']}")
    assert specifiers["megatron-core"] == SpecifierSet(f"=={_install_sh_pin('megatron-core')}")
    assert specifiers["transformer-engine"] == SpecifierSet(
        f"=={args['TRANSFORMER_ENGINE_VERSION']}")
    # CI's versions: the rest of the stack and SGLang's resolved dependencies, through the same
    # files CI installs.
    text = (ROOT / "requirements" / "gpu-image.txt").read_text()
    assert re.search(r"^-r base\.txt$", text, re.M)
    assert re.search(rf"^-c sglang-{args['SGLANG_VERSION']}-cpu-nodeps\.txt$", text, re.M)
    for name, version in (("numpy", "2.3.5"), ("transformers", "5.19.0"), ("ray", "2.60.0")):
        assert specifiers[name] == SpecifierSet(f"=={version}"), name
    # Transformer Engine's core wheel is the CUDA major of the base's torch; the Python
    # package's extra names it.
    assert re.search(rf"^transformer-engine\[core_cu{args['TORCH_CUDA_MAJOR']}\]==", text, re.M)
    # The run-time needs of the extension the Dockerfile compiles with --no-deps
    # (transformer_engine_torch 2.19.0's Requires-Dist, read from its sdist's PKG-INFO).
    for name in ("einops", "onnxscript", "onnx", "pydantic", "nvdlfw-inspect",
                 "nvidia-cudnn-frontend"):
        assert name in specifiers, name
    assert specifiers["nvidia-cudnn-frontend"].contains("1.28.0")


def test_steps_keep_the_bases_torch():
    text = _dockerfile()
    # Nothing replaces torch or a kernel by name: they come with the base (and FlashInfer's own
    # command installs its kernel wheels).
    for line in re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", text):
        named = re.findall(r"(?<![\w/.-])([A-Za-z][\w.-]*)(?:\[[\w,-]+\])?==", line)
        assert not [n for n in named if gpu_image.is_abi_package(n)
                    and not n.startswith("transformer")], line
    order = [text.index(marker) for marker in (
        "tools/gpu_image.py check-base", "tools/gpu_image.py check-kernels",
        "tools/gpu_image.py constraints requirements/gpu-constraints.txt",
        "ENV PIP_CONSTRAINT=/opt/megatron_rl/requirements/gpu-constraints.txt",
        "pip install -r requirements/gpu-image.txt",
        '"transformer-engine-torch==${TRANSFORMER_ENGINE_VERSION}"',
        "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}",
        "pip install --no-deps -e .", "tools/gpu_image.py check-image",
        "tools/gpu_smoke.py --dry-run")]
    assert order == sorted(order), order
    assert text.count("--no-build-isolation") == 2  # TE's extension and apex: against this torch
    assert "NVTE_PYTORCH_FORCE_BUILD=TRUE" in text  # no guessed prebuilt wheel for another torch
    assert re.fullmatch(r"[0-9a-f]{40}", dockerfile_args()["APEX_COMMIT"])
    for path in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which does not exist"


def test_constraints_freeze_the_torch_stack_unless_ci_pins_another_version():
    installed = {"torch": "2.14.1", "sglang-kernel": "0.4.10", "flashinfer-python": "0.7.2",
                 "nvidia-nccl-cu13": "2.30.7", "triton": "3.8.0", "nvidia-ml-py": "13.580.1",
                 "numpy": "2.2.6", "requests": "2.32.0", "sglang": "0.5.23"}
    specifiers = {"torch": SpecifierSet("==2.14.1"), "nvidia-ml-py": SpecifierSet("==13.615.71"),
                  "numpy": SpecifierSet("==2.3.5"), "sglang": SpecifierSet("==0.5.23")}
    pins, left = gpu_image.image_constraints(installed, specifiers)
    assert pins == ["flashinfer-python==0.7.2", "nvidia-nccl-cu13==2.30.7", "sglang==0.5.23",
                    "sglang-kernel==0.4.10", "torch==2.14.1", "triton==3.8.0"]
    assert left == ["nvidia-ml-py 13.580.1 (requirements/: ==13.615.71)"]
    # A local version label (a torch from PyTorch's own index) satisfies the plain pin.
    pins, left = gpu_image.image_constraints({"torch": "2.14.1+cu130"}, specifiers)
    assert pins == ["torch==2.14.1+cu130"] and left == []


def test_requirement_specifiers_follow_included_files(tmp_path):
    (tmp_path / "inner.txt").write_text("numpy==2.3.5\n# a comment\nrequests>=2  # why\n")
    (tmp_path / "pins.txt").write_text("numpy<3\n")
    (tmp_path / "top.txt").write_text("-c pins.txt\ntorch==2.14.1\n-r inner.txt\n"
                                      "transformer-engine[core_cu13]==2.19.0\n")
    specifiers = gpu_image.requirement_specifiers(tmp_path / "top.txt")
    assert specifiers == {"numpy": SpecifierSet("==2.3.5,<3"), "requests": SpecifierSet(">=2"),
                          "torch": SpecifierSet("==2.14.1"),
                          "transformer-engine": SpecifierSet("==2.19.0")}
    (tmp_path / "bad.txt").write_text("torch===\n")
    with pytest.raises(gpu_image.ImageError, match="cannot parse 'torch==='"):
        gpu_image.requirement_specifiers(tmp_path / "bad.txt")


def test_flashinfer_kernels_match_flashinfers_own_rules():
    base = {"flashinfer-python": "0.7.2", "flashinfer-cubin": "0.7.2",
            "flashinfer-jit-cache": "0.7.2+cu130", "flashinfer-jit-cache-sm90a": "0.7.2+cu130",
            "flashinfer-jit-cache-sm100a": "0.7.2+cu130"}
    assert gpu_image.check_kernels(base) == []
    no_providers = {k: v for k, v in base.items() if "-sm" not in k}
    assert gpu_image.check_kernels({**no_providers, "flashinfer-jit-cache": "0.7.2"}) == []
    (problem,) = gpu_image.check_kernels({**base, "flashinfer-cubin": "0.6.13"})
    assert "flashinfer-cubin 0.6.13 does not match flashinfer-python 0.7.2" in problem
    assert "python -m flashinfer download-kernels" in problem
    missing = dict(base)
    del missing["flashinfer-cubin"], missing["flashinfer-jit-cache"]
    problems = gpu_image.check_kernels(missing)
    assert [p.split(":")[0] for p in problems] == [
        "flashinfer-cubin not installed does not match flashinfer-python 0.7.2",
        "flashinfer-jit-cache not installed does not match flashinfer-python 0.7.2 (expected "
        "0.7.2+cuXY)",
        "flashinfer-jit-cache providers ['flashinfer-jit-cache-sm100a==0.7.2+cu130', "
        "'flashinfer-jit-cache-sm90a==0.7.2+cu130'] differ from the shim "
        "flashinfer-jit-cache==None"]
    (problem,) = gpu_image.check_kernels({**base, "flashinfer-jit-cache-sm90a": "0.7.1+cu130"})
    assert "['flashinfer-jit-cache-sm90a==0.7.1+cu130'] differ" in problem


def test_base_check_names_each_mismatch():
    good = {"torch": "2.14.1", "sglang": "0.5.23"}
    kwargs = dict(python="3.12", torch="2.14.1", torch_cuda_major=13, sglang="0.5.23")
    assert gpu_image.check_base(good, running_python="3.12", torch_cuda="13.0", **kwargs) == []
    problems = gpu_image.check_base({"torch": "2.13.0+cu130", "sglang": "0.5.22"},
                                    running_python="3.11", torch_cuda="12.9", **kwargs)
    assert [p.split(":")[0] for p in problems] == [
        "Python 3.11, expected 3.12", "torch 2.13.0+cu130, expected 2.14.1",
        "torch built for CUDA 12.9, expected CUDA 13.x (Transformer Engine's core wheel is "
        "transformer-engine-cu13)", "sglang 0.5.22, expected 0.5.23"]
    assert all("BASE_IMAGE" in p for p in problems)


def test_image_check_wants_every_part_at_one_transformer_engine_version():
    installed = {"transformer-engine": "2.19.0", "transformer-engine-torch": "2.19.0",
                 "transformer-engine-cu13": "2.19.0", "flashinfer-python": "0.7.2",
                 "flashinfer-cubin": "0.7.2", "flashinfer-jit-cache": "0.7.2+cu130"}
    assert gpu_image.check_image(installed, lambda module: True) == []
    problems = gpu_image.check_image({**installed, "transformer-engine-torch": "2.20.2"},
                                     lambda module: module != "amp_C")
    assert problems[0] == "module amp_C (apex) is missing"
    assert problems[1].startswith("Transformer Engine's parts disagree")
    assert len(problems) == 2
