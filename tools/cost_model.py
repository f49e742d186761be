#!/usr/bin/env python
"""Estimate GPU-hours and the generator:trainer split of an RLVR run: `megatron-rl cost`, as a
script.

Usage: python tools/cost_model.py [--preset paper-8b|scout-gb200] [--FIELD VALUE ...] [--json]
(see --help and docs/scaling.md).
"""
import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["cost", *sys.argv[1:]]))
