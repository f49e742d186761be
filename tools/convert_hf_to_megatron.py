#!/usr/bin/env python
"""Convert a Hugging Face model folder to a Megatron dist_checkpointing checkpoint that the trainer
loads at any TP/EP/PP: `megatron-rl convert hf-to-megatron`, as a script.

Usage: python tools/convert_hf_to_megatron.py HF_DIR OUTPUT_DIR [--dtype bfloat16] [--validate]
[--overwrite] (see --help and docs/convert.md).
"""
import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
