"""The bare tier of tools/gpu_smoke.py (issue 39.6): a GPU machine with only its own PyTorch and
the wheels tools/bare_wheels.py carries.

- Its dry run passes on CPU with nothing importable but torch's own requirements (and triton,
  which torch's CUDA build requires) and the carried wheels' distributions: an interpreter
  without site-packages (-S) whose path holds links to exactly those (from this environment's
  installed copies). A module the tier needs and the list lacks fails the run here.
- The carried list is the requirement closure of what the tier imports, at the versions this
  project is installed and tested with.
- What it brings fits 64 MiB: the wheels' sizes plus the checkout's files. The sizes are those
  recorded by `tools/bare_wheels.py download` (PyPI, cp312 x86_64); with MEGATRON_RL_BARE_WHEELS
  pointing at a folder that command filled, the downloaded files are measured instead.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bare_wheels  # noqa: E402
import gpu_smoke  # noqa: E402

# The bare machine's Python and platform, for requirement markers.
BARE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                "implementation_name": "cpython", "platform_python_implementation": "CPython",
                "os_name": "posix", "extra": ""}
# torch's CUDA build requires triton (the CPU build installed here does not).
TORCH_SIDE = ("torch", "triton")


def _closure(roots) -> set[str]:
    seen, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        todo += [canonicalize_name(r.name) for r in map(Requirement, requires)
                 if r.marker is None or r.marker.evaluate(BARE_MARKERS)]
    return seen


def _bare_site(folder: Path) -> list[str]:
    """Links to the top-level modules and metadata of torch's closure and the carried wheels."""
    names = sorted(_closure(TORCH_SIDE) | set(bare_wheels.PINS))
    for name in names:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # e.g. triton on a machine without it: nothing imports it on CPU
        for file in dist.files or []:
            top = file.parts[0]
            source = Path(dist.locate_file(top))
            if top.startswith("..") or top in ("__pycache__", "bin") or top.endswith(".pth"):
                continue
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)
    return names


@pytest.mark.integration  # a fresh interpreter importing torch and megatron-core: ~7 s
def test_the_dry_run_needs_only_torch_and_the_carried_wheels(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _bare_site(site)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-S", str(ROOT / "tools/gpu_smoke.py"), "--tier",
                           "bare", "--dry-run", "--output-dir", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in
               (tmp_path / "out" / "gpu_smoke_bare.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records] == list(gpu_smoke.BARE_STAGES)
    assert all(r["status"] == "ok" for r in records), records
    assert sum(r["budget_s"] for r in records) == gpu_smoke.BARE_TIME_LIMIT_S <= 8 * 60
    imports, trainer, op, collectives, offload, moe = (r["result"] for r in records)
    # Nothing of the image was importable: the run did without it.
    assert imports["absent"] == {"sglang": True, "transformer_engine": True, "apex": True,
                                 "transformers": False, "safetensors": False}
    for run in trainer["precisions"].values():
        assert len(run["micro_batch_lengths"]) > 1 and not run["use_transformer_engine"]
    # The chunked FP32 op against a plain log-softmax, run for real (CPU shape).
    assert op["logp_max_abs"] < 1e-4 and op["grad_hidden_max_rel"] < 1e-3
    assert collectives["micro_batch_devices"] == ["cpu"]
    assert offload["colocated_trainer_offloads"]
    assert moe["hidden_size"] == 5120 and moe["planner_bytes"] > 0
    assert moe["layer_spec"]["mlp"] == "MoELayer"


@pytest.mark.unit
def test_the_carried_wheels_are_the_closure_at_the_installed_versions():
    needed = _closure(["megatron-core", "transformers"]) - _closure(TORCH_SIDE)
    assert needed == set(bare_wheels.PINS)
    assert {name: md.version(name) for name in bare_wheels.PINS} == bare_wheels.PINS


@pytest.mark.unit
def test_what_the_bare_tier_brings_fits_64_mib():
    folder = os.environ.get("MEGATRON_RL_BARE_WHEELS")
    wheels = bare_wheels.wheel_bytes(Path(folder) if folder else None)
    # One recorded wheel per carried distribution, of its pinned version.
    assert sorted(bare_wheels._wheel_prefix(n, v) for n, v in bare_wheels.PINS.items()) == \
        sorted(next(bare_wheels._wheel_prefix(n, v) for n, v in bare_wheels.PINS.items()
                    if w.lower().startswith(bare_wheels._wheel_prefix(n, v))) for w in wheels)
    sizes = bare_wheels.carried_bytes(wheels)
    assert sizes["project"] > 2**20  # the checkout was counted
    assert sizes["total"] <= sizes["limit"] == 64 * 2**20, sizes
