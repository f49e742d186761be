"""Calling Ray actors: plain classes become actors at creation time (so importing the cluster
package imports no Ray, and the classes stay testable in-process), and the results of one method
called on many actors are gathered failing fast.

Failing fast matters for collectives: when one trainer rank raises, the others wait inside a
torch.distributed collective with it until its timeout (minutes); `gather` raises the first error
as soon as it arrives, with a note naming the actor, and the caller shuts the group down.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def actor_class(cls: type):
    """`cls` as a Ray actor class (`.options(...).remote(...)` creates one)."""
    import ray

    return ray.remote(cls)


def gather(refs: Sequence, labels: Sequence[str], *, what: str,
           timeout_s: float | None) -> list[Any]:
    """The results of `refs` (one per actor, named by `labels`) in order. The first failure is
    raised when it arrives, as Ray raised it (its type is also the remote error's type), with a
    note "(<what> on <label>)"; TimeoutError names the actors that did not answer within
    `timeout_s` (None only where something else bounds the wait: say what, at the call). The
    wait goes in slices of resilience/stop.py's WAIT_SLICE_S: after a SIGTERM it is abandoned
    (StopRequested) once train.graceful_stop_timeout_s has passed."""
    import ray

    from megatron_rl.resilience.stop import RUN_STOP, WAIT_SLICE_S

    position = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        RUN_STOP.abandon_if_past_grace(what)
        remaining = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            late = ", ".join(labels[position[ref]] for ref in pending)
            raise TimeoutError(f"{what}: no answer from {late} within {timeout_s:.0f} s")
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, WAIT_SLICE_S))
        for ref in ready:
            try:  # ready: the result is local already (ray.wait fetches it)
                results[position[ref]] = ray.get(ref, timeout=WAIT_SLICE_S)
            except ray.exceptions.RayError as exc:
                exc.add_note(f"({what} on {labels[position[ref]]})")
                raise
    return results


def kill_actors(actors: Sequence) -> None:
    """Kill actors outright (no restart); ones already dead are skipped."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except ValueError:  # not an actor handle of this session
            continue
