"""A run's checkpoints as the driver uses them: where a run resumes from, what a restore puts
back into output_dir, and the save -> commit -> prune sequence (the on-disk format and its
verification are in checkpoint.py).

A save is staged under a partial name: the trainer ranks write their shards (maybe
asynchronously, checkpoint.async_save), the driver adds its state (`driver_state()`), the
restored files and the recipe; `commit` renames it to step_<N> with its manifest once the shards
are complete, then prunes the oldest. Until then the previous checkpoint is the newest valid one.
"""
from __future__ import annotations

import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from megatron_rl.config import ConfigError, RunConfig
from megatron_rl.console import notice
from megatron_rl.resilience import checkpoint as run_checkpoint
from megatron_rl.resilience import faults, ledger

# Files of output_dir that a run checkpoint carries and a restore puts back.
RESTORED_FILES = ("scaling.jsonl", ledger.LEDGER)


def read_run_state(path: Path) -> dict:
    """The driver's part of the run checkpoint at `path`."""
    with open(path / run_checkpoint.RUN_STATE, "rb") as f:
        return pickle.load(f)


def restored_files(directory: Path) -> dict[str, bytes]:
    """The RESTORED_FILES present in `directory` (a checkpoint, or output_dir)."""
    return {name: (directory / name).read_bytes() for name in RESTORED_FILES
            if (directory / name).is_file()}


def put_back_files(out: Path, files: dict[str, bytes]) -> None:
    """output_dir's restored files as a checkpoint (or the start of the run) had them."""
    for name in RESTORED_FILES:
        target = out / name
        if name in files:
            target.write_bytes(files[name])
        else:
            target.unlink(missing_ok=True)


def resume_point(cfg: RunConfig, out: Path, root: Path) -> Path | None:
    """The run checkpoint to resume from, as checkpoint.load / checkpoint.resume say (None: a
    fresh start). Removes partial saves; refuses to overwrite a previous run's outputs."""
    ck = cfg.checkpoint
    for partial in run_checkpoint.remove_partials(root):
        notice(f"removed {partial.name}: a checkpoint save that did not finish")
    if ck.load is not None:
        path = Path(ck.load).resolve()
        try:
            run_checkpoint.verify(path)
        except run_checkpoint.RunCheckpointError as exc:
            raise ConfigError(f"checkpoint.load: {exc}; give another step_<N> directory "
                              "or null for the newest valid one") from None
        return path
    found = None if ck.resume == "never" else run_checkpoint.latest_valid(root, warn=notice)
    if found is None:
        if ck.resume == "always":
            raise ConfigError(f"checkpoint.resume: always (--resume), but {root} holds no "
                              "valid run checkpoint; start without --resume")
        previous = [n for n in RESTORED_FILES if (out / n).is_file()]
        if previous:
            never = " (checkpoint.resume: never)" if ck.resume == "never" else ""
            raise ConfigError(
                f"output_dir {out} holds a previous run ({', '.join(previous)}) with no "
                f"checkpoint to resume from{never}; choose another output_dir, or delete it to "
                "start over")
    return found


def start_branch(cfg: RunConfig, root: Path, step: int) -> None:
    """A run resumed from an explicit checkpoint.load of step `step` starts a new branch: the
    newer checkpoints of the abandoned one are moved aside, never deleted (checkpoint.py
    `set_aside_newer`), so that neither prune nor the next resume prefers them."""
    if cfg.checkpoint.load is None:
        return
    moved = run_checkpoint.set_aside_newer(root, step)
    if moved:
        notice(f"rolled back to step {step}: the newer checkpoints of the abandoned branch "
               f"({', '.join(p.name for p in moved)}) are moved to {moved[0].parent} "
               "(nothing is deleted)")


class RunCheckpoints:
    """Saves and commits the run's checkpoints under `root` (checkpoint.dir).

    `trainers` returns the current trainer group (it is replaced when the trainer recovers);
    `trainer_call` runs a call on it (a rank's death or hang raises TrainerFailure);
    `driver_state` returns the driver's part (one moment of the rollout loop); `writer` is the
    run's TensorBoard writer (returned by a function: a restore reopens it)."""

    def __init__(self, cfg: RunConfig, out: Path, root: Path, *, trainers: Callable,
                 trainer_call: Callable, driver_state: Callable[[], dict],
                 writer: Callable):
        self.cfg, self.out, self.root = cfg, out, root
        self._trainers, self._trainer_call = trainers, trainer_call
        self._driver_state, self._writer = driver_state, writer
        self.last_step: int | None = None  # the newest committed checkpoint's step
        # (staging dir, step, asynchronous) of a checkpoint not yet committed
        self._pending: tuple[Path, int, bool] | None = None
        self._blocked_s = 0.0  # the trainer-side time the run waited on the last one
        self._async_save_explained = False

    def save(self, step: int, version: int, *, wait: bool = False) -> None:
        """A run checkpoint of the state after `step` under a partial name; committed at once
        unless the trainer's shards are written asynchronously (`commit` after each step, or
        at once with `wait`)."""
        from megatron_rl.config import save_config

        self.commit(blocking=True)  # the previous one first: commits stay in order
        self.root.mkdir(parents=True, exist_ok=True)
        staging = run_checkpoint.partial_path(self.root, step)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        started = time.perf_counter()
        asynchronous = self._trainer_call(lambda: self._trainers().save_checkpoint(
            str(staging / run_checkpoint.TRAINER_DIR), {"step": step, "version": version},
            async_save=self.cfg.checkpoint.async_save))
        self._blocked_s = time.perf_counter() - started
        if self.cfg.checkpoint.async_save == "auto" and not asynchronous \
                and not self._async_save_explained:
            from megatron_rl.trainer.checkpoint import async_save_unavailable

            self._async_save_explained = True
            notice(f"checkpoint.async_save=auto: saving synchronously "
                   f"({async_save_unavailable() or 'not available on the trainer ranks'})")
        with open(staging / run_checkpoint.RUN_STATE, "wb") as f:
            pickle.dump(self._driver_state(), f, protocol=pickle.HIGHEST_PROTOCOL)
        for name in RESTORED_FILES:
            if (self.out / name).is_file():
                shutil.copyfile(self.out / name, staging / name)
        save_config(self.cfg, str(staging / "config.yaml"))
        self._pending = (staging, step, asynchronous)
        if wait or not asynchronous:
            self.commit(blocking=True)

    def commit(self, *, blocking: bool) -> None:
        """Commit the staged checkpoint once its trainer shards are complete (an asynchronous
        save may still be writing them; `blocking` waits)."""
        if self._pending is None:
            return
        staging, step, asynchronous = self._pending
        if asynchronous:
            started = time.perf_counter()
            done = self._trainer_call(lambda: self._trainers().finalize_checkpoints(
                blocking=blocking))
            self._blocked_s += time.perf_counter() - started
            if not done:
                return
        self._pending = None
        if faults.planned("kill_in_checkpoint", step):
            faults.kill_self()
        run_checkpoint.commit(staging, run_checkpoint.checkpoint_path(self.root, step),
                              step=step)
        run_checkpoint.prune(self.root, self.cfg.checkpoint.keep_last)
        self.last_step = step
        self._writer().add_scalar("perf/checkpoint_blocked_seconds", self._blocked_s, step)

    def abandon_pending(self) -> None:
        """The trainer ranks writing the staged checkpoint died: it stays partial (the next
        start removes it)."""
        self._pending = None

    def restore_point(self, initial: tuple[dict, dict[str, bytes]] | None
                      ) -> tuple[Path | None, dict, dict[str, bytes]] | None:
        """(checkpoint, driver state, restored files) of the newest valid checkpoint, else of
        `initial` (the start of the run, path None); None when there is neither."""
        path = run_checkpoint.latest_valid(self.root, warn=notice)
        if path is not None:
            return path, read_run_state(path), restored_files(path)
        if initial is not None:
            return None, *initial
        return None
