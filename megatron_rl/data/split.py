"""The held-out validation split (SCALERL.md section 1: a fixed set of prompts held out of the
training data). Membership depends only on (seed, prompt id): every prompt gets the rank of
sha256(seed, id), and the lowest-ranked prompts of each task are held out, with per-task counts
proportional to the task sizes (largest remainder). So the split is the same on every host and
run, does not depend on file order, and barely moves when prompts are added.
"""
from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Sequence

from megatron_rl.data.loading import check_unique_ids
from megatron_rl.data.records import PromptRecord


def _rank_key(seed: int, prompt_id: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{prompt_id}".encode()).digest()


def _per_task_counts(sizes: dict[str, int], num_heldout: int) -> dict[str, int]:
    total = sum(sizes.values())
    exact = {task: num_heldout * size / total for task, size in sizes.items()}
    counts = {task: math.floor(value) for task, value in exact.items()}
    by_remainder = sorted(sizes, key=lambda t: (-(exact[t] - counts[t]), t))
    for task in by_remainder[:num_heldout - sum(counts.values())]:
        counts[task] += 1
    return counts


def split_heldout(records: Sequence[PromptRecord], *, num_heldout: int, seed: int,
                  stratify: bool = True) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, heldout), each in the input order. `stratify` keeps every task's share of the
    held-out set equal to its share of the data, so each task gets its own validation curve."""
    if not 0 <= num_heldout <= len(records):
        raise ValueError(f"num_heldout must be in [0, {len(records)}] (the number of prompts), "
                         f"got {num_heldout}")
    check_unique_ids(records)
    groups: dict[str, list[int]] = defaultdict(list)
    for index, record in enumerate(records):
        groups[record.task if stratify else ""].append(index)
    counts = _per_task_counts({task: len(ids) for task, ids in groups.items()}, num_heldout)
    heldout: set[int] = set()
    for task, indices in groups.items():
        ranked = sorted(indices, key=lambda i: _rank_key(seed, records[i].prompt_id))
        heldout.update(ranked[:counts[task]])
    train = [r for i, r in enumerate(records) if i not in heldout]
    held = [r for i, r in enumerate(records) if i in heldout]
    return train, held
