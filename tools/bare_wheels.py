#!/usr/bin/env python
"""What the bare tier of tools/gpu_smoke.py brings to a GPU machine that has only its own PyTorch
(torch 2.11 for CUDA 13 on Python 3.12, no network, no SGLang, Transformer Engine, apex or
transformers), and whether it fits the 64 MiB such a machine takes.

torch itself brings filelock, typing-extensions, sympy, networkx, jinja2, fsspec, setuptools and
triton (its own requirements). Beyond them the bare tier needs megatron-core (a cp312 wheel: it
carries a small compiled helper) with numpy (which torch does not require) and packaging, and
transformers with its own requirements: the model families build their configurations from
transformers' config classes (models/llama4/config.py: Llama4TextConfig), though the bare tier
never loads an HF checkpoint. PINS is that closure at the versions this project is tested with
(the test checks them against the installed ones, and runs the bare tier's dry run with nothing
but torch's requirements and PINS importable). The repository checkout travels too.

    python tools/bare_wheels.py download --dest bare_wheels   # on a machine with network
    python tools/bare_wheels.py size                          # the recorded sizes, no network

`download` runs `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
...` for the pinned wheels (x86_64, or --machine aarch64) and prints their sizes and the total
with the checkout's files against the limit; then copy the folder and the checkout to the GPU
machine and follow docs/production.md ("A bare GPU machine").
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20
PYTHON_VERSION = "3.12"
# pip's --platform tags for each host; the older manylinux tags admit the abi3 wheels.
PLATFORMS = {"x86_64": ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"),
             "aarch64": ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64",
                         "manylinux2014_aarch64")}  # H100 / H200 hosts; GB200 trays
PINS = {
    "megatron-core": "0.19.2", "numpy": "2.3.5", "packaging": "26.4",
    "transformers": "5.19.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2",
    "safetensors": "0.8.0", "regex": "2026.11.19", "pyyaml": "6.0.4", "tqdm": "4.70.1",
    "hf-xet": "1.8.0", "httpx": "0.28.1", "httpcore": "1.0.9", "h11": "0.16.0",
    "anyio": "4.16.0", "idna": "3.20", "certifi": "2026.10.19.post1", "typer": "0.29.2",
    "click": "8.5.1", "rich": "15.0.0", "pygments": "2.21.0", "markdown-it-py": "4.3.0",
    "mdurl": "0.1.2", "shellingham": "1.5.4", "annotated-doc": "0.0.7", "pydantic": "2.14.4",
    "pydantic-core": "2.50.5", "typing-inspection": "0.4.5", "annotated-types": "0.8.0",
}
# `download` on 2026-12-04 (PyPI; cp312, x86_64), bytes.
RECORDED_BYTES = {
    "annotated_doc-0.0.7-py3-none-any.whl": 5286,
    "annotated_types-0.8.0-py3-none-any.whl": 13427,
    "anyio-4.16.0-py3-none-any.whl": 134521,
    "certifi-2026.10.19.post1-py3-none-any.whl": 134047,
    "click-8.5.1-py3-none-any.whl": 126163,
    "h11-0.16.0-py3-none-any.whl": 37515,
    "hf_xet-1.8.0-cp38-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl": 4292483,
    "httpcore-1.0.9-py3-none-any.whl": 78784,
    "httpx-0.28.1-py3-none-any.whl": 73517,
    "huggingface_hub-1.33.0-py3-none-any.whl": 846435,
    "idna-3.20-py3-none-any.whl": 69583,
    "markdown_it_py-4.3.0-py3-none-any.whl": 96951,
    "mdurl-0.1.2-py3-none-any.whl": 9979,
    "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl": 2370641,
    "numpy-2.3.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl": 16606086,
    "packaging-26.4-py3-none-any.whl": 140049,
    "pydantic-2.14.4-py3-none-any.whl": 494865,
    "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl": 2264846,
    "pygments-2.21.0-py3-none-any.whl": 1250147,
    "pyyaml-6.0.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64"
    ".whl": 849249,
    "regex-2026.11.19-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_"
    "x86_64.whl": 809234,
    "rich-15.0.0-py3-none-any.whl": 310654,
    "safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": 516040,
    "shellingham-1.5.4-py2.py3-none-any.whl": 9755,
    "tokenizers-0.23.2-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": 3386843,
    "tqdm-4.70.1-py3-none-any.whl": 80199,
    "transformers-5.19.0-py3-none-any.whl": 12599123,
    "typer-0.29.2-py3-none-any.whl": 121041,
    "typing_inspection-0.4.5-py3-none-any.whl": 14874,
}
# What is not part of the checkout that travels (build outputs, environments, run outputs).
_NOT_CARRIED = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", "build", "dist"}


def requirements() -> list[str]:
    return [f"{name}=={version}" for name, version in PINS.items()]


def download_command(dest: Path, machine: str = "x86_64") -> list[str]:
    platforms = [arg for tag in PLATFORMS[machine] for arg in ("--platform", tag)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms,
            "--dest", str(dest), *requirements()]


def project_bytes(root: Path = ROOT) -> int:
    """The checkout that travels: the files git tracks or would (not ignored), or without git
    every file outside build outputs, environments and run outputs."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=root, capture_output=True,
                                check=True, timeout=60).stdout.split(b"\0")
        files = [root / name.decode() for name in listed if name]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in root.rglob("*")
                 if p.is_file() and not _NOT_CARRIED & set(p.relative_to(root).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return sum(p.stat().st_size for p in files if p.is_file())


def wheel_bytes(folder: Path | None = None) -> dict[str, int]:
    """The wheels' sizes: those downloaded into `folder` (one per pinned distribution), else the
    recorded ones."""
    if folder is None:
        return dict(RECORDED_BYTES)
    sizes = {p.name: p.stat().st_size for p in sorted(folder.glob("*.whl"))}
    wanted = {_wheel_prefix(name, version) for name, version in PINS.items()}
    found = {w for w in wanted if any(n.lower().startswith(w) for n in sizes)}
    if found != wanted:
        raise FileNotFoundError(f"{folder} lacks wheels for {sorted(wanted - found)}; run "
                                "`python tools/bare_wheels.py download --dest` into it")
    return sizes


def _wheel_prefix(name: str, version: str) -> str:
    """How a wheel's file name starts (PEP 427: the name normalised with underscores)."""
    return f"{name.replace('-', '_').lower()}-{version}-"


def carried_bytes(wheels: dict[str, int], root: Path = ROOT) -> dict[str, int]:
    total = sum(wheels.values()) + (project := project_bytes(root))
    return {"wheels": sum(wheels.values()), "project": project, "total": total,
            "limit": LIMIT_BYTES}


def _report(wheels: dict[str, int]) -> int:
    for name, size in wheels.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    sizes = carried_bytes(wheels)
    print(f"{sizes['project'] / 2**20:8.2f} MiB  the checkout (files git does not ignore)")
    print(f"{sizes['total'] / 2**20:8.2f} MiB  in all, limit {LIMIT_BYTES / 2**20:.0f} MiB")
    return 0 if sizes["total"] <= LIMIT_BYTES else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    down = sub.add_parser("download", help="pip download the wheels (needs network)")
    down.add_argument("--dest", default="bare_wheels")
    down.add_argument("--machine", choices=sorted(PLATFORMS), default="x86_64")
    sub.add_parser("size", help="the recorded sizes against the limit")
    args = parser.parse_args(argv)
    if args.command == "size":
        return _report(wheel_bytes())
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(download_command(dest, args.machine), check=True)
    return _report(wheel_bytes(dest))


if __name__ == "__main__":
    sys.exit(main())
