#!/usr/bin/env python
"""Convert a Megatron checkpoint (converted or saved by the trainer, any TP/EP/PP) to a Hugging
Face safetensors folder: `megatron-rl convert megatron-to-hf`, as a script.

Usage: python tools/convert_megatron_to_hf.py CHECKPOINT_DIR OUTPUT_DIR [--hf-config DIR]
[--dtype bfloat16] [--max-shard-size-gb 5] [--validate] [--overwrite] (see docs/convert.md).
"""
import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", "megatron-to-hf", *sys.argv[1:]]))
