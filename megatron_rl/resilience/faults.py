"""Fault injection for the chaos tests (tests/e2e/test_chaos.py), off unless the environment
variable MEGATRON_RL_FAULTS names faults: a comma-separated list of KIND@STEP.

- nan_loss@N: step N's advantages are NaN, so its loss and gradients are non-finite (the real
  trainer path: the step is skipped and counted).
- kill_in_checkpoint@N: the driver SIGKILLs itself while writing step N's checkpoint, after the
  trainer's shards and the run state are on disk and before the rename (a partial checkpoint).

Everything else the chaos tests do (killing and stopping processes) happens from outside.
"""
from __future__ import annotations

import os
import signal

ENV = "MEGATRON_RL_FAULTS"
KINDS = ("nan_loss", "kill_in_checkpoint")


def planned(kind: str, step: int) -> bool:
    """Whether fault `kind` is to be injected at `step`."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(KINDS)}")
    for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
        name, _, at = item.partition("@")
        if name not in KINDS or not at.isdigit():
            raise ValueError(f"{ENV}: {item!r} is not KIND@STEP with KIND one of "
                             f"{', '.join(KINDS)}")
        if name == kind and int(at) == step:
            return True
    return False


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
