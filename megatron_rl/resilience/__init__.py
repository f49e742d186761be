"""Fault tolerance (docs/fault_tolerance.md): run checkpoints written atomically with a manifest
and verified on load (checkpoint.py), the run's ledgers of trained groups and detected faults
(ledger.py), and the fault injection the chaos tests use (faults.py); the run's side of its
checkpoints (run_checkpoints.py: resume point, save, commit, restore point) and the recovery while
a run goes on (recovery.py: generator restarts, reward-worker faults, trainer failures). The
restore itself is in megatron_rl/run_setup.py, the graceful stop in megatron_rl/train.py."""
from megatron_rl.resilience.checkpoint import (RunCheckpointError, latest_valid,
                                               list_checkpoints, verify)
from megatron_rl.resilience.ledger import check_ledger, read_jsonl

__all__ = ["RunCheckpointError", "check_ledger", "latest_valid", "list_checkpoints",
           "read_jsonl", "verify"]
