"""Test-suite rules shared by every tier.

Every test carries exactly one tier marker (unit, dist, integration, e2e) so that `make test-unit`
and friends select what they claim; a test without one is a collection error, not a silent gap.
"""
import os

import pytest

TIERS = ("unit", "dist", "integration", "e2e")

# Multi-process tests oversubscribe 2 cores badly if every rank spawns a thread per core.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if len(tiers) != 1:
            raise pytest.UsageError(
                f"{item.nodeid} has tier markers {tiers}; mark it with exactly one of {TIERS} "
                "(e.g. `pytestmark = pytest.mark.unit` at module level)"
            )
