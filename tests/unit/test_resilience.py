"""Run checkpoints on disk (atomic commit, manifest verification, fallback to the previous one),
the ledger check and the fault-injection parser. The whole-run behaviour (resume, chaos) is in
tests/e2e/test_fault_tolerance.py."""
import json
import os

import pytest
import torch

from megatron_rl.resilience import checkpoint as ckpt
from megatron_rl.resilience import faults
from megatron_rl.resilience.ledger import check_ledger

pytestmark = pytest.mark.unit


def _save(root, step, payload=b"weights"):
    staging = ckpt.partial_path(root, step)
    (staging / "trainer").mkdir(parents=True)
    (staging / "trainer" / "shard_0.distcp").write_bytes(payload * 1000)
    (staging / "run_state.pkl").write_bytes(b"state %d" % step)
    ckpt.commit(staging, ckpt.checkpoint_path(root, step), step=step)
    return ckpt.checkpoint_path(root, step)


def test_commit_writes_a_verifiable_manifest_and_leaves_no_partial(tmp_path):
    path = _save(tmp_path, 4)
    manifest = ckpt.verify(path)
    assert manifest["step"] == 4
    assert set(manifest["files"]) == {"trainer/shard_0.distcp", "run_state.pkl"}
    assert manifest["files"]["trainer/shard_0.distcp"]["bytes"] == 7000
    assert [p.name for p in tmp_path.iterdir()] == ["step_000004"]


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "trainer" / "shard_0.distcp").write_bytes(b"x" * 7000), "sha256 differs"),
    (lambda p: (p / "trainer" / "shard_0.distcp").write_bytes(b"x"), "truncated"),
    (lambda p: (p / "run_state.pkl").unlink(), "missing"),
    (lambda p: (p / ckpt.MANIFEST).write_text("{not json"), "unreadable"),
    (lambda p: (p / ckpt.MANIFEST).unlink(), "did not finish"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, message):
    _save(tmp_path, 2)
    damage(_save(tmp_path, 4))
    warnings = []
    assert ckpt.latest_valid(tmp_path, warn=warnings.append) == ckpt.checkpoint_path(tmp_path, 2)
    assert len(warnings) == 1 and "step_000004" in warnings[0] and message in warnings[0]
    with pytest.raises(ckpt.RunCheckpointError, match=message):
        ckpt.verify(ckpt.checkpoint_path(tmp_path, 4))


def test_a_partial_save_is_never_listed_and_is_removed(tmp_path):
    _save(tmp_path, 2)
    partial = ckpt.partial_path(tmp_path, 4)
    (partial / "trainer").mkdir(parents=True)
    (partial / "run_state.pkl").write_bytes(b"half")
    assert ckpt.list_checkpoints(tmp_path) == [ckpt.checkpoint_path(tmp_path, 2)]
    assert ckpt.latest_valid(tmp_path, warn=pytest.fail) == ckpt.checkpoint_path(tmp_path, 2)
    assert ckpt.remove_partials(tmp_path) == [partial]
    assert not partial.exists()


def test_prune_keeps_the_newest_and_a_resave_of_a_step_replaces_it(tmp_path):
    for step in (2, 4, 6, 10):
        _save(tmp_path, step)
    ckpt.prune(tmp_path, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000010", "step_000006"]
    _save(tmp_path, 6, payload=b"other")  # the same step again after a rollback
    assert (ckpt.checkpoint_path(tmp_path, 6) / "trainer" / "shard_0.distcp").read_bytes()[:5] \
        == b"other"
    ckpt.verify(ckpt.checkpoint_path(tmp_path, 6))
    assert ckpt.latest_valid(tmp_path / "nothing", warn=pytest.fail) is None


def test_a_rollback_sets_the_abandoned_branch_aside_and_resumes_the_new_one(tmp_path):
    """Issue 29.4: saved 100..400 with keep_last=3, rolled back to 200, saved 250. Without the
    set-aside prune keeps 400, 300, 250 and latest_valid picks the old branch's 400."""
    for step in (100, 200, 300, 400):
        _save(tmp_path, step, payload=b"old")
        ckpt.prune(tmp_path, keep_last=3)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_000400", "step_000300", "step_000200"]
    moved = ckpt.set_aside_newer(tmp_path, 200)  # checkpoint.load=.../step_000200
    assert [p.name for p in moved] == ["step_000300", "step_000400"]
    (folder,) = {p.parent for p in moved}
    assert folder.parent == tmp_path and folder.name.startswith("abandoned-")
    assert ckpt.latest_valid(tmp_path, warn=pytest.fail) == ckpt.checkpoint_path(tmp_path, 200)
    _save(tmp_path, 250, payload=b"new")
    assert ckpt.prune(tmp_path, keep_last=3) == []
    assert ckpt.latest_valid(tmp_path, warn=pytest.fail) == ckpt.checkpoint_path(tmp_path, 250)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000250", "step_000200"]
    # Nothing deleted: the old branch's checkpoints verify where they were moved to.
    assert [ckpt.verify(p)["step"] for p in moved] == [300, 400]
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name, "step_000200",
                                                          "step_000250"]
    # A second rollback in the same second gets its own folder; nothing newer: no folder.
    again = ckpt.set_aside_newer(tmp_path, 200)
    assert [p.name for p in again] == ["step_000250"] and again[0].parent != folder
    assert ckpt.set_aside_newer(tmp_path, 200) == []
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("abandoned-")]) == 2


def test_a_manifest_of_another_step_is_refused(tmp_path):
    path = _save(tmp_path, 2)
    os.rename(path, ckpt.checkpoint_path(tmp_path, 8))
    with pytest.raises(ckpt.RunCheckpointError, match="manifest is of step 2"):
        ckpt.verify(ckpt.checkpoint_path(tmp_path, 8))


def test_check_ledger_finds_lost_and_duplicated_groups():
    steps = [{"step": 1, "trained": [[0, 5], [1, 6]], "discarded": []},
             {"step": 2, "trained": [[3, 1], [4, 2]], "discarded": [[2, 7, "requeue"]]}]
    end = {"end": True, "next_group_id": 7, "outstanding": [5, 6]}
    assert check_ledger(steps + [end]) == {"lost": [], "duplicated": []}
    twice = steps + [{"step": 3, "trained": [[1, 6]], "discarded": []}, end]
    assert check_ledger(twice) == {"lost": [], "duplicated": [1]}
    assert check_ledger(steps + [dict(end, outstanding=[5])]) == {"lost": [6], "duplicated": []}
    with pytest.raises(ValueError, match="no end line"):
        check_ledger(steps)
    assert json.loads(json.dumps(end)) == end


def test_fault_injection_is_off_by_default_and_parses_kind_at_step(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert not faults.planned("nan_loss", 3)
    monkeypatch.setenv(faults.ENV, "nan_loss@3, kill_in_checkpoint@4")
    assert faults.planned("nan_loss", 3) and not faults.planned("nan_loss", 4)
    assert faults.planned("kill_in_checkpoint", 4)
    monkeypatch.setenv(faults.ENV, "nan_loss@x")
    with pytest.raises(ValueError, match="KIND@STEP"):
        faults.planned("nan_loss", 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer of the capability check")
def test_asynchronous_save_is_refused_without_cuda_with_the_reason():
    """Megatron's async writer stages tensors with torch.cuda.synchronize(): on CPU
    checkpoint.async_save=auto saves synchronously, and always is an error naming the fix."""
    from megatron_rl.trainer.checkpoint import async_save_unavailable, save_checkpoint

    assert "needs CUDA" in async_save_unavailable()
    with pytest.raises(RuntimeError, match="needs CUDA; set checkpoint.async_save to auto or "
                                           "never"):
        save_checkpoint("unused", None, None, None, layout=None, groups=None, step=1,
                        num_skipped_steps=0, async_save=True)


def test_stale_rank_monitor_socket_dirs_are_removed_and_live_ones_kept(tmp_path):
    import subprocess
    import sys

    from megatron_rl.resilience.rank_monitor import remove_stale_socket_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process
    names = {"stale": f"megatron_rl_rank_monitor_{dead.pid}_abc",
             "live": f"megatron_rl_rank_monitor_{os.getpid()}_def",
             "other": "megatron_rl_rank_monitor_notapid", "unrelated": f"something_{dead.pid}_x"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / f"_ft_launcher{dead.pid}_to_rmon.socket").write_text("")
    assert remove_stale_socket_dirs(str(tmp_path)) == [names["stale"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for k, n in names.items() if k != "stale")
