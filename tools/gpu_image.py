#!/usr/bin/env python
"""The GPU image's build checks and its constraints file (the Dockerfile runs each subcommand).

The image starts from SGLang's release image, whose torch SGLang's CUDA kernels are compiled
against; everything added must keep that torch and those kernels. Subcommands:

- `check-base --python 3.12 --torch 2.14.1 --torch-cuda-major 13 --sglang 0.5.23`: the base holds
  the versions requirements/gpu-image.txt was resolved for (tests/integration/test_gpu_image.py).
- `check-kernels`: FlashInfer's precompiled kernels are installed at flashinfer-python's version
  (flashinfer-cubin exactly; flashinfer-jit-cache with a +cuXY local label, and its per-arch
  providers at the shim's version: FlashInfer's own matching rules, flashinfer/jit/env.py), so
  nothing is downloaded at first use on a machine without network.
- `constraints OUT`: writes a pip constraints file pinning the base's torch and every package
  built against torch or CUDA at the installed version, except where requirements/gpu-image.txt
  (and the files it includes) pins a version the installed one does not satisfy: CI's pin wins.
- `check-image`: after the build, the compiled extensions and the packages are present and their
  versions agree (a build machine has no GPU driver: nothing CUDA is loaded here; that is the GPU
  smoke test's first stage, tools/gpu_smoke.py).

Importing this module imports neither torch nor SGLang; the logic is tested on made-up package
sets in tests/unit/test_dockerfile.py.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
IMAGE_REQUIREMENTS = ROOT / "requirements" / "gpu-image.txt"

# Packages compiled against torch's C++ ABI or a CUDA toolkit (and torch itself, and the CUDA
# libraries it loads): replacing one of them breaks the others at import ("undefined symbol").
ABI_PATTERNS = tuple(re.compile(p) for p in (
    r"torch", r"torchvision", r"torchaudio", r"torchcodec", r"triton", r"torch-memory-saver",
    r"torch-c-dlpack-ext", r"sglang", r"sglang-kernel", r"sgl-.*", r"flashinfer-.*",
    r"flash-attn.*", r"deep-ep", r"deep-gemm", r"nvidia-.*", r"cuda-.*", r"nvshmem.*",
    r"humming-kernels", r"quack-kernels", r"tilelang", r"apache-tvm-ffi",
    r"transformer-engine.*", r"apex", r"xgrammar",
))
# What the finished image must hold: module -> the distribution that provides it.
IMAGE_MODULES = {
    "torch": "torch", "sglang": "sglang", "sgl_kernel": "sglang-kernel",
    "flashinfer": "flashinfer-python", "flashinfer_cubin": "flashinfer-cubin",
    "flashinfer_jit_cache": "flashinfer-jit-cache", "megatron.core": "megatron-core",
    "transformer_engine": "transformer-engine",
    "transformer_engine_torch": "transformer-engine-torch",  # the extension compiled here
    "apex": "apex", "amp_C": "apex", "apex_C": "apex", "fused_layer_norm_cuda": "apex",
    "megatron_rl": "megatron-rl",
}
TRANSFORMER_ENGINE_PARTS = ("transformer-engine", "transformer-engine-torch")


class ImageError(RuntimeError):
    """The image does not hold what it must; the message says what and the fix."""


def installed_versions() -> dict[str, str]:
    """{canonical distribution name: version} of this environment."""
    return {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions()
            if d.metadata["Name"]}


def is_abi_package(name: str) -> bool:
    return any(p.fullmatch(canonicalize_name(name)) for p in ABI_PATTERNS)


def requirement_specifiers(path: Path = IMAGE_REQUIREMENTS) -> dict[str, SpecifierSet]:
    """Every named requirement or constraint of a requirements file and of the files it
    includes (-r / -c), as {canonical name: combined specifier}."""
    specifiers: dict[str, SpecifierSet] = {}
    seen: set[Path] = set()

    def read(file: Path) -> None:
        if file in seen:
            return
        seen.add(file)
        for raw in file.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith(("-r ", "-c ")):
                read((file.parent / line[3:].strip()).resolve())
                continue
            try:
                requirement = Requirement(line)
            except InvalidRequirement as exc:
                raise ImageError(f"{file}: cannot parse {line!r} ({exc})") from None
            name = canonicalize_name(requirement.name)
            specifiers[name] = specifiers.get(name, SpecifierSet()) & requirement.specifier

    read(path.resolve())
    return specifiers


def image_constraints(installed: Mapping[str, str],
                      specifiers: Mapping[str, SpecifierSet]) -> tuple[list[str], list[str]]:
    """(pins, left) for the constraints file: `pins` are "name==version" of the installed ABI
    packages whose version every requirement of that name admits; `left` names the installed ABI
    packages whose version a requirement excludes (the requirement's version is installed)."""
    pins, left = [], []
    for name in sorted(installed):
        if not is_abi_package(name):
            continue
        version = installed[name]
        allowed = specifiers.get(canonicalize_name(name))
        if allowed is not None and not allowed.contains(version, prereleases=True):
            left.append(f"{name} {version} (requirements/: {allowed})")
        else:
            pins.append(f"{name}=={version}")
    return pins, left


def check_base(installed: Mapping[str, str], *, python: str, running_python: str, torch: str,
               torch_cuda: str | None, torch_cuda_major: int, sglang: str) -> list[str]:
    """Problems with the base image (empty: fine). `running_python` is the base's major.minor,
    `torch_cuda` its torch.version.cuda."""
    problems = []
    if running_python != python:
        problems.append(f"Python {running_python}, expected {python}")
    base_torch = Version(installed["torch"]).public if "torch" in installed else None
    if base_torch != torch:
        problems.append(f"torch {installed.get('torch', 'not installed')}, expected {torch}")
    if torch_cuda is None or Version(torch_cuda).major != torch_cuda_major:
        problems.append(f"torch built for CUDA {torch_cuda}, expected CUDA {torch_cuda_major}.x "
                        f"(Transformer Engine's core wheel is transformer-engine-cu"
                        f"{torch_cuda_major})")
    if installed.get("sglang") != sglang:
        problems.append(f"sglang {installed.get('sglang', 'not installed')}, expected {sglang}")
    fix = ("pick the SGLang release image the install set was resolved for (the Dockerfile's "
           "BASE_IMAGE), or re-resolve requirements/gpu-image.txt for this base "
           "(tests/integration/test_gpu_image.py) and update the Dockerfile's ARGs")
    return [f"{p}: {fix}" for p in problems]


def check_kernels(installed: Mapping[str, str]) -> list[str]:
    """Problems with FlashInfer's precompiled kernels (empty: installed and matching)."""
    version = installed.get("flashinfer-python")
    if version is None:
        return ["flashinfer-python is not installed (SGLang's base image ships it)"]
    public = Version(version).public
    fix = "python -m flashinfer download-kernels (FlashInfer's index, flashinfer.ai/whl)"
    problems = []
    cubin = installed.get("flashinfer-cubin")
    if cubin != public:
        problems.append(f"flashinfer-cubin {cubin or 'not installed'} does not match "
                        f"flashinfer-python {version}")
    shim = installed.get("flashinfer-jit-cache")
    if shim is None or not (shim == public or shim.startswith(public + "+")):
        problems.append(f"flashinfer-jit-cache {shim or 'not installed'} does not match "
                        f"flashinfer-python {version} (expected {public}+cuXY)")
    stale = sorted(f"{name}=={v}" for name, v in installed.items()
                   if re.fullmatch(r"flashinfer-jit-cache-sm\d{2,3}[af]?", name) and v != shim)
    if stale:
        problems.append(f"flashinfer-jit-cache providers {stale} differ from the shim "
                        f"flashinfer-jit-cache=={shim}")
    return [f"{p}: {fix}" for p in problems]


def check_image(installed: Mapping[str, str], has_module) -> list[str]:
    """Problems with the finished image. `has_module(name)` says whether a module is found."""
    problems = [f"module {module} ({dist}) is missing" for module, dist in IMAGE_MODULES.items()
                if not has_module(module)]
    versions = {installed.get(name) for name in TRANSFORMER_ENGINE_PARTS}
    cores = [f"{n}=={v}" for n, v in installed.items()
             if re.fullmatch(r"transformer-engine-cu\d+", n)]
    if len(versions) != 1 or None in versions or len(cores) != 1 \
            or cores[0].split("==")[1] not in versions:
        problems.append(f"Transformer Engine's parts disagree: "
                        f"{ {n: installed.get(n) for n in TRANSFORMER_ENGINE_PARTS} }, core "
                        f"{cores}: build its extension at the core wheel's version (Dockerfile "
                        f"TRANSFORMER_ENGINE_VERSION, requirements/gpu-image.txt)")
    return problems + check_kernels(installed)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _report(problems: Iterable[str], what: str) -> int:
    problems = list(problems)
    for problem in problems:
        print(f"gpu_image: {what}: {problem}", file=sys.stderr)
    if not problems:
        print(f"gpu_image: {what}: ok")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    base = commands.add_parser("check-base", help="the base holds the resolved versions")
    base.add_argument("--python", required=True, help="major.minor, e.g. 3.12")
    base.add_argument("--torch", required=True)
    base.add_argument("--torch-cuda-major", type=int, required=True)
    base.add_argument("--sglang", required=True)
    commands.add_parser("check-kernels", help="FlashInfer's kernel wheels match flashinfer")
    constraints = commands.add_parser("constraints", help="write the pip constraints file")
    constraints.add_argument("output")
    commands.add_parser("check-image", help="the finished image holds every part")
    args = parser.parse_args(argv)
    installed = installed_versions()
    if args.command == "check-base":
        import torch

        running = f"{sys.version_info.major}.{sys.version_info.minor}"
        return _report(check_base(installed, python=args.python, running_python=running,
                                  torch=args.torch, torch_cuda=torch.version.cuda,
                                  torch_cuda_major=args.torch_cuda_major, sglang=args.sglang),
                       "base image")
    if args.command == "check-kernels":
        return _report(check_kernels(installed), "FlashInfer kernels")
    if args.command == "constraints":
        pins, left = image_constraints(installed, requirement_specifiers())
        header = ("# Written by tools/gpu_image.py constraints: the base image's torch and the "
                  "packages built against it, as installed.\n")
        Path(args.output).write_text(header + "".join(f"{p}\n" for p in pins))
        for entry in left:
            print(f"gpu_image: requirements/ pin another version of {entry}: not kept")
        return 0
    return _report(check_image(installed, _has_module), "image")


if __name__ == "__main__":
    sys.exit(main())
