"""The `megatron-rl` command: one entry point, one subcommand per job.

Each subcommand lives in the module that owns the job and exposes `main(argv) -> int`; this file
only dispatches, importing the owner lazily so that `megatron-rl cost` never pays for importing
Megatron or SGLang.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). The module's `main(argv)` parses its own arguments.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_rl.train", "run ScaleRL under the Pipeline-RL schedule from a recipe"),
    "fit": ("megatron_rl.scaling.cli", "fit compute-scaling curves to validation logs"),
    "sweep": ("megatron_rl.scaling.sweep", "run recipe variants x seeds, fit and rank them"),
    "cost": ("megatron_rl.scaling.cost", "estimate GPU-hours and the generator:trainer split"),
    "plan": ("megatron_rl.scaling.plan", "per-device memory of a recipe's trainer and generators"),
    "convert": ("megatron_rl.convert", "convert checkpoints between HF and Megatron"),
    "sft": ("megatron_rl.sft", "supervised cold start: cross-entropy on prompt + response pairs"),
    "simulate": ("megatron_rl.simulation.simulate",
                 "run a recipe's real control plane against simulated engines and trainer"),
}
# Subcommands that load torch / Megatron / transformers: they print the one-line environment
# summary (megatron_rl.console); the light ones stay light.
LOADS_THE_STACK = frozenset({"train", "convert", "sft"})
# Named in DESIGN.md but not built yet: say so instead of failing on a missing module.
PLANNED: dict[str, str] = {
    "eval": "checkpoint evaluation: validation runs inside `megatron-rl train` for now",
}


def _usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: megatron-rl SUBCOMMAND [ARGS...]", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`megatron-rl SUBCOMMAND --help` shows the subcommand's arguments; `-v` (or",
              "MEGATRON_RL_VERBOSE=1) also shows the third-party warnings silenced by default."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.console import environment_summary, quiet_known_warnings, verbose_requested

    verbose, argv = verbose_requested(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name in PLANNED:
        print(f"megatron-rl {name}: not available yet: {PLANNED[name]}", file=sys.stderr)
        return 2
    if name not in SUBCOMMANDS:
        print(f"megatron-rl: unknown subcommand {name!r}; choose one of {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    quiet_known_warnings(verbose=verbose)
    if name in LOADS_THE_STACK:
        print(environment_summary(), file=sys.stderr)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
