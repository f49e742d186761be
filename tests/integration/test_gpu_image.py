"""The GPU image's whole pip install set resolves, against PyPI, for the image's Python on both
architectures the image is built for (x86_64: H100 / H200; aarch64: GB200's Grace), with the base
image's torch: `pip install --dry-run --only-binary=:all: --python-version 3.12 --platform
manylinux_*_{arch}` of requirements/gpu-image.txt, which holds SGLang 0.5.23 with all its pins
(its CUDA kernels pin torch 2.14.1), that torch, megatron-core, Transformer Engine and CI's
versions of everything else. Any conflict (e.g. a kernel that needs another torch, as
sglang-kernel 0.4.10's torch==2.14.1 against the NGC container's 2.13) fails with pip's own
message, which names the packages.

Network: PyPI is reachable from CI. Unreachable, the test FAILS saying so (a skipped check that
passes would hide a broken image). It is an integration test because it waits on ~300 metadata
look-ups per architecture (HTTP range requests into the wheels: the index serves no separate
metadata files), one to four minutes; the two architectures resolve at the same time.

What pip cannot check this way, and how it is handled:
- pip 23.2 (this venv's) checks Requires-Python against the interpreter running it, not
  --python-version (megatron-core 0.19.2 requires >= 3.12); a pinned newer pip is run from its
  wheel (python pip.whl/pip), which checks the target's.
- Environment markers are evaluated for the running interpreter (Linux x86_64): for aarch64 the
  requirements SGLang declares only for aarch64 (its video decoders) are added explicitly; what it
  declares only for x86_64 (torchcodec) is resolved for aarch64 too (it has aarch64 wheels).
- A package published only as an sdist cannot be resolved for a foreign platform; those of the
  set (SDIST_ONLY) enter as metadata-only wheels made from the metadata pip prepares from their
  sdists here. The image builds them from source (its base has compilers).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements" / "gpu-image.txt"
ARCHITECTURES = ("x86_64", "aarch64")
# The pip that runs the resolution (see the module docstring).
RESOLVER_PIP = "pip==26.3"
# Packages of the set with no wheel on PyPI (reasoning-gym's dependencies).
SDIST_ONLY = ("cellpylib==2.4.0", "pycosat==0.6.6", "zss==1.2.0")
# glibc 2.17 .. 2.39 (SGLang's images are Ubuntu 24.04: glibc 2.39).
MANYLINUX = tuple(range(17, 40))
# pip's words for a network failure (requests / urllib3 / pip's own).
NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name",
                  "Name or service not known", "ConnectTimeout", "ProxyError",
                  "Network is unreachable", "Connection refused", "ConnectionResetError",
                  "No matching distribution found for pip==")


def _dockerfile_args() -> dict[str, str]:
    return {name: value.strip('"') for name, value in re.findall(
        r"^ARG (\w+)=(\S+)", (ROOT / "Dockerfile").read_text(), re.M)}


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, **kwargs)


def _fail_if_offline(proc: subprocess.CompletedProcess, what: str) -> None:
    output = proc.stdout + proc.stderr
    if proc.returncode and any(word in output for word in NETWORK_ERRORS):
        network = [line for line in output.splitlines()
                   if any(word in line for word in NETWORK_ERRORS[:-1])][:3]
        pytest.fail(f"PyPI is unreachable ({what} failed): this test resolves the GPU image's "
                    f"install set against PyPI and needs network access to it (CI has it). "
                    f"pip said:\n" + "\n".join(network + [_errors(output)]), pytrace=False)


def _errors(output: str, num_lines: int = 40) -> str:
    """pip's explanation: from its first error or conflict report on, without progress lines."""
    noise = ("WARNING: Location", "Collecting ", "Processing ", "  Downloading ",
             "  Obtaining dependency information", "Looking in ")
    lines = [line for line in output.splitlines() if not line.startswith(noise)]
    for i, line in enumerate(lines):
        if line.startswith(("ERROR", "The conflict is caused by")):
            return "\n".join(lines[i:i + num_lines])
    return "\n".join(lines[-num_lines:])


@pytest.fixture(scope="module")
def resolver(tmp_path_factory) -> Path:
    """RESOLVER_PIP's wheel, fetched from PyPI by this venv's pip; run as `python WHEEL/pip`."""
    directory = tmp_path_factory.mktemp("resolver_pip")
    proc = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 "--disable-pip-version-check", "-d", str(directory), RESOLVER_PIP], timeout=300)
    _fail_if_offline(proc, f"downloading {RESOLVER_PIP}")
    assert proc.returncode == 0, _errors(proc.stdout + proc.stderr)
    (wheel,) = directory.glob("pip-*.whl")
    return wheel


@pytest.fixture(scope="module")
def sdist_wheelhouse(tmp_path_factory, resolver) -> Path:
    """Metadata-only wheels (py3-none-any) of SDIST_ONLY, from the metadata pip prepares from
    each sdist (the same Requires-Dist and Requires-Python pip would see building it)."""
    directory = tmp_path_factory.mktemp("sdist_metadata")
    report = directory / "report.json"
    proc = _run([sys.executable, str(resolver / "pip"), "install", "--dry-run",
                 "--ignore-installed", "--no-deps", "--no-binary=:all:", "--quiet",
                 "--report", str(report), *SDIST_ONLY], timeout=300)
    _fail_if_offline(proc, "preparing the sdists' metadata")
    assert proc.returncode == 0, _errors(proc.stdout + proc.stderr)
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        name, version = meta["name"], meta["version"]
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        if meta.get("requires_python"):
            lines.append(f"Requires-Python: {meta['requires_python']}")
        lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist") or []]
        stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
        with zipfile.ZipFile(directory / f"{stem}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{stem}.dist-info/METADATA", "\n".join(lines) + "\n")
            wheel.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: "
                           "test_gpu_image\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            wheel.writestr(f"{stem}.dist-info/RECORD", "")
    return directory


def marker_only_requirements(requires: list[str], arch: str, python: str) -> list[str]:
    """Requirements whose markers hold on Linux `arch` with `python` but not here (pip
    evaluates markers for the running interpreter, whatever --platform says)."""
    here = default_environment()
    there = {**here, "platform_machine": arch, "python_version": python,
             "python_full_version": f"{python}.0"}
    out = []
    for text in requires:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is None or "extra" in str(marker):
            continue
        if marker.evaluate(there) and not marker.evaluate(here):
            requirement.marker = None
            out.append(str(requirement))
    return out


def _resolve(resolver: Path, wheelhouse: Path, arch: str, python: str, work: Path):
    platforms = [f"manylinux_2_{n}_{arch}" for n in MANYLINUX] + [f"manylinux2014_{arch}"]
    extra = marker_only_requirements(md.requires("sglang") or [], arch, python)
    report = work / f"report-{arch}.json"
    command = [sys.executable, str(resolver / "pip"), "install", "--dry-run",
               "--ignore-installed", "--only-binary=:all:", "--python-version", python,
               "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}",
               *[arg for p in platforms for arg in ("--platform", p)],
               "--target", str(work / f"target-{arch}"), "--report", str(report),
               "--use-feature=fast-deps", "--find-links", str(wheelhouse),
               "--progress-bar", "off", "--disable-pip-version-check",
               "-r", str(REQUIREMENTS), *extra]
    return _run(command, timeout=560), report, extra


def test_the_image_install_set_resolves_on_both_architectures(resolver, sdist_wheelhouse,
                                                              tmp_path):
    args = _dockerfile_args()
    python = args["PYTHON_VERSION"]
    with ThreadPoolExecutor(len(ARCHITECTURES)) as pool:
        runs = dict(zip(ARCHITECTURES, pool.map(
            lambda arch: _resolve(resolver, sdist_wheelhouse, arch, python, tmp_path),
            ARCHITECTURES)))
    for arch, (proc, _, _) in runs.items():
        _fail_if_offline(proc, f"resolving for {arch}")
        assert proc.returncode == 0, (
            f"requirements/gpu-image.txt does not resolve for Python {python} on {arch} "
            f"(pip install --dry-run against PyPI):\n{_errors(proc.stdout + proc.stderr)}")

    sglang_pins = {canonicalize_name(Requirement(r).name): Requirement(r).specifier
                   for r in md.requires("sglang") or [] if "extra ==" not in r}
    for arch, (_, report, extra) in runs.items():
        resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                    for item in json.loads(report.read_text())["install"]}
        # The base's torch and SGLang, SGLang's kernels at its own pins, what the Dockerfile
        # compiles against, and CI's versions.
        assert resolved["torch"] == args["TORCH_VERSION"], arch
        assert resolved["sglang"] == args["SGLANG_VERSION"], arch
        for kernel in ("sglang-kernel", "sgl-deep-ep", "sgl-flash-mla", "flashinfer-python"):
            assert sglang_pins[kernel].contains(resolved[kernel]), (arch, kernel)
        assert resolved["transformer-engine-cu13"] == args["TRANSFORMER_ENGINE_VERSION"]
        assert resolved["megatron-core"] == "0.19.2" and resolved["numpy"] == "2.3.5", arch
        if arch == "aarch64":
            assert {Requirement(r).name for r in extra} == {"av", "decord2"}, extra
            assert resolved["av"] == "16.1.0"
        for item in json.loads(report.read_text())["install"]:
            requires_python = item["metadata"].get("requires_python")
            assert not requires_python or SpecifierSet(requires_python).contains(
                python + ".0"), (arch, item["metadata"]["name"], requires_python)
