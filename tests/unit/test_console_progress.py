"""Progress output off a terminal (issue 37.14): under Slurm or Ray, or `make demo > log`, a bar's
carriage returns pile every update onto one line of the log. `console.progress` keeps tqdm's bar
in a terminal and writes one plain line per step, with the bar's fields and postfix, anywhere
else; the call sites (SFT, conversion, the RL driver's step bar) go through it."""
import io
import re

import pytest
from tqdm import tqdm

from megatron_rl.console import LineProgress, progress

pytestmark = pytest.mark.unit


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


def test_off_a_terminal_one_plain_line_per_step_with_its_fields():
    """The SFT loop's pattern: iterate, set the step's postfix inside the body."""
    log = io.StringIO()
    bar = progress(range(4), desc="sft", unit="step", file=log)
    losses = [2.5, 1.25, 0.625, 0.3125]
    for step, _ in enumerate(bar):
        bar.set_postfix(loss=f"{losses[step]:.4f}", lr=f"{1e-5 * (step + 1):.2e}")
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 4, text
    for step, line in enumerate(lines, start=1):
        assert line.startswith(f"sft: {100 * step // 4:3d}% {step}/4 ["), line
        # the step's own fields, as the bar shows them (postfix keys sorted, like tqdm's)
        assert line.endswith(f", loss={losses[step - 1]:.4f}, lr={1e-5 * step:.2e}]"), line
        assert re.search(r"\[\d\d:\d\d<\d\d:\d\d, ", line), line  # elapsed<remaining
        assert "step/s" in line or "s/step" in line, line  # the rate


def test_the_driver_pattern_update_after_the_postfix_and_a_rewind_after_a_restore():
    """RunMetrics.log sets the postfix, then run_steps calls update(1); a trainer restore sets
    `n` back and refreshes (train.py run_steps). A resumed run's first update(run.step) of 0
    writes nothing."""
    log = io.StringIO()
    bar = progress(range(3), desc="scalerl", unit="step", file=log)
    bar.update(0)
    for step in (1, 2):
        bar.set_postfix(reward=f"{step / 10:.2f}", version=step)
        bar.update(1)
    bar.n = 1  # restored to the step-1 checkpoint
    bar.refresh()
    bar.set_postfix(reward="0.90", version=3)
    bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == [
        "scalerl:  33% 1/3", "scalerl:  67% 2/3", "scalerl:  33% 1/3", "scalerl:  67% 2/3"]
    assert lines[0].endswith("reward=0.10, version=1]") and lines[-1].endswith(
        "reward=0.90, version=3]")


def test_fine_grained_work_writes_a_line_per_interval_and_the_last_count_on_close():
    """Conversion updates a byte bar per tensor: with line_every_s, no line per update."""
    log = io.StringIO()
    bar = progress(total=100 * 2**20, unit="B", unit_scale=True, desc="hf -> megatron",
                   file=log, line_every_s=3600.0)
    for _ in range(100):
        bar.update(2**20)
    assert log.getvalue() == ""  # the interval has not passed
    bar.close()
    bar.close()  # idempotent, as tqdm's
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf -> megatron: 100% 105M/105M ["), lines


def test_in_a_terminal_the_bar_is_kept():
    screen = _Terminal()
    bar = progress(range(3), desc="sft", unit="step", file=screen)
    assert isinstance(bar, tqdm) and not isinstance(bar, LineProgress)
    for _ in bar:
        bar.set_postfix(loss="1.0000")
    assert "\r" in screen.getvalue()  # the bar redraws itself in place


def test_disabled_is_silent_everywhere():
    for stream in (io.StringIO(), _Terminal()):
        bar = progress(range(3), desc="sft", unit="step", file=stream, disable=True)
        assert list(bar) == [0, 1, 2]
        assert stream.getvalue() == ""


def test_the_sft_loop_logs_one_line_per_update(tmp_path, capsys):
    """The demo's base build: 300 SFT updates used to share a handful of log lines. Here the
    loop (megatron_rl/sft.py _train) over 5 steps with stderr captured (not a terminal); the
    trainer is a stand-in that returns a known loss per step (this checks the output, not
    training)."""
    import types

    from megatron_rl import sft

    losses = iter([3.0, 2.0, 1.5, 1.25, 1.0])

    class _Trainer:
        def train_step(self, batch):
            return types.SimpleNamespace(loss=next(losses), learning_rate=1e-5, grad_norm=1.0,
                                         num_loss_tokens=4, skipped=False)

    settings = sft.SFTSettings(hf_checkpoint="unused", data="unused.jsonl",
                               output_dir=str(tmp_path), batch_size=2)
    encoded = [([1, 2], [3, 4], [1, 1])] * 3
    assert sft._train(_Trainer(), encoded, settings, num_steps=5, output=tmp_path,
                      log=True) == [3.0, 2.0, 1.5, 1.25, 1.0]
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("sft: ")]
    assert [line.split(" [")[0] for line in lines] == [
        f"sft: {20 * i:3d}% {i}/5" for i in range(1, 6)]
    assert [line.split("loss=")[1].split(",")[0] for line in lines] == [
        "3.0000", "2.0000", "1.5000", "1.2500", "1.0000"]


def test_the_rl_driver_logs_one_line_per_step_with_its_fields(tmp_path, capsys):
    """RunMetrics' step bar (the `megatron-rl train` driver) with stderr captured (not a
    terminal): one line per step with reward, generator busy and trainer idle shares, engines
    and the policy version. The engine client is a stand-in giving RunMetrics its counters."""
    from megatron_rl.config import load_config
    from megatron_rl.metrics import RunMetrics
    from megatron_rl.rollout.async_client import GeneratorActivity

    class _Client:
        reconnects = 0

        def activity(self):
            return GeneratorActivity(0.0, 0, 0)

    cfg = load_config(None, [f"output_dir={tmp_path}", "name=demo", "rollout.num_generators=1"])
    metrics = RunMetrics(cfg, tmp_path, clients=[_Client()], num_devices=2)
    metrics.open_logs(purge_after=None)
    bar = metrics.progress(range(cfg.train.num_steps))
    for step, reward in ((1, 0.25), (2, 0.5)):
        metrics.log(step, {"rollout/reward_mean": reward, "perf/step_seconds": 4.0,
                           "perf/trainer_wait_seconds": 1.0}, version=step)
        bar.update(1)
    metrics.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("demo: ")]
    total = cfg.train.num_steps
    assert [line.split("% ")[1].split(" [")[0] for line in lines] == [f"1/{total}", f"2/{total}"]
    assert lines[0].endswith("engines=1/1, gen_busy=0.00, reward=0.25, trainer_idle=0.25, "
                             "version=1]"), lines
    assert lines[1].endswith("reward=0.50, trainer_idle=0.25, version=2]"), lines
