"""Weights & Biases (issue 37.15): with `logging.wandb.mode=offline` a run's metrics go to a real
W&B run written to disk (no network): the same scalars as TensorBoard at the same step, the
config, and the fitted scaling-curve plot. Read back from W&B's own run file (run-<id>.wandb:
LevelDB-log framed protobuf Records, wandb.proto.wandb_internal_pb2) and TensorBoard's events,
not from our code's memory. Integration tier: wandb.init starts W&B's wandb-core service process
(~2 s)."""
import hashlib
import json
import math
import struct
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

wandb = pytest.importorskip("wandb", reason="wandb is pinned in requirements/base.txt")


def _wandb_records(path: Path):
    """The protobuf Records of an offline run file: a 7-byte header (':W&B', magic, version),
    then 32 KiB blocks of chunks, each with a 7-byte header (CRC32, length, type: 1 full,
    2 first, 3 middle, 4 last), as wandb-core writes them (leveldb's log format)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a chunk header never straddles blocks: the rest is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _history(records) -> list[dict]:
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row: dict = {}
            for item in record.history.item:
                keys = list(item.nested_key) or [item.key]
                node = row
                for key in keys[:-1]:
                    node = node.setdefault(key, {})
                node[keys[-1]] = json.loads(item.value_json)
            rows.append(row)
    return rows


class _Client:
    """The counters RunMetrics reads from an engine's HTTP client (no engine here)."""

    reconnects = 0

    def activity(self):
        from megatron_rl.rollout.async_client import GeneratorActivity

        return GeneratorActivity(0.0, 0, 0)


def test_an_offline_run_gets_the_scalars_the_config_and_the_curve_plot(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import (SCALARS,
                                                                        EventAccumulator)

    from megatron_rl.config import load_config
    from megatron_rl.metrics import RunMetrics

    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never the network
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    out = tmp_path / "run"
    cfg = load_config(None, [f"output_dir={out}", "name=wandb_check", "train.lr=3e-6",
                             "eval.warmup_compute_gpu_hours=0", "logging.wandb.mode=offline",
                             "logging.wandb.project=megatron_rl_test",
                             f"logging.wandb.dir={tmp_path / 'wb'}"])
    metrics = RunMetrics(cfg, out, clients=[_Client()], num_devices=2)
    metrics.open_logs(purge_after=None)
    metrics.progress(range(6))
    # validations on a known sigmoid (A 0.8, B 1.5, C_mid 0.02, R0 0.1): scalars and the fit
    compute = [0.0, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128]
    for step, c in enumerate(compute):
        rate = 0.1 + 0.7 / (1 + (0.02 / c) ** 1.5) if c else 0.1
        metrics.scaling_log.append(step, c, {"all": rate})
    step_metrics = {"train/loss": 0.5, "train/grad_norm": 2.0, "rollout/reward_mean": 0.25,
                    "perf/step_seconds": 4.0, "perf/trainer_wait_seconds": 1.0}
    metrics.log(3, step_metrics, version=3)
    metrics.close()

    # TensorBoard's scalars at step 3, read back from its event files
    events = EventAccumulator(cfg.tensorboard_dir, size_guidance={SCALARS: 0})
    events.Reload()
    tensorboard = {tag: e.value for tag in events.Tags()[SCALARS]
                   for e in events.Scalars(tag) if e.step == 3}
    assert tensorboard["train/loss"] == 0.5 and tensorboard["perf/trainer_idle_fraction"] == 0.25

    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    run_id = (out / "wandb_run_id").read_text().strip()
    # wandb-core's writer may still be appending the last records when finish() returns on a
    # loaded machine (CI once read a file without step 3's row): read until it holds them.
    deadline = time.monotonic() + 120
    while True:
        records = list(_wandb_records(runs[0] / f"run-{run_id}.wandb"))
        rows = _history(records)
        if any(row.get("step") == 3 and "train/loss" in row for row in rows) \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    at_3 = {tag: value for row in rows if row.get("step") == 3 for tag, value in row.items()
            if not tag.startswith("_") and tag != "step"}
    scalars = {tag: value for tag, value in at_3.items() if not isinstance(value, dict)}
    assert set(scalars) == set(tensorboard), set(scalars) ^ set(tensorboard)
    for tag, value in scalars.items():  # TensorBoard stores float32
        assert math.isclose(value, tensorboard[tag], rel_tol=1e-6, abs_tol=1e-9), tag
    assert scalars["val/pass_rate/all"] == pytest.approx(0.1 + 0.7 / (1 + (0.02 / 0.016) ** 1.5))

    # the config: every section, as the run resolved it
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "megatron_rl_test" and run.display_name == "wandb_check"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["lr"] == 3e-6 and config["logging"]["wandb"]["mode"] == "offline"
    assert config["name"] == "wandb_check"

    # the fitted scaling-curve plot, at the last validated step, as a PNG in the run's media
    (image,) = [row["val/scaling_curve"] for row in rows if "val/scaling_curve" in row]
    assert image["_type"] == "image-file"
    assert [row["step"] for row in rows if "val/scaling_curve" in row] == [len(compute) - 1]
    png = runs[0] / "files" / image["path"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert hashlib.sha256(png.read_bytes()).hexdigest() == image["sha256"] == hashlib.sha256(
        (out / "wandb_scaling_curve.png").read_bytes()).hexdigest()


def test_disabled_by_default_and_no_wandb_files(tmp_path):
    from megatron_rl.config import load_config
    from megatron_rl.metrics import RunMetrics

    cfg = load_config(None, [f"output_dir={tmp_path}"])
    assert cfg.logging.wandb.mode == "disabled"
    metrics = RunMetrics(cfg, tmp_path, clients=[_Client()], num_devices=1)
    metrics.open_logs(purge_after=None)
    metrics.writer.add_scalar("train/loss", 1.0, 1)
    metrics.close()
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "wandb_run_id").exists()
