#!/usr/bin/env python
"""Fit ScaleRL compute-scaling curves to validation logs: `megatron-rl fit`, as a script.

Usage: python tools/fit_scaling_curve.py RUN_DIR... | LOG.jsonl... | LOG.csv... [options]
(see --help and docs/scaling.md).
"""
import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["fit", *sys.argv[1:]]))
