"""The scaling log: writer durability and append-only behaviour, readers for jsonl, TensorBoard
(via torch's SummaryWriter, what the trainer passes in) and CSV, and their clear errors."""
import json
import os

import numpy as np
import pytest

from megatron_rl.scaling.log import LOG_NAME, ScalingLog, read_scaling_log

pytestmark = pytest.mark.unit

VALIDATIONS = [  # (step, compute, {task: pass rate})
    (0, 0.0, {"all": 0.25, "math": 0.30, "code": 0.20}),
    (100, 12.5, {"all": 0.31, "math": 0.38, "code": 0.24}),
    (200, 25.0, {"all": 0.36, "math": 0.44, "code": 0.28}),
]


def write_run(run_dir, tb_writer=None):
    log = ScalingLog(run_dir, tb_writer=tb_writer)
    for step, compute, rates in VALIDATIONS:
        log.append(step, compute, rates)
    return log


def check_series(by_task, run_name, *, abs_tol=0.0):
    assert set(by_task) == {"all", "math", "code"}
    for task, series in by_task.items():
        assert series.run == run_name and series.task == task
        np.testing.assert_array_equal(series.step, [0, 100, 200])
        np.testing.assert_allclose(series.compute_gpu_hours, [0.0, 12.5, 25.0], atol=abs_tol)
        np.testing.assert_allclose(series.pass_rate, [v[2][task] for v in VALIDATIONS],
                                   atol=abs_tol)
        assert series.r0 == pytest.approx(VALIDATIONS[0][2][task], abs=abs_tol)


def test_jsonl_round_trip_one_line_per_task_per_validation(tmp_path):
    run = tmp_path / "run7"
    write_run(run)
    lines = (run / LOG_NAME).read_text().splitlines()
    assert len(lines) == 9
    assert json.loads(lines[0]) == {"step": 0, "compute_gpu_hours": 0.0, "pass_rate": 0.25,
                                    "task": "all"}
    assert json.loads(lines[5]) == {"step": 100, "compute_gpu_hours": 12.5, "pass_rate": 0.24,
                                    "task": "code"}
    check_series(read_scaling_log(run), "run7")
    check_series(read_scaling_log(run / LOG_NAME), "scaling")  # a .jsonl path: run = file stem


def test_appends_are_fsynced_and_never_rewrite_old_bytes(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    log = ScalingLog(tmp_path)
    log.append(0, 0.0, {"all": 0.2})
    first = (tmp_path / LOG_NAME).read_bytes()
    log.append(100, 1.0, {"all": 0.3})
    second = (tmp_path / LOG_NAME).read_bytes()
    assert second.startswith(first) and len(second) > len(first)
    assert len(synced) >= 2  # at least one fsync per append (plus the directory on creation)


def test_resumed_run_relogs_a_step_and_the_last_line_wins(tmp_path):
    write_run(tmp_path)
    before = (tmp_path / LOG_NAME).read_bytes()
    # A run resumed from the step-100 checkpoint validates step 200 again, then 300.
    resumed = ScalingLog(tmp_path)
    resumed.append(200, 25.5, {"all": 0.37, "math": 0.45, "code": 0.29})
    resumed.append(300, 38.0, {"all": 0.40, "math": 0.48, "code": 0.31})
    assert (tmp_path / LOG_NAME).read_bytes().startswith(before)
    series = read_scaling_log(tmp_path)["all"]
    np.testing.assert_array_equal(series.step, [0, 100, 200, 300])
    np.testing.assert_allclose(series.compute_gpu_hours, [0.0, 12.5, 25.5, 38.0])
    np.testing.assert_allclose(series.pass_rate, [0.25, 0.31, 0.37, 0.40])


def test_torn_last_line_is_skipped_and_the_next_append_starts_a_new_line(tmp_path):
    log = ScalingLog(tmp_path)
    log.append(0, 0.0, {"all": 0.2})
    with open(tmp_path / LOG_NAME, "a") as f:
        f.write('{"step": 100, "compute_gpu_ho')  # a crash in the middle of a write
    ScalingLog(tmp_path).append(100, 1.0, {"all": 0.3})
    with pytest.warns(UserWarning, match=r"scaling.jsonl:2: skipping a line"):
        series = read_scaling_log(tmp_path)["all"]
    np.testing.assert_allclose(series.pass_rate, [0.2, 0.3])


def test_tensorboard_scalars_round_trip_multi_task(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "tbrun"
    writer = SummaryWriter(log_dir=str(run / "tb"))
    write_run(run, tb_writer=writer)
    writer.close()
    (run / LOG_NAME).unlink()  # force the TensorBoard reader
    check_series(read_scaling_log(run), "tbrun", abs_tol=1e-6)  # TB stores float32


def test_csv_with_tasks_and_steps_and_without(tmp_path):
    with_steps = tmp_path / "sweep.csv"
    with_steps.write_text("step,compute_gpu_hours,pass_rate,task\n"
                          + "".join(f"{s},{c},{r[t]},{t}\n" for s, c, r in VALIDATIONS
                                    for t in r))
    check_series(read_scaling_log(with_steps), "sweep")
    plain = tmp_path / "plain.csv"
    plain.write_text("compute_gpu_hours,pass_rate\n0,0.2\n10,0.3\n20,0.35\n")
    series = read_scaling_log(plain)["all"]
    assert series.step is None and series.r0 == 0.2
    np.testing.assert_allclose(series.pass_rate, [0.2, 0.3, 0.35])


def test_writer_rejects_bad_records(tmp_path):
    log = ScalingLog(tmp_path)
    with pytest.raises(ValueError, match=r"pass rate 1.5 of task 'all' at step 0"):
        log.append(0, 0.0, {"all": 1.5})
    with pytest.raises(ValueError, match="pass_rate_by_task is empty"):
        log.append(0, 0.0, {})
    with pytest.raises(ValueError, match="compute_gpu_hours"):
        log.append(0, float("nan"), {"all": 0.2})
    log.append(100, 5.0, {"all": 0.2})
    with pytest.raises(ValueError, match="steps must increase"):
        log.append(100, 6.0, {"all": 0.3})
    with pytest.raises(ValueError, match="compute must not decrease"):
        log.append(200, 4.0, {"all": 0.3})
    assert len((tmp_path / LOG_NAME).read_text().splitlines()) == 1  # rejected lines not written


def test_readers_reject_bad_logs_with_the_location(tmp_path):
    bad_rate = tmp_path / "rate.csv"
    bad_rate.write_text("compute_gpu_hours,pass_rate\n0,0.2\n10,1.2\n")
    with pytest.raises(ValueError, match=r"rate:all: pass rate 1.2 at point 1 is outside \[0, 1\]"):
        read_scaling_log(bad_rate)
    drop = tmp_path / "drop.csv"
    drop.write_text("compute_gpu_hours,pass_rate\n0,0.2\n10,0.3\n5,0.35\n")
    with pytest.raises(ValueError, match=r"compute is not monotone: 5.0 GPU-hours at point 2"):
        read_scaling_log(drop)
    by_step = tmp_path / "bystep.jsonl"
    by_step.write_text('{"step": 0, "compute_gpu_hours": 0, "pass_rate": 0.1, "task": "all"}\n'
                       '{"step": 100, "compute_gpu_hours": 9, "pass_rate": 0.2, "task": "all"}\n'
                       '{"step": 200, "compute_gpu_hours": 7, "pass_rate": 0.3, "task": "all"}\n')
    with pytest.raises(ValueError, match=r"not monotone: 7.0 GPU-hours at step 200"):
        read_scaling_log(by_step)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"step": 0, "pass_rate": 0.1}\n')
    with pytest.raises(ValueError,
                       match=r"missing.jsonl:1: missing field\(s\) \['compute_gpu_hours'\]"):
        read_scaling_log(missing)
    no_column = tmp_path / "cols.csv"
    no_column.write_text("gpu_hours,pass_rate\n0,0.2\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['compute_gpu_hours'\]"):
        read_scaling_log(no_column)
    not_number = tmp_path / "nan.csv"
    not_number.write_text("compute_gpu_hours,pass_rate\n0,abc\n")
    with pytest.raises(ValueError, match=r"nan.csv:2: could not convert"):
        read_scaling_log(not_number)
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(FileNotFoundError, match="neither scaling.jsonl nor TensorBoard"):
        read_scaling_log(tmp_path / "empty_run")
    with pytest.raises(ValueError, match="unsupported log"):
        read_scaling_log(bad_rate.rename(tmp_path / "rate.txt"))


def test_has_step_tells_a_resumed_run_whether_its_step_was_validated(tmp_path):
    """A stop between a step's checkpoint and its validation: the resumed run validates the
    step it resumes at only when the log lacks it (megatron_rl/train.py)."""
    log = ScalingLog(tmp_path)
    assert not log.has_step(0)  # no log yet
    log.append(0, 0.0, {"all": 0.25})
    log.append(2, 0.5, {"all": 0.5, "rg/chain_sum": 0.5})
    resumed = ScalingLog(tmp_path)
    assert resumed.has_step(0) and resumed.has_step(2)
    assert not resumed.has_step(1) and not resumed.has_step(3)
