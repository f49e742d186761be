"""Model families (one folder each): Megatron config factories, layer specs, HF converters."""

import megatron_rl  # noqa: F401  (must precede megatron.core: makes it importable beside nvrx 0.4.1)
