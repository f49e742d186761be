"""Rich tables in a log file (output that is not a terminal) are printed whole: `megatron-rl fit`
and the demo report used to cut them at a fixed width, truncating cells and borders."""
import io

import pytest
from rich.console import Console
from rich.table import Table

from megatron_rl.console import print_table, report_console
from megatron_rl.scaling.cli import main as fit_main
from megatron_rl.scaling.log import ScalingLog

pytestmark = pytest.mark.unit

ELLIPSIS = "\u2026"  # what rich puts where it cuts a cell


def test_a_table_wider_than_any_default_is_printed_whole():
    table = Table(title="wide")
    for index in range(12):
        table.add_column(f"column number {index}", no_wrap=True)
    table.add_row(*[f"value {index} " * 3 for index in range(12)])
    out = io.StringIO()
    console = Console(file=out)  # a file: not a terminal
    print_table(console, table)
    lines = out.getvalue().splitlines()
    assert all(f"column number {index}" in lines[2] for index in range(12))
    assert all(f"value {index} value {index} value {index}" in lines[4] for index in range(12))
    assert ELLIPSIS not in out.getvalue()
    widths = {len(line) for line in lines[1:]}  # every border and row the same full width
    assert len(widths) == 1 and widths.pop() > 300
    assert console.width == 80  # the console itself is left as it was


def test_report_console_does_not_wrap_lines_in_a_log(capsys):
    console = report_console()  # pytest captures stdout: not a terminal
    console.print("word " * 60)
    assert capsys.readouterr().out == "word " * 60 + "\n"  # one line, not wrapped at 80


def test_fit_tables_are_whole_in_a_log(tmp_path, capsys):
    run = tmp_path / ("a_run_directory_with_the_long_descriptive_name_people_give_runs_" * 2)
    log = ScalingLog(run)
    for step in range(0, 3000, 100):
        compute = step * 0.4
        log.append(step, compute, {"math": 0.2 + 0.4 / (1.0 + (2000.0 / max(compute, 1e-9)))})
    code = fit_main([str(run), "--num-bootstrap", "0", "--fit-fraction", "0.5", "--power-law",
                     "--no-plots", "--warmup-gpu-hours", "0"])
    printed = capsys.readouterr().out
    assert code == 0
    assert ELLIPSIS not in printed
    header = next(line for line in printed.splitlines() if "fit budget (GPU-h)" in line)
    assert header.rstrip().endswith("held-out RMSE ┃")
    assert sum(run.name in line for line in printed.splitlines()) == 2  # both tables' rows
