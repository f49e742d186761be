"""Weights & Biases for a training run (`logging.wandb`, off by default): one W&B run per training
run that receives the same scalars as TensorBoard (at the same step), the resolved config, and
images (the fitted scaling-curve plot at the end of the run).

`MetricWriters` is what the run's code writes to (RunMetrics.writer): TensorBoard's
SummaryWriter, plus this W&B run when one is open, so every scalar the run sends to TensorBoard
(step metrics, validation, the scaling log, checkpoint timings) reaches W&B too, by
construction. Scalars are held per step and sent as one W&B history row per step on `flush()`,
with the run's `step` as their x-axis (`define_metric`), so the rows of a step redone after a
trainer recovery land at that step again instead of being dropped as out of order.

`wandb` is imported only when a run asks for it; `offline` mode writes the run under
`<logging.wandb.dir or output_dir>/wandb/` without network, to be uploaded with `wandb sync`. A
run resumed from a checkpoint (`--resume`) continues the same W&B run: its id is kept in
`<output_dir>/wandb_run_id`. W&B's console capture is off: the job's own log keeps the output,
and nothing interposes on the stderr that the progress lines write to.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

RUN_ID_FILE = "wandb_run_id"
STEP_METRIC = "step"  # the x-axis of every scalar: the optimizer step, as in TensorBoard


class WandbRun:
    """An open W&B run. `config` is the run's config as a plain dict (config_to_dict)."""

    def __init__(self, wandb_cfg, *, config: dict[str, Any], out: Path, run_name: str,
                 resume: bool):
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError(
                f"logging.wandb.mode={wandb_cfg.mode!r} needs the wandb package, which is not "
                "installed: run `make setup` (requirements/base.txt pins it), or set "
                "logging.wandb.mode=disabled") from err
        self._wandb = wandb
        out.mkdir(parents=True, exist_ok=True)
        id_file = out / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        directory = Path(wandb_cfg.dir or out)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=wandb_cfg.project, entity=wandb_cfg.entity,
            name=wandb_cfg.run_name or run_name, mode=wandb_cfg.mode, dir=os.fspath(directory),
            config=config, id=run_id, resume="allow" if run_id else None,
            reinit="create_new",  # a second run in this process (sweeps) gets its own
            settings=wandb.Settings(console="off"))
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)
        self._pending: dict[int, dict[str, Any]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._pending.setdefault(int(step), {})[tag] = float(value)

    def add_image(self, tag: str, path: str | os.PathLike, step: int) -> None:
        self._pending.setdefault(int(step), {})[tag] = self._wandb.Image(os.fspath(path))

    def flush(self) -> None:
        """One history row per pending step, in step order."""
        for step in sorted(self._pending):
            self.run.log({**self._pending[step], STEP_METRIC: step})
        self._pending.clear()

    def finish(self) -> None:
        self.flush()
        self.run.finish()


class MetricWriters:
    """TensorBoard's SummaryWriter and, when open, a `WandbRun`, behind the SummaryWriter calls
    the run uses (add_scalar, flush, close): W&B gets what TensorBoard gets."""

    def __init__(self, tensorboard, wandb_run: WandbRun | None = None):
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
        self.tensorboard.add_scalar(tag, scalar_value, global_step)
        if self.wandb_run is not None and global_step is not None:
            self.wandb_run.add_scalar(tag, scalar_value, global_step)

    def flush(self) -> None:
        self.tensorboard.flush()
        if self.wandb_run is not None:
            self.wandb_run.flush()

    def close(self) -> None:
        """Closes TensorBoard's writer; the W&B run outlives it (a restore reopens the writer,
        not the W&B run): RunMetrics.close finishes it."""
        self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.flush()
