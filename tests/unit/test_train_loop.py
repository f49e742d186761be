"""The driver's per-step decisions after an optimizer step (megatron_rl/train.py `after_step`):
validation and checkpoint intervals, and the stop after too many skipped steps in a row. The run
is a recording stand-in (control logic only; the whole loop runs in tests/e2e)."""
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

    def save_checkpoint(self, step):
        self.calls.append(("checkpoint", step))


def _cfg(*overrides):
    return load_config("examples/configs/tiny_pipeline.yaml", [
        "train.num_steps=10", "eval.interval_steps=3", "checkpoint.interval_steps=4",
        "train.max_consecutive_skipped_steps=2", *overrides])


@pytest.mark.parametrize("step, expected", [
    (1, []), (3, [("validate", 3)]), (4, [("checkpoint", 4)]),
    (10, [("validate", 10)]),  # the last step is always validated
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
    assert run.calls == [("checkpoint", 5)]
    after_step(RecordingRun(5), _cfg("train.max_consecutive_skipped_steps=0"),
               skipped_in_a_row=50)  # 0: never stop
