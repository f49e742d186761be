"""The run's ledgers in output_dir, one JSON object a line:

- ledger.jsonl: which groups each optimizer step took ("trained": [group id, prompt index] pairs,
  including groups the zero-variance filter then left out), which stale groups it discarded
  ("discarded": [group id, prompt index, "requeue" | "drop"]) and a digest of the step's data
  (`groups_digest`); at the end of a run one line
  {"end": true, "next_group_id", "outstanding"} lists the groups still buffered or generating.
  Every group id from 0 to next_group_id - 1 appears exactly once over a run's ledger, across
  failures and resumes (`check_ledger`): no sample lost, none trained twice.
- faults.jsonl: every fault the run detected and how it recovered (kind, what, detected_at,
  recovered_at, requeued_groups, steps_lost), for the fault-tolerance report.

A resumed run (or a trainer restored from a checkpoint) puts back the checkpoint's copy of
ledger.jsonl: the steps after the checkpoint are redone, so their lines are replaced.
"""
from __future__ import annotations

import array
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

LEDGER = "ledger.jsonl"
FAULTS = "faults.jsonl"


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def record_step(out: Path, *, step: int, version: int, trained: Iterable[tuple[int, int]],
                discarded: Iterable[tuple[int, int, str]], digest: str = "") -> None:
    _append(out / LEDGER, {"step": step, "version": version,
                           "trained": [list(t) for t in trained],
                           "discarded": [list(d) for d in discarded], "digest": digest})


def groups_digest(groups) -> str:
    """sha256 of a step's data: every sample's tokens, behaviour log-probs, versions and loss
    mask with its reward (two runs trained on the same data iff the digests match)."""
    h = hashlib.sha256()
    for group in groups:
        for sample, result in zip(group.samples, group.results):
            # Packed bytes, not repr: a step at scale holds tens of millions of log-probs.
            h.update(array.array("q", (sample.group_id, sample.sample_index,
                                       len(sample.token_ids))).tobytes())
            for ints in (sample.token_ids, sample.versions, sample.loss_mask):
                h.update(array.array("q", ints).tobytes())
            # A failed verifier (reward None: an environment failure too) hashes as NaN.
            reward = float("nan") if result.reward is None else result.reward
            h.update(array.array("d", (*sample.logprobs, reward)).tobytes())
    return h.hexdigest()


def record_end(out: Path, *, next_group_id: int, outstanding: Iterable[int]) -> None:
    _append(out / LEDGER, {"end": True, "next_group_id": next_group_id,
                           "outstanding": sorted(outstanding)})


def record_fault(out: Path, *, kind: str, what: str, detected_at: float,
                 recovered: bool = True, **details) -> None:
    """One fault; recovered_at is now (or null for a fault the run gave up on) unless
    `details` gives it."""
    _append(out / FAULTS, {"kind": kind, "what": what, "detected_at": detected_at,
                           "recovered_at": time.time() if recovered else None, **details})


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """`records` as JSON Lines into `path`, written whole to a temporary file and then renamed
    (a reader never sees half a file); the directory is created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_ledger(records: list[dict]) -> dict[str, list[int]]:
    """{"lost": [...], "duplicated": [...]} group ids of a finished run's ledger (the last line
    must be the end line): every id below next_group_id is taken once, discarded once or
    outstanding at the end, exactly once."""
    if not records or not records[-1].get("end"):
        raise ValueError("the ledger has no end line: the run did not finish")
    end = records[-1]
    seen = Counter(end["outstanding"])
    for record in records[:-1]:
        seen.update(g for g, _ in record["trained"])
        seen.update(d[0] for d in record["discarded"])
    expected = set(range(end["next_group_id"]))
    return {"lost": sorted(expected - set(seen)),
            "duplicated": sorted(g for g, n in seen.items() if n > 1 or g not in expected)}
