"""A trainer rank's life under megatron_rl.resilience.rank_monitor (run by test_rank_monitor.py):
three short train steps calibrate the train_step timeout, then a step hangs. The monitor must
SIGKILL this process; if it does not, the script ends by itself and prints "NOT KILLED"."""
import os
import sys
import time

import torch

import megatron_rl  # noqa: F401  (nvrx / Megatron compatibility first)
from megatron_rl.resilience.rank_monitor import RankMonitor

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
monitor, why = RankMonitor.start(
    timeouts_s={"train_step": 600.0, "weight_sync": 700.0, "checkpoint": 800.0},
    hang_timeout_factor=4.0)
assert monitor is not None, why
print("server pid", monitor._server.pid, flush=True)
sections = monitor._client.section_timeouts.section  # what the monitor process was given
print("sections", " ".join(f"{name}={sections[name]:g}" for name in sorted(sections)), flush=True)
for _ in range(3):
    with monitor.section("train_step"):
        time.sleep(0.5)
with monitor.section("weight_sync"):  # other sections keep the fixed timeout
    time.sleep(0.1)
print(f"calibrated {monitor.calibrated_timeout_s}", flush=True)
with monitor.section("train_step"):
    print("hanging", flush=True)
    time.sleep(300)
print("NOT KILLED", flush=True)
