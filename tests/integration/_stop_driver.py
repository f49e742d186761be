"""A driver stuck in waits, for tests/integration/test_graceful_stop.py: the run's own stop
machinery (GracefulStop, GeneratorHealth.wait on the rollout loop, TrainerGroup's calls) around a
real local Ray cluster whose "trainer rank" never finishes a step and a "reward worker" child
process. Its health checks are stubbed (nothing to check here): the waits are the real ones.

`python _stop_driver.py OUT_DIR GRACE_S`. Phases, each announced in OUT_DIR/phases.jsonl:
1. waiting for "generation" (a coroutine that never ends) through GeneratorHealth.wait, until the
   first SIGTERM abandons it;
2. a generator restart that never ends (GeneratorPool.restart of an engine whose restart hangs):
   the driver never waits for it (restarts are polled, GeneratorPool.poll_replacements);
3. a trainer step that never ends (TrainerGroup.train_step): abandoned GRACE_S after the signal;
4. a plain ray.get of another endless call (no slices): only the second SIGTERM ends it, which
   must kill every process of the run and exit at once.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class EndlessRank:
    """A trainer rank whose calls never return."""

    def train_step(self, batch):
        time.sleep(3600)

    def sleep(self):
        time.sleep(3600)


class EndlessGenerator:
    """A generator actor whose restart never returns."""

    def restart(self):
        time.sleep(3600)


def main(out: Path, grace_s: float) -> None:
    import psutil
    import ray

    from megatron_rl.cluster.generators import GeneratorPool
    from megatron_rl.cluster.remote import actor_class
    from megatron_rl.cluster.runtime import ClusterSettings, RayCluster
    from megatron_rl.cluster.trainers import TrainerGroup
    from megatron_rl.resilience.recovery import GeneratorHealth
    from megatron_rl.resilience.stop import GracefulStop, StopRequested
    from megatron_rl.rollout.event_loop import RolloutLoop

    def phase(name: str, **details) -> None:
        with open(out / "phases.jsonl", "a") as f:
            f.write(json.dumps({"phase": name, "at": time.time(), **details}) + "\n")

    with GracefulStop(grace_s=grace_s) as stop:
        RayCluster.start(ClusterSettings(num_cpus=1, log_to_driver=False,
                                         temp_dir=tempfile.mkdtemp(prefix="mrl_", dir="/tmp")))
        stop.install()  # as train() does: ray.init replaced the SIGTERM handler
        reward_worker = subprocess.Popen(["sleep", "3600"])
        rank = actor_class(EndlessRank).remote()
        trainers = TrainerGroup(None, [rank])
        loop = RolloutLoop()
        health = GeneratorHealth.__new__(GeneratorHealth)  # the wait, without engines to check
        health.loop, health.check, health.record_reward_faults = loop, lambda: None, lambda: None

        async def generation():
            await asyncio.Event().wait()

        phase("generation")
        try:
            health.wait(generation())
        except StopRequested as abandoned:
            phase("generation abandoned", message=str(abandoned),
                  no_checkpoint=abandoned.no_checkpoint, signal=stop.requested.name)
        pool = GeneratorPool(None, [actor_class(EndlessGenerator).remote()], ["generator-0"],
                             start_timeout_s=3600, call_timeout_s=3600)
        pool.restart(0)  # returns at once, as every poll of it does
        phase("restart pending", polled=repr(pool.poll_replacements()))
        try:
            trainers.train_step({"tokens": [1, 2, 3]})
        except StopRequested as abandoned:
            phase("step abandoned", message=str(abandoned), no_checkpoint=abandoned.no_checkpoint)
        phase("blocked", reward_worker=reward_worker.pid,
              descendants=[[p.pid, p.create_time()]
                           for p in psutil.Process().children(recursive=True)])
        ray.get(rank.sleep.remote(), timeout=3600)
        phase("ray.get returned")  # must not happen: the second SIGTERM ends the process


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
