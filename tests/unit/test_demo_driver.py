"""The demo driver's handling of an earlier run (examples/demo/run.py; the run itself is in
tests/e2e/test_demo.py): a second `make demo` moves the first one's outputs aside instead of
appending to its scaling log, and loses nothing."""
import pytest

from examples.demo.run import keep_previous_run

pytestmark = pytest.mark.unit


def test_a_previous_run_is_moved_aside_not_mixed_or_lost(tmp_path):
    out = tmp_path / "demo"
    keep_previous_run(out)  # nothing there: nothing to do
    assert not out.exists()
    out.mkdir()
    (out / "scaling.jsonl").write_text('{"step": 0}\n')
    (out / "config.yaml").write_text("name: demo\n")
    keep_previous_run(out)
    assert not out.exists()
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("demo.")]
    assert (aside / "scaling.jsonl").read_text() == '{"step": 0}\n'
    assert (aside / "config.yaml").read_text() == "name: demo\n"
    # A directory without a scaling log (say, only a config written) is left in place.
    out.mkdir()
    (out / "config.yaml").write_text("x\n")
    keep_previous_run(out)
    assert (out / "config.yaml").exists()
