"""Keeps `import megatron.core` working beside nvidia-resiliency-ext < 0.6.

megatron-core 0.19.2 probes nvidia-resiliency-ext's async-checkpoint modules at import time
(dist_checkpointing/strategies/torch.py) and, when they import, *asserts* that the package is at
least 0.6.0 — so with 0.4.1, the newest release for Python 3.11 / glibc 2.36, `import megatron.core`
raises. We use nvrx only for fault tolerance and in-process restart, never for Megatron's async
checkpointing, so for an older nvrx we hide one of the probed modules: Megatron's probe then reports
"no nvrx async support" and falls back to its own checkpoint writer. With nvrx >= 0.6 this does
nothing. It must run before anything imports megatron.core, hence its call in megatron_rl/__init__.
"""
from __future__ import annotations

import importlib.metadata
import sys

_PROBED_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt.cached_metadata_filesystem_reader"
_MEGATRON_MIN_NVRX = (0, 6)


def hide_old_nvrx_async_checkpointing() -> None:
    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor < _MEGATRON_MIN_NVRX:
        # A None entry makes `import_module(_PROBED_MODULE)` raise ImportError.
        sys.modules.setdefault(_PROBED_MODULE, None)
