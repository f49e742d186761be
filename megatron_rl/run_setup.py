"""What a training run starts and stops (megatron_rl/train.py drives it): the prompts and their
held-out split, the verifiers, the Ray cluster with the generator engines and the Megatron trainer
ranks, the weight sync between them, the rollout manager on its own event loop, and the outputs
(TensorBoard, the compute-scaling log, checkpoints). `RunSetup.start(cfg)` brings everything up
in order and the context exit tears it down in reverse, also after an error, so no SGLang server,
Ray worker or verifier process outlives the run.

Compute for the scaling curve is device-hours: (trainer ranks + generator devices) x wall time
since the first optimizer step began (on CPU, processes stand in for devices).

Fault tolerance (docs/fault_tolerance.md): a run resumes from the newest valid run checkpoint in
its directory (megatron_rl/resilience/checkpoint.py); a generator that dies or hangs is taken out
of the rotation, its groups re-queued, and it is restarted and re-synced while the others go on;
a trainer rank that dies or hangs makes the trainer group restart from the last checkpoint, the
generators keeping their engines. Every fault is written to faults.jsonl, every step's groups to
ledger.jsonl.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pickle
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from megatron_rl.config import ConfigError, RunConfig
from megatron_rl.resilience import checkpoint as run_checkpoint
from megatron_rl.resilience import faults, ledger

# Files of output_dir that a run checkpoint carries and a restore puts back.
_RESTORED_FILES = ("scaling.jsonl", ledger.LEDGER)


_STABLE_S = 300.0  # a generator up this long since its restart has recovered
_HEALTH_STRIKES = 2  # health checks in a row a generator must fail to count as hung


class TrainerFailure(RuntimeError):
    """A trainer rank died or hung (the run restores the trainer group from a checkpoint)."""


class RunStopped(RuntimeError):
    """The run stopped itself (a checkpoint was written); the message says why and what next."""


def notice(message: str) -> None:
    """A line for the operator on stderr that leaves the progress bar intact."""
    from tqdm import tqdm

    tqdm.write(f"megatron-rl train: {message}", file=sys.stderr)


class _Phases:
    """Wall time of named start-up phases, for the operator's line (`with phases("Ray"): ...`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - start

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def __str__(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())


def _load_records(cfg: RunConfig) -> list:
    from megatron_rl.data.loading import load_prompts
    from megatron_rl.data.sources import PROCEDURAL_TASK_PREFIX, reasoning_gym_prompts

    source = cfg.data.prompts
    if source.startswith(PROCEDURAL_TASK_PREFIX):
        return reasoning_gym_prompts(source[len(PROCEDURAL_TASK_PREFIX):],
                                     num_prompts=cfg.data.num_generated_prompts, seed=cfg.seed)
    return load_prompts(source)


class RunSetup:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.step = 0
        self.version = 0
        self._stack = contextlib.ExitStack()
        self._compute_start: float | None = None
        self._compute_offset = 0.0
        self._paused_busy_s = 0.0  # generator-seconds of in-flight requests held by pauses
        self._released = False  # colocated: the generators' memory is released for training
        self.last_checkpoint_step: int | None = None
        # (staging dir, step, asynchronous) of a checkpoint not yet committed (commit_checkpoint)
        self._pending_checkpoint: tuple[Path, int, bool] | None = None
        self._checkpoint_blocked_s = 0.0  # the trainer-side time the run waited on the last one
        self._async_save_explained = False
        self._initial: tuple[dict, dict[str, bytes]] | None = None  # restore point before step 1
        self._trainer_restarts = 0
        # Restarts of a generator in a row: one that fails again within _STABLE_S of its
        # restart (a crash loop) counts on; rollout.max_generator_restarts of them: given up.
        self._generator_restarts: dict[int, int] = {}
        self._restarted_at: dict[int, float] = {}
        self._health_strikes: dict[int, int] = {}  # failed timer health checks in a row
        self._given_up: set[int] = set()
        self._last_health_check = 0.0
        self._failures: list = []  # GeneratorFailure reports not yet recovered

    # ------------------------------------------------------------------ start / stop

    @classmethod
    def start(cls, cfg: RunConfig) -> "RunSetup":
        run = cls(cfg)
        try:
            run._start()
        except BaseException:
            run._stack.close()
            raise
        return run

    def __enter__(self) -> "RunSetup":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _start(self) -> None:
        cfg = self.cfg
        if cfg.model.hf_checkpoint is None:
            raise ConfigError("model.hf_checkpoint: megatron-rl train needs the HF checkpoint "
                              "the generators serve and the trainer starts from; convert or "
                              "create one (tools/, docs/convert.md)")
        from transformers import AutoTokenizer

        self.out = Path(cfg.output_dir).resolve()  # Ray actors need absolute paths
        self.out.mkdir(parents=True, exist_ok=True)
        self.checkpoint_root = Path(cfg.checkpoint_dir).resolve()
        resume = self._resume_point()
        state = self._read_run_state(resume) if resume is not None else None
        if resume is not None:
            self._put_back_files(self._restored_files(resume))
        self._open_logs(purge_after=state["step"] if state else None)
        self._stack.callback(lambda: self.writer.close())
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        self._start_verifiers()
        self._load_data()
        self._start_cluster()
        self._build_rollouts()
        if resume is not None:
            self._restore(resume, state)
            notice(f"resumed from {resume} (step {self.step}, policy version {self.version})")
        self._start_rollouts()

    # ------------------------------------------------------------------ resume / restore

    def _resume_point(self) -> Path | None:
        """The run checkpoint to resume from, as checkpoint.load / checkpoint.resume say."""
        ck, root = self.cfg.checkpoint, self.checkpoint_root
        for partial in run_checkpoint.remove_partials(root):
            notice(f"removed {partial.name}: a checkpoint save that did not finish")
        if ck.load is not None:
            path = Path(ck.load).resolve()
            try:
                run_checkpoint.verify(path)
            except run_checkpoint.RunCheckpointError as exc:
                raise ConfigError(f"checkpoint.load: {exc}; give another step_<N> directory "
                                  "or null for the newest valid one") from None
            return path
        found = None if ck.resume == "never" else run_checkpoint.latest_valid(root, warn=notice)
        if found is None:
            if ck.resume == "always":
                raise ConfigError(f"checkpoint.resume: always (--resume), but {root} holds no "
                                  "valid run checkpoint; start without --resume")
            previous = [n for n in _RESTORED_FILES if (self.out / n).is_file()]
            if previous:
                raise ConfigError(
                    f"output_dir {self.out} holds a previous run ({', '.join(previous)}) with "
                    f"no checkpoint to resume from{' (checkpoint.resume: never)' if ck.resume == 'never' else ''}; "
                    "choose another output_dir, or delete it to start over")
        return found

    @staticmethod
    def _read_run_state(path: Path) -> dict:
        with open(path / run_checkpoint.RUN_STATE, "rb") as f:
            return pickle.load(f)

    @staticmethod
    def _restored_files(directory: Path) -> dict[str, bytes]:
        """The _RESTORED_FILES present in `directory` (a checkpoint, or output_dir)."""
        return {name: (directory / name).read_bytes() for name in _RESTORED_FILES
                if (directory / name).is_file()}

    def _put_back_files(self, files: dict[str, bytes]) -> None:
        """output_dir's restored files as a checkpoint (or the start of the run) had them."""
        for name in _RESTORED_FILES:
            target = self.out / name
            if name in files:
                target.write_bytes(files[name])
            else:
                target.unlink(missing_ok=True)

    def _open_logs(self, *, purge_after: int | None) -> None:
        """TensorBoard (events after `purge_after` dropped: a restored run redoes those steps)
        and the scaling log."""
        from torch.utils.tensorboard import SummaryWriter

        from megatron_rl.scaling.log import ScalingLog

        if getattr(self, "writer", None) is not None:
            self.writer.close()
        self.writer = SummaryWriter(self.cfg.tensorboard_dir, purge_step=None
                                    if purge_after is None else purge_after + 1)
        self.scaling_log = ScalingLog(self.out, tb_writer=self.writer)

    def _restore(self, path: Path | None, state: dict) -> None:
        """Trainer, driver and rollout state as of a checkpoint (None: the start of the run);
        the generators get the restored weights under the restored version. The manager must
        not be running."""
        if path is None:
            self._trainer_call(lambda: self.trainers.call(
                "load_model_weights", self._converted_start_checkpoint(self.model_dir)))
        else:
            self._trainer_call(lambda: self.trainers.load_checkpoint(
                str(path / run_checkpoint.TRAINER_DIR)))
        self.step, self.version = state["step"], state["version"]
        self._compute_offset = state["compute_gpu_hours"]
        self.verifier_failures.load_state_dict(state["verifier_failures"])
        self.manager.load_state_dict(state["manager"])
        self.last_checkpoint_step = self.step if path is not None else None
        self._trainer_call(lambda: self.trainers.sync_weights(
            self.version, timeout_s=self.cfg.train.step_timeout_s))

    def _driver_state(self) -> dict:
        """The driver's part of a run checkpoint (run it on the rollout loop: one moment)."""
        return {"step": self.step, "version": self.version,
                "compute_gpu_hours": self.compute_gpu_hours,
                "verifier_failures": self.verifier_failures.state_dict(),
                "manager": self.manager.state_dict()}

    def _start_verifiers(self) -> None:
        from megatron_rl.rewards import MathVerifier, Sandbox, SandboxConfig, default_registry
        from megatron_rl.rewards.failures import VerifierFailureCounter

        self.math_verifier = MathVerifier()
        self._stack.callback(self.math_verifier.close)
        self.sandbox = Sandbox(SandboxConfig.from_run_config(self.cfg))
        self._stack.callback(self.sandbox.close)
        self.registry = default_registry(math_verifier=self.math_verifier, sandbox=self.sandbox)
        self.verifier_failures = VerifierFailureCounter.from_run_config(self.cfg)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _load_data(self) -> None:
        from megatron_rl.data.split import split_heldout
        from megatron_rl.data.tokenizer import prompt_token_ids

        cfg = self.cfg
        records = _load_records(cfg)
        self.registry.check(records)
        train, heldout = split_heldout(records, num_heldout=cfg.eval.num_heldout_prompts,
                                       seed=cfg.seed)
        self.train_records, self.heldout_records = train, heldout
        self.train_prompt_ids = [prompt_token_ids(self.tokenizer, r.prompt) for r in train]
        self.heldout_prompt_ids = [prompt_token_ids(self.tokenizer, r.prompt) for r in heldout]
        limit = cfg.rollout.max_prompt_tokens
        too_long = [r.prompt_id for r, ids in zip(records, self.train_prompt_ids
                                                  + self.heldout_prompt_ids) if len(ids) > limit]
        if too_long:
            raise ConfigError(f"rollout.max_prompt_tokens: {len(too_long)} prompt(s) are longer "
                              f"than {limit} tokens (e.g. {too_long[:3]}); raise it (and "
                              "train.micro_batch_max_tokens) or filter the prompt file")

    def _start_cluster(self) -> None:
        """Ray, one placement group, the trainer ranks starting from model.hf_checkpoint and the
        SGLang engines serving it (version 0), connected by the weight sync."""
        from megatron_rl.cluster import (ClusterLayout, ClusterSettings, GeneratorPool,
                                         RayCluster, TrainerGroup)
        from megatron_rl.rollout.sglang_server import is_moe_model

        cfg = self.cfg
        phases = _Phases()
        with phases("Ray"):
            self.ray = RayCluster.start(ClusterSettings(address=cfg.cluster.address,
                                                        num_cpus=cfg.cluster.num_cpus))
        self._stack.callback(self.ray.shutdown)
        layout = ClusterLayout.from_run_config(cfg, colocated=cfg.cluster.colocated)
        if layout.colocated and layout.device == "gpu" and \
                cfg.weight_sync.transport == "distributed":
            raise ConfigError("weight_sync.transport: colocated generators share the trainer "
                              "ranks' GPUs, and NCCL cannot hold two ranks of one group on one "
                              "GPU; set weight_sync.transport=tensor (in-memory hand-over)")
        self.layout = layout
        placement = self.ray.reserve(layout, name=cfg.name)
        self.placement = placement
        self.model_dir = model_dir = str(Path(cfg.model.hf_checkpoint).resolve())
        # Routing replay (docs/routing_replay.md): MoE models only, as the servers are started.
        self._routing_replay = cfg.rollout.routing_replay and is_moe_model(model_dir)
        with phases("trainer ranks"):
            if layout.colocated and layout.device == "gpu":  # servers need the ranks' GPU ids
                self.trainers = TrainerGroup.create(placement, cfg)
                self.generators = GeneratorPool.start(placement,
                                                      self._server_settings(model_dir))
            else:  # the servers load while the trainer ranks build
                self.generators = GeneratorPool.start(placement,
                                                      self._server_settings(model_dir))
                self.trainers = TrainerGroup.create(placement, cfg)
        with phases("start checkpoint"):
            self.trainers.call("load_model_weights", self._converted_start_checkpoint(model_dir))
        monitor = self.trainers.call("monitor_status")
        notice("trainer hang detection: " + (
            "nvidia-resiliency-ext rank monitor on every rank, and train.step_timeout_s"
            if monitor == "on" else f"train.step_timeout_s only (no rank monitor: {monitor})"))
        with phases("generators ready"):
            self.generators.wait_until_healthy()
        with phases("weight-sync connection"):
            self.trainers.connect_generators(self.generators.endpoints, hf_config_dir=model_dir)
        self.num_devices = layout.num_trainer_ranks if layout.colocated else \
            layout.num_trainer_ranks + layout.num_generators * layout.devices_per_generator
        self._write_processes()
        notice(f"cluster up in {phases.total:.1f} s ({phases}; the generators start while the "
               "trainer ranks build)")

    @property
    def generator_urls(self) -> list[str]:
        return self.generators.urls

    def _write_processes(self) -> None:
        """output_dir/processes.json: which process is which (for operators and chaos tests)."""
        info = {"driver": {"pid": os.getpid()},
                "generators": [{"name": e.name, "url": e.url, "pid": e.pid, "node": e.node_ip}
                               for e in self.generators.endpoints],
                "trainer_ranks": [{"rank": r, "pid": n.pid, "node": n.node_ip}
                                  for r, n in enumerate(self.trainers.nodes)]}
        tmp = self.out / "processes.json.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        tmp.replace(self.out / "processes.json")

    def _server_settings(self, model_dir: str) -> list:
        """One SGLang server's settings per generator; colocated ones get their trainer ranks'
        GPUs and SGLang's memory saver (GPU)."""
        from megatron_rl.rollout import SGLangServerSettings

        cfg, layout = self.cfg, self.layout
        settings = []
        for i in range(layout.num_generators):
            fields = {}
            if layout.colocated and layout.device == "gpu":
                nodes = [self.trainers.nodes[r] for r in layout.generator_trainer_ranks(i)]
                if len({n.node_id for n in nodes}) != 1:
                    raise ConfigError(
                        f"cluster.colocated: generator {i} would share the GPUs of trainer "
                        f"ranks on {len({n.node_id for n in nodes})} nodes; an SGLang engine "
                        "runs on one node: lower rollout.tp_size to the GPUs per node")
                fields = dict(enable_memory_saver=True,
                              visible_devices=tuple(g for n in nodes for g in n.gpu_ids))
            settings.append(SGLangServerSettings.from_rollout_config(
                cfg.rollout, model_dir, random_seed=cfg.seed + i,
                log_path=str((self.out / f"generator-{i}.log").resolve()), **fields))
        return settings

    def _converted_start_checkpoint(self, model_dir: str) -> str:
        """model.hf_checkpoint as a Megatron checkpoint (converted once per run directory)."""
        from megatron_rl.convert import convert_hf_to_megatron

        target = self.out / "start_checkpoint"
        if not (target / "metadata.json").is_file():
            convert_hf_to_megatron(model_dir, target, overwrite=True,
                                   progress=self.cfg.logging.progress_bar)
        return str(target.resolve())

    def _build_rollouts(self) -> None:
        from megatron_rl.algorithms import NoPositiveResamplingSampler
        from megatron_rl.rollout import SamplingParams
        from megatron_rl.rollout.async_client import AsyncSGLangClient
        from megatron_rl.rollout.interruption import InterruptionSettings
        from megatron_rl.rollout.manager import RolloutManager
        from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings

        cfg = self.cfg
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="rollouts",
                                             daemon=True)
        self._loop_thread.start()
        self._stack.callback(self._stop_loop)
        self.clients = [AsyncSGLangClient(url, return_routed_experts=self._routing_replay)
                        for url in self.generator_urls]
        self.gate = AdmissionGate(StalenessSettings.from_run_config(cfg))
        self.sampler = NoPositiveResamplingSampler(
            len(self.train_records), threshold=cfg.algorithm.npr_threshold, seed=cfg.seed,
            enabled=cfg.algorithm.no_positive_resampling)
        self.interruption = InterruptionSettings.from_rollout_config(cfg.rollout, self.encode)
        self.manager = RolloutManager(
            clients=self.clients, prompt_token_ids=self.train_prompt_ids,
            records=self.train_records, sampler=self.sampler, gate=self.gate,
            params=SamplingParams.for_training(cfg.rollout, max_new_tokens=1, seed=cfg.seed),
            interruption=self.interruption, score=self.registry.score_many,
            decode=self.tokenizer.decode,
            max_finished_groups=self.gate.settings.max_outstanding_groups, seed=cfg.seed)

    def _start_rollouts(self) -> None:
        self._call(self._async(self.manager.start))
        self._stack.callback(lambda: self._call(self.manager.stop()))

    @staticmethod
    async def _async(fn):
        return fn()

    def _call(self, coroutine, timeout: float | None = None):
        """Run a coroutine on the rollout loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def _stop_loop(self) -> None:
        for client in self.clients:
            self._call(client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=30)

    # ------------------------------------------------------------------ the loop's steps

    def progress(self, steps: Iterable[int]):
        from tqdm import tqdm

        self._compute_start = time.perf_counter()
        self._window = (self._compute_start, self._activity(), 0.0)
        if self.step == 0:  # a trainer failure before the first checkpoint restores this
            self._initial = (self._call(self._async(self._driver_state)),
                             self._restored_files(self.out))
        self._progress = tqdm(steps, desc=self.cfg.name, unit="step",
                              disable=not self.cfg.logging.progress_bar)
        return self._progress

    @property
    def compute_gpu_hours(self) -> float:
        if self._compute_start is None:
            return self._compute_offset
        return self._compute_offset + (time.perf_counter() - self._compute_start) / 3600 \
            * self.num_devices

    def take_groups(self, num_groups: int) -> list:
        """The step's groups; while waiting, the generators are health-checked and any that
        failed is restarted (the others keep generating)."""
        started = time.perf_counter()
        groups = self._wait_checking_health(self.manager.take(num_groups))
        self._wait_s = time.perf_counter() - started
        return groups

    def _wait_checking_health(self, coroutine):
        """Run a coroutine on the rollout loop; while it runs, failed generators are restarted
        and failed reward workers recorded."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            while True:
                try:
                    return future.result(timeout=1.0)
                except TimeoutError:
                    self.record_reward_faults()
                    self.check_generators()
        except BaseException:
            future.cancel()  # the run is stopping: nothing waits for the result
            raise

    def record_ledger(self, step: int, groups: Sequence) -> None:
        discarded = self._call(self._async(self.manager.take_discarded))
        ledger.record_step(self.out, step=step, version=self.version,
                           trained=[(g.group_id, g.prompt_index) for g in groups],
                           discarded=discarded, digest=ledger.groups_digest(groups))

    def record_reward_faults(self) -> None:
        """faults.jsonl records of the math workers that died or hung and were replaced; their
        samples were graded again already (MathVerifier), so nothing is redone."""
        for fault in self.math_verifier.take_faults():
            ledger.record_fault(self.out, **fault, requeued_groups=0, steps_lost=0)
            notice(f"reward worker: {fault['what']}; its samples are scored again by a fresh "
                   "worker")

    # ------------------------------------------------------------------ generator failures

    def check_generators(self, *, now: bool = False, strikes: int = _HEALTH_STRIKES) -> None:
        """Health-check every generator (every rollout.health_check_interval_s, or `now`),
        take the ones failing `strikes` checks in a row (or a request) out of the rotation and
        restart them."""
        interval = self.cfg.rollout.health_check_interval_s
        if now or time.monotonic() - self._last_health_check >= interval:
            self._last_health_check = time.monotonic()
            up = set(range(len(self.clients))) - self._call(self._async(
                lambda: self.manager.down))
            unhealthy = self.generators.unhealthy(timeout_s=30.0)
            for index in up:
                self._health_strikes[index] = self._health_strikes.get(index, 0) + 1 \
                    if index in unhealthy else 0
                if self._health_strikes[index] >= strikes:  # a busy engine may miss one
                    self._health_strikes[index] = 0
                    self._call(self._async(lambda i=index, r=str(unhealthy[index]):
                                           self.manager.mark_down(i, r)))
        failures = self._call(self._async(self.manager.take_failures))
        self._failures += failures
        down = self._call(self._async(lambda: self.manager.down)) - self._given_up
        for index in sorted(down):
            self._restart_generator(index)
        if len(self._given_up) == len(self.clients):
            raise RunStopped("every generator failed and could not be restarted "
                             f"(rollout.max_generator_restarts={self.cfg.rollout.max_generator_restarts}); "
                             "see the generator logs in output_dir")

    def _restart_generator(self, index: int) -> None:
        """Restart generator `index`, bring it to the current weights and version over a group
        of its own, and put it back in the rotation; bounded attempts with backoff."""
        from megatron_rl.rollout.async_client import AsyncSGLangClient

        failure = next((f for f in self._failures if f.index == index), None)
        name = self.generators.names[index]
        fault = dict(kind="generator", what=failure.reason if failure else name,
                     detected_at=failure.detected_at if failure else time.time(),
                     requeued_groups=failure.requeued_groups if failure else 0, steps_lost=0)
        limit = self.cfg.rollout.max_generator_restarts
        if time.monotonic() - self._restarted_at.get(index, -math.inf) > _STABLE_S:
            self._generator_restarts[index] = 0  # it served a while: a new failure, not a loop
        while True:
            attempt = self._generator_restarts.get(index, 0)
            if attempt >= limit:
                self._given_up.add(index)
                notice(f"generator {name!r}: given up after {attempt} restart(s) that did not "
                       f"last {_STABLE_S:.0f} s; the run goes on with the others")
                ledger.record_fault(self.out, recovered=False, **fault)
                return
            notice(f"generator {name!r} failed ({fault['what'].splitlines()[0][:200]}); "
                   f"restarting it (attempt {attempt + 1} of {limit})")
            self._generator_restarts[index] = attempt + 1
            try:
                endpoint = self.generators.restart(index, timeout_s=self.cfg.train.step_timeout_s)
                self._trainer_call(lambda: self.trainers.sync_new_generators(
                    [endpoint], self.model_dir, self.version))
                break
            except TrainerFailure:
                raise
            except Exception as exc:  # noqa: BLE001 (retried with backoff, then given up)
                notice(f"generator {name!r}: restart failed: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:300]}")
                time.sleep(min(60.0, 2.0 * 2 ** attempt))
        self._restarted_at[index] = time.monotonic()
        client = AsyncSGLangClient(endpoint.url, return_routed_experts=self._routing_replay)
        old, self.clients[index] = self.clients[index], client
        self._call(old.close())
        self._call(self._async(lambda: self.manager.mark_up(index, client)))
        self._write_processes()
        if failure is not None:
            self._failures.remove(failure)
        ledger.record_fault(self.out, **fault)
        notice(f"generator {name!r} is back at {endpoint.url} with policy version "
               f"{self.version}")

    # ------------------------------------------------------------------ trainer failures

    def _trainer_call(self, call):
        """Run a call on the trainer group; a rank that died (Ray actor death) or hung (no
        answer within train.step_timeout_s) raises TrainerFailure."""
        import ray

        try:
            return call()
        except (ray.exceptions.RayActorError, TimeoutError) as exc:
            raise TrainerFailure(f"{type(exc).__name__}: {str(exc).splitlines()[0][:500]}") \
                from exc

    def recover_trainers(self, failure: TrainerFailure) -> None:
        """Restart the trainer group and restore the run from its last checkpoint (the start
        of the run if there is none): the steps since are redone. The generators keep their
        engines and receive the restored weights. Bounded by train.max_trainer_restarts."""
        from megatron_rl.cluster import TrainerGroup

        detected = time.time()
        failed_step = self.step + 1
        self._trainer_restarts += 1
        limit = self.cfg.train.max_trainer_restarts
        if self._trainer_restarts > limit:
            raise RunStopped(f"the trainer failed at step {failed_step} ({failure}) and has "
                             f"been restarted {limit} time(s) already "
                             "(train.max_trainer_restarts); resume with --resume once the "
                             "cause is fixed") from failure
        notice(f"trainer failed at step {failed_step}: {failure}; restarting the trainer ranks "
               f"(attempt {self._trainer_restarts} of {limit})")
        self.trainers.shutdown(timeout_s=10.0)
        self._pending_checkpoint = None  # its shards died with their writer: left partial
        self.trainers = TrainerGroup.create(self.placement, self.cfg)
        self.trainers.connect_generators(self.generators.endpoints, hf_config_dir=self.model_dir)
        self._call(self.manager.stop())
        path = run_checkpoint.latest_valid(self.checkpoint_root, warn=notice)
        if path is not None:
            state, files = self._read_run_state(path), self._restored_files(path)
        elif self._initial is not None:
            state, files = self._initial
        else:
            raise RunStopped(f"the trainer failed at step {failed_step} ({failure}) before the "
                             "run had a restore point") from failure
        self._put_back_files(files)
        self._open_logs(purge_after=state["step"])
        self._restore(path, state)
        self._call(self._async(self.manager.start))
        self._write_processes()
        ledger.record_fault(self.out, kind="trainer", what=str(failure), detected_at=detected,
                            restored_step=self.step, steps_lost=failed_step - 1 - self.step)
        notice(f"trainer restored to step {self.step} "
               f"({path.name if path is not None else 'the start of the run'}); "
               f"{failed_step - 1 - self.step} step(s) are redone")

    def rewards_of(self, groups: Sequence):
        """[prompts, G] rewards, NaN for samples whose verifier failed; counts the failures
        and stops the run past algorithm.max_verifier_failure_fraction."""
        import torch

        from megatron_rl.rewards.failures import reward_values

        group_size = self.cfg.rollout.samples_per_prompt
        results = [r for g in groups for r in g.results]
        self.verifier_failures.update(results, group_size)
        return torch.tensor(reward_values(results), dtype=torch.float32).view(-1, group_size)

    def rollout_metrics(self, groups: Sequence, rewards, keep) -> dict[str, float]:
        from megatron_rl.rollout.staleness import staleness_histogram

        samples = [s for g in groups for s in g.samples]
        lengths = sorted(len(s.token_ids) for s in samples)
        passed = [r.passed for g in groups for r in g.results if not r.verifier_failed]
        versions = [v for s in samples for v in s.sampled_versions]
        metrics = {
            "rollout/reward_mean": float(rewards[~rewards.isnan()].mean()) if passed else math.nan,
            "rollout/pass_rate": sum(passed) / len(passed) if passed else math.nan,
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_p99": float(lengths[min(len(lengths) - 1,
                                                             int(0.99 * len(lengths)))]),
            "rollout/truncation_rate": sum(s.truncated for s in samples) / len(samples),
            "rollout/interruption_rate": sum(s.interrupted for s in samples) / len(samples),
            "rollout/zero_variance_fraction": 1.0 - float(keep.float().mean()),
            "rollout/npr_retired_prompts": float(self.sampler.num_retired),
            "perf/trainer_wait_seconds": self._wait_s,
        }
        if versions:
            metrics |= staleness_histogram(
                versions, trainer_version=self.version,
                max_off_policyness=self.cfg.rollout.max_off_policyness).to_scalars()
        metrics |= self.gate.to_scalars()
        metrics |= self.verifier_failures.metrics()
        return metrics

    def train_step(self, batch) -> dict[str, float]:
        release_s = self._release_generators() if self.layout.colocated else 0.0
        started = time.perf_counter()
        step = self._trainer_call(lambda: self.trainers.train_step(
            batch, timeout_s=self.cfg.train.step_timeout_s))
        seconds = time.perf_counter() - started
        return {"train/loss": step.loss, "train/grad_norm": step.grad_norm,
                "train/entropy": step.entropy, "train/is_clip_fraction": step.clip_fraction,
                "train/mean_ratio": step.mean_ratio,
                "train/logp_mismatch_mean": step.logp_mismatch,
                "train/logp_mismatch_max": step.logp_mismatch_max,
                "train/learning_rate": step.learning_rate, "train/skipped": float(step.skipped),
                "train/routing_flip_fraction": step.routing_flip_fraction,
                "train/logp_mismatch_without_replay": step.logp_mismatch_without_replay,
                "perf/train_seconds": seconds,
                "perf/train_tokens_per_s": step.num_tokens / max(seconds, 1e-9)} | (
                    {"colocated/release_seconds": release_s} if self.layout.colocated else {})

    def _release_generators(self) -> float:
        """Colocated: free the engines' memory for the training phase, once nothing generates
        (SGLang requires an idle engine; the synchronous schedules RunConfig requires admit
        nothing new before the next version, and under ppo_off_policy this waits for the rest
        of the round's groups)."""
        from megatron_rl.rollout import SGLangGenerator

        started = time.perf_counter()
        self._call(self.manager.wait_until_idle())
        for url in self.generator_urls:
            SGLangGenerator(url).release_memory()
        self._released = True
        return time.perf_counter() - started

    def _resume_generators(self, tags) -> None:
        from megatron_rl.rollout import SGLangGenerator

        for url in self.generator_urls:
            SGLangGenerator(url).resume_memory(tags)

    def push_weights(self) -> dict[str, float]:
        """Sync the new weights into the generators in flight and publish the version."""
        from megatron_rl.rollout import SGLangGenerator

        if self._released:  # colocated: the weights' memory back, to load into
            self._resume_generators(SGLangGenerator.MEMORY_WEIGHTS)
        from megatron_rl.weight_sync import WeightSyncError

        self.check_generators(now=True)  # a dead generator is restarted before, not during
        before = self._activity()
        try:
            report = self._trainer_call(lambda: self.trainers.sync_weights(
                timeout_s=self.cfg.train.step_timeout_s))
        except WeightSyncError as exc:  # a generator failed during the sync: restart, retry
            notice(f"{str(exc).splitlines()[0][:300]}; checking the generators and retrying")
            self.check_generators(now=True, strikes=1)  # a failed sync is the first strike
            report = self._trainer_call(lambda: self.trainers.sync_weights(
                timeout_s=self.cfg.train.step_timeout_s))
        after = self._activity()
        if self._released:
            self._resume_generators(SGLangGenerator.MEMORY_AFTER_WEIGHTS)
            self._released = False
        # Requests in flight while the generators were paused made no progress: that time is
        # not busy (a generator with nothing in flight lost nothing to the pause).
        self._paused_busy_s += sum(min(report.paused_s, (a - b).busy_s)
                                   for a, b in zip(after, before))
        self.version = report.version
        self.step += 1
        self._call(self._async(lambda: self.manager.publish_version(self.version)))
        return report.metrics()

    def _activity(self) -> list:
        return [client.activity() for client in self.clients]

    def _window_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Generator and trainer utilisation since the previous step's log."""
        now, activity = time.perf_counter(), self._activity()
        started, before, paused_busy = self._window
        self._window = (now, activity, self._paused_busy_s)
        wall = max(now - started, 1e-9)
        busy = sum((a - b).busy_s for a, b in zip(activity, before)) \
            - (self._paused_busy_s - paused_busy)
        out = {"perf/generator_busy_fraction": max(busy, 0.0) / (wall * len(activity)),
               "perf/generation_tokens_per_s":
                   sum((a - b).tokens for a, b in zip(activity, before)) / wall,
               # requests resent after a broken connection, whole run (async_client.py)
               "rollout/reconnects": float(sum(client.reconnects for client in self.clients))}
        step_s = metrics.get("perf/step_seconds")
        if step_s:
            out["perf/trainer_idle_fraction"] = metrics.get("perf/trainer_wait_seconds",
                                                            0.0) / step_s
            out["weight_sync/step_fraction"] = metrics.get("weight_sync/seconds", 0.0) / step_s
        return out

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = metrics | self._window_metrics(metrics)
        if step % self.cfg.logging.log_interval == 0:
            for tag, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        self._progress.set_postfix(
            reward=f"{metrics.get('rollout/reward_mean', math.nan):.2f}",
            gen_busy=f"{metrics['perf/generator_busy_fraction']:.2f}",
            trainer_idle=f"{metrics.get('perf/trainer_idle_fraction', math.nan):.2f}",
            version=self.version)

    def validate(self, step: int) -> None:
        """mean@k per task on the held-out prompts with the current weights -> scaling log."""
        from megatron_rl.validation import (log_validation, score_samples, validation_metrics,
                                            write_validation_samples)

        k = self.cfg.eval.samples_per_prompt
        completions = self._wait_checking_health(self._generate_heldout(k))
        texts = [[self.tokenizer.decode(s.token_ids) for s in group] for group in completions]
        scored = score_samples(self.registry, self.heldout_records, texts)
        write_validation_samples(self.out / "validation_samples" / f"step_{step:06d}.jsonl",
                                 step, self.heldout_records, texts, scored)
        metrics = validation_metrics(scored, samples_per_prompt=k)
        log_validation(self.scaling_log, step, self.compute_gpu_hours, metrics,
                       tb_writer=self.writer)

    async def _generate_heldout(self, k: int) -> list:
        import random

        from megatron_rl.rollout import SamplingParams
        from megatron_rl.rollout.interruption import bind_generate, generate_completion

        params = SamplingParams(max_new_tokens=1, temperature=self.cfg.rollout.temperature,
                                seed=self.cfg.seed, purpose="eval")

        def one(index: int, prompt: Sequence[int], sample: int):
            # Each sample its own seed (SamplingParams.seed), the same at every validation: the
            # curve's points differ by the policy, not by the sampling noise. So a sample whose
            # generator fails midway is generated again, the same, on another.
            def request(client):
                generate_one = bind_generate(client, params.for_sample("eval", index, sample),
                                             extra_key=f"v{self.version}")
                return generate_completion(
                    generate_one, prompt, settings=self.interruption,
                    rng=random.Random(f"eval/{index}/{sample}"), group_id=index,
                    sample_index=sample)

            return self.manager.run_anywhere(index, request)

        groups = [[one(i, prompt, j) for j in range(k)]
                  for i, prompt in enumerate(self.heldout_prompt_ids)]
        flat = await asyncio.gather(*(c for group in groups for c in group))
        return [flat[i * k:(i + 1) * k] for i in range(len(groups))]

    def save_checkpoint(self, step: int, *, wait: bool = False) -> None:
        """A run checkpoint of the state after `step` (megatron_rl/resilience/checkpoint.py):
        written under a partial name, committed with its manifest, older ones pruned. Under an
        asynchronous trainer save (checkpoint.async_save) the commit waits for the shards'
        writer: `commit_checkpoint` after each step, or at once with `wait`."""
        from megatron_rl.config import save_config

        self.commit_checkpoint(blocking=True)  # the previous one first: commits stay in order
        root = self.checkpoint_root
        root.mkdir(parents=True, exist_ok=True)
        staging = run_checkpoint.partial_path(root, step)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        started = time.perf_counter()
        asynchronous = self._trainer_call(lambda: self.trainers.save_checkpoint(
            str(staging / run_checkpoint.TRAINER_DIR), {"step": step, "version": self.version},
            async_save=self.cfg.checkpoint.async_save))
        self._checkpoint_blocked_s = time.perf_counter() - started
        if self.cfg.checkpoint.async_save == "auto" and not asynchronous \
                and not self._async_save_explained:
            from megatron_rl.trainer.checkpoint import async_save_unavailable

            self._async_save_explained = True
            notice(f"checkpoint.async_save=auto: saving synchronously "
                   f"({async_save_unavailable() or 'not available on the trainer ranks'})")
        state = self._call(self._async(self._driver_state))
        with open(staging / run_checkpoint.RUN_STATE, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        for name in _RESTORED_FILES:
            if (self.out / name).is_file():
                shutil.copyfile(self.out / name, staging / name)
        save_config(self.cfg, str(staging / "config.yaml"))
        self._pending_checkpoint = (staging, step, asynchronous)
        if wait or not asynchronous:
            self.commit_checkpoint(blocking=True)

    def commit_checkpoint(self, *, blocking: bool) -> None:
        """Commit the checkpoint `save_checkpoint` staged once its trainer shards are complete
        (an asynchronous save may still be writing them; `blocking` waits). Until then the
        previous checkpoint is the newest valid one."""
        if self._pending_checkpoint is None:
            return
        staging, step, asynchronous = self._pending_checkpoint
        if asynchronous:
            started = time.perf_counter()
            done = self._trainer_call(lambda: self.trainers.finalize_checkpoints(
                blocking=blocking))
            self._checkpoint_blocked_s += time.perf_counter() - started
            if not done:
                return
        self._pending_checkpoint = None
        if faults.planned("kill_in_checkpoint", step):
            faults.kill_self()
        root = self.checkpoint_root
        run_checkpoint.commit(staging, run_checkpoint.checkpoint_path(root, step), step=step)
        run_checkpoint.prune(root, self.cfg.checkpoint.keep_last)
        self.last_checkpoint_step = step
        self.writer.add_scalar("perf/checkpoint_blocked_seconds", self._checkpoint_blocked_s, step)

    def finish(self) -> None:
        """After the last step (or a graceful stop): close the progress bar and end the ledger
        with the groups still outstanding (fit the run's curve with `megatron-rl fit
        output_dir`)."""
        self.commit_checkpoint(blocking=True)
        self.record_reward_faults()
        self._progress.close()
        next_id, outstanding = self._call(self._async(
            lambda: (self.manager.next_group_id, self.manager.outstanding_group_ids())))
        ledger.record_end(self.out, next_group_id=next_id, outstanding=outstanding)


def length_penalties(groups: Sequence, algorithm):
    """DAPO's overlong penalty per sample [prompts x G, flat] for algorithm.length_penalty:
    generated tokens (the forced-interruption phrase excluded, SCALERL.md section 5) against
    length_penalty_max_length / _cache_length, on correct answers only; 0 elsewhere."""
    from megatron_rl.algorithms import length_penalty

    lengths = [sample.num_loss_tokens for group in groups for sample in group.samples]
    passed = [result.passed for group in groups for result in group.results]
    return length_penalty(lengths, passed, max_length=algorithm.length_penalty_max_length,
                          cache_length=algorithm.length_penalty_cache_length)
