"""Operating-system process helpers of the cluster layer: stopping every process of a process
group (an SGLang server and the scheduler / detokenizer it spawned). Ports a server binds later
come from megatron_rl.rollout.sglang_server.listen_port.

`kill_process_group` exists because stopping a server's leader is not enough: when the leader has
already exited, `SGLangServer.shutdown` returns without signalling the group. Its children die
with it (PR_SET_PDEATHSIG, megatron_rl.rollout.engine_lifetime); the sweep is the backstop for
any process of the group that outlived it all the same. A group is identified by its leader's pid
and start time, so a pid the kernel has since reused for an unrelated process is never signalled.
"""
from __future__ import annotations

import os
import signal
import time

# A process started this long before the leader cannot be a member of its group (clock ticks).
_START_TIME_SLACK_S = 1.0


def process_group_members(pgid: int, *, started_after: float) -> list[int]:
    """Pids of the live (non-zombie) processes in group `pgid` started at or after
    `started_after` (epoch seconds: the leader's start time)."""
    import psutil

    members = []
    for process in psutil.process_iter(["pid", "create_time", "status"]):
        try:
            if (process.info["status"] != psutil.STATUS_ZOMBIE
                    and process.info["create_time"] >= started_after - _START_TIME_SLACK_S
                    and os.getpgid(process.info["pid"]) == pgid):
                members.append(process.info["pid"])
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def kill_process_group(pgid: int, *, started_after: float, timeout_s: float = 20.0) -> list[int]:
    """SIGTERM every member of group `pgid` (see `process_group_members`), SIGKILL what is left
    after `timeout_s`; returns the pids that were still alive at the start."""
    members = process_group_members(pgid, started_after=started_after)
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        alive = process_group_members(pgid, started_after=started_after)
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and process_group_members(
                pgid, started_after=started_after):
            time.sleep(0.1)
    return members
