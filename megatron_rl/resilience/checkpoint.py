"""Run checkpoints: everything a resumed run needs, written atomically, verified on load.

A run checkpoint is one directory `<checkpoint.dir>/step_<N>`:

    trainer/        Megatron dist checkpoint: model, optimizer, scheduler, trainer RNG
                    (megatron_rl/trainer/checkpoint.py; loadable at another parallel layout)
    run_state.pkl   the driver: step, policy version, compute so far, the No-Positive-Resampling
                    sampler, the admission gate, the verifier-failure counter, the rollout
                    manager (buffered groups with their samples, versions and log-probs; prompts
                    in flight, regenerated on resume under the same group ids; re-queued
                    prompts; the next group id) and the driver's RNG
    scaling.jsonl   the compute-scaling log up to step N (restored on resume)
    ledger.jsonl    which groups each step trained on, up to step N (restored on resume)
    config.yaml     the resolved recipe of the run that wrote it
    manifest.json   size and sha256 of every file above; written last

It is written into `.step_<N>.partial` and renamed to `step_<N>` once the manifest is on disk
(rename is atomic within a file system), so a crash mid-write leaves a partial directory that is
never loaded (and is removed by the next save). Loading takes the newest checkpoint whose manifest
verifies; a newer one that does not (a shard missing, truncated or changed; the manifest unreadable)
is skipped with a message naming the problem, and the previous one is used.

Rolling back (checkpoint.load naming an older step_<N>) starts a new branch of the run. The old
branch's newer checkpoints are moved aside into `abandoned-<UTC time>/` under the root, never
deleted (`set_aside_newer`): left in place, `prune` (which keeps the highest steps) would delete
the new branch's saves and `latest_valid` would resume the abandoned branch.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
RUN_STATE = "run_state.pkl"
TRAINER_DIR = "trainer"
_NAME = re.compile(r"^step_(\d+)$")
_PARTIAL = re.compile(r"^\.step_(\d+)\.partial$")
ABANDONED_PREFIX = "abandoned-"
_MANIFEST_VERSION = 1


class RunCheckpointError(RuntimeError):
    """A run checkpoint is missing, incomplete or corrupt (the message names the file)."""


def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def partial_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f".step_{step:06d}.partial"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _digests(directory: Path, files: list[Path]) -> dict[str, str]:
    # hashlib releases the GIL on large buffers: shards hash in parallel.
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(_sha256, files)
    return {str(p.relative_to(directory)): d for p, d in zip(files, digests)}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Path, final: Path, *, step: int) -> None:
    """Write `staging`'s manifest, flush everything to disk and rename it to `final` (replacing
    a previous checkpoint of the same step, e.g. one taken again after a rollback)."""
    files = _files(staging)
    manifest = {"manifest_version": _MANIFEST_VERSION, "step": step,
                "written_at": time.time(),
                "files": {name: {"bytes": (staging / name).stat().st_size, "sha256": digest}
                          for name, digest in _digests(staging, files).items()}}
    for path in files:
        _fsync(path)
    tmp = staging / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    _fsync(tmp)
    tmp.rename(staging / MANIFEST)
    for directory in {staging, *(p.parent for p in files)}:
        _fsync(directory)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    _fsync(final.parent)


def verify(directory: Path) -> dict:
    """The manifest of a whole checkpoint; RunCheckpointError naming the first problem."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
        raise RunCheckpointError(f"{directory}: no {MANIFEST} (the save did not finish)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise RunCheckpointError(f"{directory}/{MANIFEST} is unreadable: {exc}") from None
    if manifest.get("manifest_version") != _MANIFEST_VERSION:
        raise RunCheckpointError(f"{directory}/{MANIFEST}: manifest version "
                                 f"{manifest.get('manifest_version')!r} is not "
                                 f"{_MANIFEST_VERSION}")
    present = {str(p.relative_to(directory)) for p in _files(directory)}
    missing = sorted(set(files) - present)
    if missing:
        raise RunCheckpointError(f"{directory}: {len(missing)} file(s) of the manifest are "
                                 f"missing, e.g. {missing[0]}")
    for name, entry in files.items():
        size = (directory / name).stat().st_size
        if size != entry["bytes"]:
            raise RunCheckpointError(f"{directory}/{name}: {size} bytes, the manifest says "
                                     f"{entry['bytes']} (truncated or rewritten)")
    names = sorted(files)
    digests = _digests(directory, [directory / n for n in names])
    for name in names:
        if digests[name] != files[name]["sha256"]:
            raise RunCheckpointError(f"{directory}/{name}: sha256 differs from the manifest "
                                     "(the file is corrupt)")
    if step != _step_of(directory):
        raise RunCheckpointError(f"{directory}: the manifest is of step {step}")
    return manifest


def _step_of(directory: Path) -> int | None:
    match = _NAME.match(directory.name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Committed checkpoints under `root`, newest first (partial ones are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if p.is_dir()
             and (step := _step_of(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def latest_valid(root: str | os.PathLike, *, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint under `root` whose manifest verifies (None: there is none); each
    newer one that fails is reported through `warn` with the reason."""
    for directory in list_checkpoints(root):
        try:
            verify(directory)
        except RunCheckpointError as exc:
            warn(f"skipping checkpoint {directory.name}: {exc}; falling back to the previous one")
            continue
        return directory
    return None


def remove_partials(root: str | os.PathLike) -> list[Path]:
    """Delete the `.step_<N>.partial` directories a crashed save left behind."""
    root = Path(root)
    if not root.is_dir():
        return []
    doomed = [p for p in root.iterdir() if p.is_dir() and _PARTIAL.match(p.name)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def prune(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` committed checkpoints (0 keeps all)."""
    if keep_last == 0:
        return []
    doomed = list_checkpoints(root)[keep_last:]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def set_aside_newer(root: str | os.PathLike, step: int) -> list[Path]:
    """Move the committed checkpoints of steps > `step` into a new `abandoned-<UTC time>/`
    folder under `root` (nothing is deleted); returns their new paths, oldest first. Called when
    a run resumes from an explicit older checkpoint (a rollback): the new branch's saves then
    neither lose to the old branch's higher step numbers in `prune` nor in `latest_valid`,
    which only look at `root`'s own step_<N> directories. Nothing newer: nothing is created."""
    root = Path(root)
    newer = [p for p in reversed(list_checkpoints(root)) if _step_of(p) > step]
    if not newer:
        return []
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder = root / f"{ABANDONED_PREFIX}{stamp}"
    suffix = 1
    while folder.exists():  # a second rollback within the same second
        suffix += 1
        folder = root / f"{ABANDONED_PREFIX}{stamp}-{suffix}"
    folder.mkdir()
    moved = []
    for path in newer:
        target = folder / path.name
        path.rename(target)  # same file system: atomic, no copy
        moved.append(target)
    _fsync(folder)
    _fsync(root)
    return moved
