"""The driver's per-step decisions after an optimizer step (megatron_rl/train.py `after_step`):
validation and checkpoint intervals, and the stop after too many skipped steps in a row; and the
commit of a run checkpoint whose trainer shards are written asynchronously (RunSetup's
save_checkpoint / commit_checkpoint, resilience/run_checkpoints.py). The run and the trainer group are recording stand-ins
(control logic only; the whole loop runs in tests/e2e, real checkpoints in test_resilience.py)."""
import pickle
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.train import RunStoppedError, after_step

pytestmark = pytest.mark.unit


class RecordingRun:
    def __init__(self, step):
        self.step = step
        self.calls = []

    def validate(self, step):
        self.calls.append(("validate", step))

    def save_checkpoint(self, step, *, wait=False):
        self.calls.append(("checkpoint", step) if not wait else ("checkpoint, wait", step))

    def commit_checkpoint(self, *, blocking):
        assert not blocking  # after a step: commit only what is complete, never wait


def _cfg(*overrides):
    return load_config("examples/configs/tiny_pipeline.yaml", [
        "train.num_steps=10", "eval.interval_steps=3", "checkpoint.interval_steps=4",
        "train.max_consecutive_skipped_steps=2", *overrides])


@pytest.mark.parametrize("step, expected", [
    (1, []), (3, [("validate", 3)]), (4, [("checkpoint", 4)]),
    (10, [("validate", 10), ("checkpoint", 10)]),  # the last step: always both
    (12, [("validate", 12), ("checkpoint", 12)]),
])
def test_validation_and_checkpoint_intervals(step, expected):
    run = RecordingRun(step)
    after_step(run, _cfg(), skipped_in_a_row=1)
    assert run.calls == expected


def test_too_many_skipped_steps_stop_the_run_with_a_checkpoint_naming_the_step():
    run = RecordingRun(5)
    with pytest.raises(RunStoppedError, match=r"2 optimizer steps in a row were skipped .* "
                                              r"the last at step 5 .*step_000005 was written"):
        after_step(run, _cfg(), skipped_in_a_row=2)
    assert run.calls == [("checkpoint, wait", 5)]  # committed before the run stops
    after_step(RecordingRun(5), _cfg("train.max_consecutive_skipped_steps=0"),
               skipped_in_a_row=50)  # 0: never stop


class RecordingTrainers:
    """Stand-in for the trainer group: an asynchronous save writes its shard file at once and is
    "complete" when the test says so (`done`), as Megatron's finalize would report."""

    def __init__(self):
        self.done = False
        self.calls = []

    def save_checkpoint(self, directory, extra_state, *, async_save):
        Path(directory).mkdir()
        (Path(directory) / "shard.distcp").write_bytes(pickle.dumps(extra_state))
        self.calls.append(("save", extra_state["step"], async_save))
        return True

    def finalize_checkpoints(self, *, blocking):
        self.calls.append(("finalize", blocking))
        return self.done or blocking


class _Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, step))


def _bare_run(tmp_path, trainers):
    from megatron_rl.resilience.run_checkpoints import RunCheckpoints
    from megatron_rl.run_setup import RunSetup

    run = object.__new__(RunSetup)  # only what save/commit_checkpoint use
    run.cfg = _cfg("checkpoint.async_save=always", "checkpoint.keep_last=2",
                   f"output_dir={tmp_path}")
    run.out, run.checkpoint_root, run.version = tmp_path, tmp_path / "checkpoints", 7
    run.trainers, run.writer = trainers, _Writer()
    run.checkpoints = RunCheckpoints(
        run.cfg, run.out, run.checkpoint_root, trainers=lambda: trainers,
        trainer_call=lambda call: call(),
        driver_state=lambda: {"step": run.last_checkpoint_step}, writer=lambda: run.writer)
    return run


def test_an_asynchronous_checkpoint_is_committed_only_once_its_shards_are_complete(tmp_path):
    from megatron_rl.resilience import checkpoint as run_checkpoint

    trainers = RecordingTrainers()
    run = _bare_run(tmp_path, trainers)
    root = run.checkpoint_root

    def names():
        return sorted(p.name for p in root.iterdir())

    run.save_checkpoint(2)
    assert names() == [".step_000002.partial"] and run.last_checkpoint_step is None
    run.commit_checkpoint(blocking=False)  # still being written
    assert names() == [".step_000002.partial"]
    trainers.done = True
    run.commit_checkpoint(blocking=False)
    assert names() == ["step_000002"] and run.last_checkpoint_step == 2
    assert run_checkpoint.verify(root / "step_000002")  # manifest over the finished shards
    run.commit_checkpoint(blocking=True)  # nothing pending: no trainer call
    assert trainers.calls == [("save", 2, "always"), ("finalize", False), ("finalize", False)]

    trainers.done = False
    run.save_checkpoint(4)
    run.save_checkpoint(6)  # step 4's commit first (waiting for its writer), then step 6 staged
    assert names() == [".step_000006.partial", "step_000002", "step_000004"]
    run.save_checkpoint(8, wait=True)  # e.g. a graceful stop: committed before it returns
    assert names() == ["step_000006", "step_000008"]  # keep_last=2
    assert trainers.calls[3:] == [("save", 4, "always"), ("finalize", True), ("save", 6, "always"),
                                  ("finalize", True), ("save", 8, "always"), ("finalize", True)]
    assert [s for s in run.writer.scalars] == [("perf/checkpoint_blocked_seconds", n)
                                               for n in (2, 4, 6, 8)]


class _Stub:
    """Accepts any call (the trainer group, the rollout manager, the verifier counter)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_the_compute_axis_goes_on_through_an_in_run_trainer_restore(tmp_path):
    """Issue 29.3: 10 devices, 1.5 h since the first step (15 GPU-h spent), the trainer restored
    to a checkpoint taken at 10 GPU-h. Redone steps are spent compute: the axis stays at 15 and
    keeps growing (the old restore set the offset to 10 on top of the running clock: 25). A run
    resumed in a new process starts at the checkpoint's value."""
    import time
    import types

    from megatron_rl.metrics import RunMetrics
    from megatron_rl.run_setup import RunSetup

    run = object.__new__(RunSetup)
    run.cfg = _cfg(f"output_dir={tmp_path}")
    run.cluster = types.SimpleNamespace(trainers=_Stub(), model_dir=str(tmp_path))
    run.verifier_failures, run.manager, run.checkpoints = _Stub(), _Stub(), _Stub()
    run.metrics = RunMetrics(run.cfg, tmp_path, clients=[], num_devices=10)
    run.metrics._compute_start = time.perf_counter() - 1.5 * 3600
    state = {"step": 4, "version": 4, "compute_gpu_hours": 10.0, "verifier_failures": {},
             "manager": {}}
    before = run.metrics.compute_gpu_hours
    run._restore(tmp_path / "step_000004", state, in_run=True)
    after = run.metrics.compute_gpu_hours
    assert (run.step, run.version) == (4, 4)
    assert 15.0 <= before <= after < 15.1  # continuous and monotone, not 25

    resumed = object.__new__(RunSetup)
    resumed.cfg, resumed.cluster = run.cfg, run.cluster
    resumed.verifier_failures, resumed.manager, resumed.checkpoints = _Stub(), _Stub(), _Stub()
    resumed.metrics = RunMetrics(run.cfg, tmp_path, clients=[], num_devices=10)
    resumed._restore(tmp_path / "step_000004", state)
    assert resumed.metrics.compute_gpu_hours == 10.0  # the clock starts with the first step


def test_a_run_resumed_from_an_explicit_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    """Issue 29.4, the run's side: resuming with checkpoint.load=.../step_000200 moves the
    abandoned branch's step_000300 and step_000400 aside (nothing deleted), so the next
    automatic resume takes the new branch; an automatic resume (load null) moves nothing."""
    from megatron_rl.resilience import checkpoint as run_checkpoint
    from megatron_rl.resilience.run_checkpoints import start_branch

    root = tmp_path / "checkpoints"
    for step in (200, 300, 400):
        root.mkdir(exist_ok=True)
        staging = run_checkpoint.partial_path(root, step)
        staging.mkdir()
        (staging / "run_state.pkl").write_bytes(pickle.dumps({"step": step}))
        run_checkpoint.commit(staging, run_checkpoint.checkpoint_path(root, step), step=step)
    start_branch(_cfg(f"output_dir={tmp_path}"), root, 200)  # load null: an ordinary resume
    assert sorted(p.name for p in run_checkpoint.list_checkpoints(root)) == [
        "step_000200", "step_000300", "step_000400"]
    start_branch(_cfg(f"output_dir={tmp_path}", f"checkpoint.load={root / 'step_000200'}"),
                 root, 200)
    assert [p.name for p in run_checkpoint.list_checkpoints(root)] == ["step_000200"]
    assert run_checkpoint.latest_valid(root, warn=print).name == "step_000200"
    aside = [p for p in root.iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == [
        "step_000300", "step_000400"]


def test_generation_before_the_step_zero_validation_is_on_the_compute_axis(tmp_path):
    """Issue 29.7d: the generators start on the training groups before validate(0) and the
    first step; that compute is spent. The clock starts with them, and the progress bar (after
    validate(0)) does not restart it (it used to: everything before it was off the axis)."""
    import time

    from megatron_rl.metrics import RunMetrics

    metrics = RunMetrics(_cfg(f"output_dir={tmp_path}"), tmp_path, clients=[], num_devices=2)
    assert metrics.compute_gpu_hours == 0.0  # nothing spent before the generators start
    metrics.start_clock()
    metrics._compute_start -= 1800  # half an hour of generation and validation(0)
    metrics.progress(range(3))
    assert 1.0 <= metrics.compute_gpu_hours < 1.01
    metrics.close()


def test_rollout_samples_record_each_completions_shape_and_version_runs(tmp_path):
    """logging.rollout_samples: one line per trained completion, the versions of its sampled
    tokens run-length encoded in order (inserted tokens, loss_mask 0, are not sampled)."""
    import json
    import math

    import torch

    from megatron_rl.metrics import version_runs, write_rollout_samples
    from megatron_rl.rollout.manager import FinishedGroup
    from megatron_rl.rollout.samples import RolloutSample

    assert version_runs([]) == [] and version_runs([3]) == [[3, 1]]
    assert version_runs([0, 0, 1, 1, 1, 2, 2]) == [[0, 2], [1, 3], [2, 2]]

    def sample(index, versions, mask):
        n = len(versions)
        return RolloutSample(group_id=7, sample_index=index, prompt_token_ids=(1, 5, 6),
                             token_ids=tuple(range(10, 10 + n)), logprobs=(0.0,) * n,
                             versions=tuple(versions), loss_mask=tuple(mask),
                             finish_reason="stop", interrupted=index == 0,
                             segment_offsets=(0,), thinking_budget=4)

    group = FinishedGroup(group_id=7, prompt_index=3, admission_version=0, results=(None, None),
                          samples=(sample(0, [0, 0, -1, 1, 1], [1, 1, 0, 1, 1]),
                                   sample(1, [1, 1], [1, 1])))
    path = tmp_path / "rollout_samples" / "step_000002.jsonl"
    write_rollout_samples(path, 2, [group], torch.tensor([[1.0, math.nan]]))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"step": 2, "group_id": 7, "prompt_index": 3, "sample_index": 0,
                        "prompt_tokens": 3, "completion_tokens": 5, "loss_tokens": 4,
                        "thinking_budget": 4, "interrupted": True, "finish_reason": "stop",
                        "versions": [[0, 2], [1, 2]], "reward": 1.0}
    assert lines[1]["versions"] == [[1, 2]] and lines[1]["reward"] is None
    assert not path.with_suffix(".jsonl.tmp").exists()
