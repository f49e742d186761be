"""`megatron-rl fit` end to end on temporary run directories: tables, plots, clear errors."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.cli import main as megatron_rl_main
from megatron_rl.scaling.cli import main as fit_main
from megatron_rl.scaling.log import ScalingLog
from megatron_rl.scaling.series import ScalingSeries
from megatron_rl.scaling.sigmoid import SigmoidFitConfig, fit_sigmoid

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TASKS = {"math": (0.61, 1.5, 2000.0, 0.20), "code": (0.45, 1.1, 3000.0, 0.10)}


def curve(c, a, b, c_mid, r0):
    return r0 + (a - r0) / (1.0 + (c_mid / np.maximum(c, 1e-12)) ** b) if c > 0 else r0


def make_run(run_dir, *, num_validations=41, gpu_hours_per_step=0.4):
    log = ScalingLog(run_dir)
    for step in range(0, 100 * num_validations, 100):
        compute = step * gpu_hours_per_step
        log.append(step, compute, {t: float(curve(compute, *p)) for t, p in TASKS.items()})
    return run_dir


def test_fit_prints_a_row_per_task_and_writes_plots(tmp_path, capsys):
    run = make_run(tmp_path / "scalerl_run")
    out = tmp_path / "plots"
    code = megatron_rl_main(["fit", str(run), "--num-bootstrap", "20", "--fit-fraction", "0.5",
                             "--power-law", "--out-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    rows = [line for line in printed.splitlines() if "scalerl_run" in line and "│" in line]
    assert len(rows) == 4  # fit table + extrapolation table, one row per task each
    math_row = next(r for r in rows if "│ math" in r)
    assert "0.200" in math_row and "0.610 [" in math_row  # R0 and A with its interval
    assert "Extrapolation" in printed and "power-law A" in printed
    for name in ("curves.png", "efficiency.png", "extrapolation.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert f"wrote {out / 'curves.png'}" in printed


def test_fit_compares_two_runs_with_the_0_02_rule(tmp_path, capsys):
    csv_a, csv_b = tmp_path / "a.csv", tmp_path / "b.csv"
    compute = np.linspace(0.0, 16000.0, 41)
    for path, (a, b) in ((csv_a, (0.60, 1.0)), (csv_b, (0.61, 2.0))):
        rates = [curve(c, a, b, 2000.0, 0.2) for c in compute]
        path.write_text("compute_gpu_hours,pass_rate\n"
                        + "".join(f"{c},{r}\n" for c, r in zip(compute, rates)))
    code = fit_main([str(csv_a), str(csv_b), "--num-bootstrap", "0", "--compare", "--no-plots"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "Recipe comparison" in printed and "b:all is more compute-efficient" in printed
    assert "wrote" not in printed


@pytest.mark.parametrize("content, message", [
    ("compute_gpu_hours,pass_rate\n0,0.2\n10,0.3\n20,0.35\n", "too few points to fit: 2"),
    ("compute_gpu_hours,pass_rate\n0,0.2\n10,0.3\n5,0.35\n", "compute is not monotone"),
    ("compute_gpu_hours,pass_rate\n0,0.2\n10,30\n20,40\n", r"pass rate 30.0 at point 1 is outside"),
    ("compute_gpu_hours,pass_rate\n1,0.2\n10,0.3\n20,0.35\n", "no step-0 .* pass --r0"),
])
def test_fit_errors_exit_2_with_one_clear_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert fit_main([str(path), "--no-plots", "--num-bootstrap", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-rl fit: error: bad:all: ") and len(err.splitlines()) == 1
    assert re.search(message, err), err


def test_fit_errors_for_missing_path_and_single_curve_compare(tmp_path, capsys):
    assert fit_main([str(tmp_path / "nope"), "--no-plots"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    run = make_run(tmp_path / "one", num_validations=12)
    # Two tasks in one log are two curves: --compare works within one run ...
    assert fit_main([str(run / "scaling.jsonl"), "--compare", "--no-plots", "--num-bootstrap",
                     "0"]) == 0
    # ... but --compare on a single curve is an error.
    single = tmp_path / "single.csv"
    single.write_text("compute_gpu_hours,pass_rate\n"
                      + "".join(f"{c},{curve(c, *TASKS['math'])}\n" for c in range(0, 4000, 400)))
    assert fit_main([str(single), "--compare", "--no-plots", "--num-bootstrap", "0"]) == 2
    assert "--compare needs at least two curves" in capsys.readouterr().err


def _fit_rows(printed: str, run: str) -> dict[str, list[str]]:
    """Fit-table cells per task of `run`'s rows (run, task, R0, A, B, C_mid, points, warm-up
    excl., RMSE)."""
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in printed.splitlines()
            if f"│ {run}" in line]
    return {cells[1]: cells for cells in rows}


def _recipe(run_dir: Path, warmup_gpu_hours: float) -> None:
    from megatron_rl.config import load_config, save_config

    save_config(load_config(None, [f"eval.warmup_compute_gpu_hours={warmup_gpu_hours}"]),
                run_dir / "config.yaml")


def test_fit_defaults_the_warmup_to_the_runs_recipe_and_the_flag_wins(tmp_path, capsys):
    """Issue 29.6: `megatron-rl fit RUN_DIR` excludes the run's eval.warmup_compute_gpu_hours.
    Validations every 40 GPU-hours from 0 to 1600: a 600 warm-up excludes the 14 points at
    40..560 (C = 0 is R0, never fitted) and fits the 26 at 600..1600."""
    run = make_run(tmp_path / "recipe_run")
    _recipe(run, 600.0)
    args = [str(run), "--no-plots", "--num-bootstrap", "0"]
    assert fit_main(args) == 0
    printed = capsys.readouterr().out
    assert f"points below 600 GPU-hours excluded (eval.warmup_compute_gpu_hours of " \
           f"{run / 'config.yaml'})" in printed
    assert [row[6:8] for row in _fit_rows(printed, "recipe_run").values()] == [["26", "14"]] * 2
    assert fit_main(args + ["--warmup-gpu-hours", "0"]) == 0  # the explicit flag wins
    printed = capsys.readouterr().out
    assert "points below 0 GPU-hours excluded (--warmup-gpu-hours)" in printed
    assert [row[6:8] for row in _fit_rows(printed, "recipe_run").values()] == [["40", "0"]] * 2
    # A log file carries no recipe: no warm-up, and the output says why.
    assert fit_main([str(run / "scaling.jsonl"), "--no-plots", "--num-bootstrap", "0"]) == 0
    assert "points below 0 GPU-hours excluded (default: no run directory with a config.yaml)" \
        in capsys.readouterr().out


def test_fit_refuses_runs_whose_recipes_disagree_on_the_warmup(tmp_path, capsys):
    runs = [make_run(tmp_path / name) for name in ("a", "b")]
    for run, warmup in zip(runs, (600.0, 800.0)):
        _recipe(run, warmup)
    assert fit_main([*map(str, runs), "--no-plots", "--num-bootstrap", "0"]) == 2
    err = capsys.readouterr().err
    assert "eval.warmup_compute_gpu_hours differ" in err and "pass --warmup-gpu-hours" in err
    assert fit_main([*map(str, runs), "--no-plots", "--num-bootstrap", "0",
                     "--warmup-gpu-hours", "700"]) == 0
    (runs[0] / "config.yaml").write_text("eval: {warmup_compute_gpu_hours: -1}\n")
    assert fit_main([str(runs[0]), "--no-plots", "--num-bootstrap", "0"]) == 2
    err = capsys.readouterr().err
    assert "config.yaml" in err and "warmup_compute_gpu_hours" in err \
        and "pass --warmup-gpu-hours to fit without reading it" in err


def test_efficiency_transform_is_c_to_the_b_on_the_model():
    from megatron_rl.scaling.plots import efficiency_points

    compute = np.geomspace(100.0, 16000.0, 30)
    rates = np.array([curve(c, *TASKS["math"]) for c in compute])
    series = ScalingSeries(run="r", task="math", compute_gpu_hours=compute, pass_rate=rates)
    fit = fit_sigmoid(compute, rates, r0=0.2, config=SigmoidFitConfig(num_bootstrap=0))
    c, f = efficiency_points(series, fit)
    slope = np.polyfit(np.log(c), np.log(f), 1)[0]
    assert slope == pytest.approx(fit.b, rel=1e-3)  # log F vs log C has slope B
    np.testing.assert_allclose(f, c ** fit.b, rtol=0.02)


def test_tool_script_is_a_thin_wrapper(tmp_path):
    run = make_run(tmp_path / "toolrun", num_validations=15)
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "fit_scaling_curve.py"), str(run), "--no-plots",
         "--num-bootstrap", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "toolrun" in result.stdout and "Sigmoid fits" in result.stdout


def test_fit_says_no_learning_signal_instead_of_numbers(tmp_path, capsys):
    """Issue 37 item 12: an all-zero curve and a flat one fit at a bound / one grid step above
    R0; the table and the JSON say "no learning signal" with the reason, not parameters."""
    compute = np.r_[0.0, np.geomspace(0.05, 20.0, 30)]
    rising = [float(curve(c, 0.6, 1.5, 1.0, 0.2)) for c in compute]
    paths = []
    for name, rates in (("zero", [0.0] * 31), ("flat", [0.3] * 31), ("rising", rising)):
        paths.append(tmp_path / f"{name}.csv")
        paths[-1].write_text("compute_gpu_hours,pass_rate\n"
                             + "".join(f"{c},{r}\n" for c, r in zip(compute, rates)))
    out_json = tmp_path / "fits.json"
    assert fit_main([*map(str, paths), "--num-bootstrap", "20", "--no-plots",
                     "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    rows = {name: next(line for line in printed.splitlines() if f"│ {name}" in line)
            for name in ("zero", "flat", "rising")}
    for name in ("zero", "flat"):
        assert re.search(r"│ no learning signal +│ - +│ - +│ 30 ", rows[name]), rows[name]
    assert "no learning signal" not in rows["rising"] and "0.600 [" in rows["rising"]
    assert "zero:all: no learning signal: A 0.005 within one grid step (0.005) of R0 0.000; " \
        "C_mid" in printed and "at its upper bound" in printed
    assert "flat:all: no learning signal: A 0.305 within one grid step (0.005) of R0 0.300" \
        in printed
    zero, flat, rising = (entry["fit"] for entry in json.loads(out_json.read_text()))
    for fit in (zero, flat):
        assert fit["no_learning_signal"].startswith("A 0.")
        assert [fit[k] for k in ("a", "a_ci", "b", "b_ci", "c_mid", "c_mid_ci")] == [None] * 6
        assert fit["num_points"] == 30
    assert rising["no_learning_signal"] is None and rising["a"] == pytest.approx(0.6, abs=0.005)


def test_the_plots_show_a_curve_without_learning_as_points_only(tmp_path, monkeypatch):
    """A fit with no learning signal is drawn as its points, labelled so, with no sigmoid (whose
    parameters sit at a bound) and no efficiency slope; the plots are still written (the sweep's
    e2e, where five steps of a random policy learn nothing, needs its curves.png)."""
    from megatron_rl.scaling import plots

    labels = []
    real_add_subplot = plots.Figure.add_subplot

    def add_subplot(figure, *args, **kwargs):
        ax = real_add_subplot(figure, *args, **kwargs)
        for method in ("scatter", "plot"):
            drawn = getattr(ax, method)

            def record(*a, _drawn=drawn, **k):
                labels.append(k.get("label"))
                return _drawn(*a, **k)
            setattr(ax, method, record)
        return ax

    monkeypatch.setattr(plots.Figure, "add_subplot", add_subplot)
    compute = np.r_[0.0, np.geomspace(0.05, 20.0, 30)]
    rising = [float(curve(c, 0.6, 1.5, 1.0, 0.2)) for c in compute]
    paths = []
    for name, rates in (("zero", [0.0] * 31), ("rising", rising)):
        paths.append(tmp_path / f"{name}.csv")
        paths[-1].write_text("compute_gpu_hours,pass_rate\n"
                             + "".join(f"{c},{r}\n" for c, r in zip(compute, rates)))
    out = tmp_path / "plots"
    assert fit_main([*map(str, paths), "--num-bootstrap", "20", "--out-dir", str(out)]) == 0
    for name in ("curves.png", "efficiency.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    drawn = [label for label in labels if label]
    assert any("(no learning signal)" in label and label.startswith("zero") for label in drawn)
    sigmoids = [label for label in drawn if label.startswith("sigmoid A=")]
    slopes = [label for label in drawn if label.startswith("slope B=")]
    assert len(sigmoids) == 1 and sigmoids[0].startswith("sigmoid A=0.60"), drawn
    assert len(slopes) == 1, drawn
