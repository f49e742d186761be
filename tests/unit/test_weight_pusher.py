"""cluster/weights.py WeightPusher.push's retry of a weight sync a generator failed: each retry
comes after a health check that takes the failed generator out (strikes=1), SYNC_ATTEMPTS tries
in all. Stand-ins (scheduling logic only): the sync is a function that fails as told, the check
records how it was called; the real sync and check run in tests/scale/test_scale_faults.py."""
from __future__ import annotations

import types

import pytest

from megatron_rl.cluster.weights import SYNC_ATTEMPTS, WeightPusher
from megatron_rl.config import load_config
from megatron_rl.weight_sync import WeightSyncError

pytestmark = pytest.mark.unit


def _push(outcomes: list):
    pusher = WeightPusher(load_config("examples/configs/tiny_pipeline.yaml", []), loop=None,
                          manager=None, urls=list, clients=[], colocated=False, wait=None)
    checks, outcomes = [], list(outcomes)

    def sync():  # stand-in for the trainer group's sync
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    try:
        return pusher.push(sync, check_generators=lambda **how: checks.append(how)), checks
    finally:
        assert not outcomes  # every outcome was used: no try more or fewer than expected


def test_a_sync_failing_twice_in_a_row_is_retried_after_each_check():
    """A second generator failing during the retry (two deaths at scale) does not stop the run:
    before, push retried once and the second WeightSyncError ended it."""
    report = types.SimpleNamespace(paused_s=0.0)
    assert SYNC_ATTEMPTS == 3
    (result, paused), checks = _push([WeightSyncError("engine a died"),
                                      WeightSyncError("engine b died"), report])
    assert result is report and paused == 0
    assert checks == [{"now": True}, {"now": True, "strikes": 1}, {"now": True, "strikes": 1}]


def test_a_sync_that_keeps_failing_stops_after_its_attempts():
    failures = [WeightSyncError(f"try {i}") for i in range(SYNC_ATTEMPTS)]
    with pytest.raises(WeightSyncError, match=f"try {SYNC_ATTEMPTS - 1}"):
        _push(failures)
