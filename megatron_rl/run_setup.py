"""What a training run starts and stops (megatron_rl/train.py drives it): the prompts and their
held-out split, the verifiers and the environments (the multi-turn rollout when a prompt's
environment is multi-turn), the cluster (cluster/launch.py), the rollout manager on its own
event loop, and the outputs. `RunSetup.start(cfg)` brings everything up in order (data errors are
found before anything is written to output_dir) and the context exit tears it down in reverse,
also after an error, so no SGLang server, Ray worker or verifier process outlives the run.

While an error unwinds the run (a lost node, say), a failure of the teardown is reported in one
line and never replaces it; a start that fails because a node of the run was lost stops with
NodeLost (cluster/launch.py).

Each concern the driver calls has a room of its own, which RunSetup connects: generator health,
reward-worker faults and trainer failures in resilience/recovery.py; run checkpoints in
resilience/run_checkpoints.py; pushing weights (and colocated release / resume) in
cluster/weights.py; step metrics, logs and the compute axis in metrics.py; validation in
validation.py. The restore of a checkpoint (resume, or after a trainer failure) is here: it
touches all of them.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from megatron_rl.config import ConfigError, RunConfig, save_config
from megatron_rl.console import notice
from megatron_rl.resilience import checkpoint as run_checkpoint
from megatron_rl.resilience import ledger
from megatron_rl.resilience.recovery import RunStopped, TrainerFailure, trainer_call
from megatron_rl.resilience.run_checkpoints import (put_back_files, read_run_state,
                                                    restored_files, resume_point, start_branch)


class RunSetup:
    def __init__(self, cfg: RunConfig, backend=None):
        from megatron_rl.cluster.backend import RayBackend

        self.cfg = cfg
        # What the cluster runs on (cluster/backend.py): the real one unless `megatron-rl
        # simulate` or a scale test hands in the simulated one; nothing below asks which.
        self.backend = backend if backend is not None else RayBackend()
        self.step = self.version = 0  # optimizer steps done; the generators' policy version
        self._stack = contextlib.ExitStack()
        self._initial: tuple[dict, dict[str, bytes]] | None = None  # restore point, step 0
        self._wait_s = 0.0  # the last take_groups' wait

    # ------------------------------------------------------------------ start / stop

    @classmethod
    def start(cls, cfg: RunConfig, backend=None) -> "RunSetup":
        run = cls(cfg, backend)
        try:
            run._start()
        except Exception as failure:
            cluster = getattr(run, "cluster", None)
            try:  # a lost node stops the run as such, whatever step of the start it broke
                if cluster is not None and not isinstance(failure, RunStopped):
                    cluster.stop_if_node_lost(cfg, failure)
            except RunStopped as lost:
                run._tear_down(lost)
                raise
            run._tear_down(failure)
            raise
        except BaseException as stopped:
            run._tear_down(stopped)
            raise
        return run

    def __enter__(self) -> "RunSetup":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._tear_down(exc)

    def _tear_down(self, unwinding: BaseException | None) -> None:
        """Stop everything started, newest first. While `unwinding` (the error that ends the
        run) propagates, a teardown failure is one line on the console, not a replacement for
        it: a lost node's engines cannot confirm their stop, which must not turn a NodeLost
        (exit status 75) into a traceback."""
        if unwinding is None:
            self._stack.close()
            return
        try:
            self._stack.close()
        except Exception as failure:  # noqa: BLE001 (reported; the unwinding error stands)
            detail = " ".join(str(failure).split())[:500]
            notice(f"stopping the run's processes after {type(unwinding).__name__}: "
                   f"{type(failure).__name__}: {detail}")

    def _start(self) -> None:
        from transformers import AutoTokenizer

        from megatron_rl.metrics import RunMetrics

        cfg = self.cfg
        if cfg.model.hf_checkpoint is None:
            raise ConfigError("model.hf_checkpoint: megatron-rl train needs the HF checkpoint "
                              "the generators serve and the trainer starts from; convert or "
                              "create one (tools/, docs/convert.md)")
        self.out = Path(cfg.output_dir).resolve()  # Ray actors need absolute paths
        self.checkpoint_root = Path(cfg.checkpoint_dir).resolve()
        resume = resume_point(cfg, self.out, self.checkpoint_root)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        self._load_data()
        self._reserve_open_files()
        self.out.mkdir(parents=True, exist_ok=True)  # the inputs are good: outputs from here
        save_config(cfg, str(self.out / "config.yaml"))
        state = read_run_state(resume) if resume is not None else None
        if resume is not None:
            start_branch(cfg, self.checkpoint_root, state["step"])
            put_back_files(self.out, restored_files(resume))
        self.cluster = self.backend.start(cfg, self.out, self._stack,
                                          start_checkpoint=self._start_checkpoint)
        self.clients: list = []  # one HTTP client per engine, shared by the rooms below
        self.metrics = RunMetrics(cfg, self.out, clients=self.clients,
                                  num_devices=self.cluster.num_devices)
        self.metrics.open_logs(purge_after=state["step"] if state else None)
        self._stack.callback(self.metrics.close)
        self._build_rollouts()
        if resume is not None:
            self._restore(resume, state)
            notice(f"resumed from {resume} (step {self.step}, policy version {self.version})")
        self.metrics.start_clock()  # the generators start on the training groups
        self.loop.run(self.manager.start)
        self._stack.callback(lambda: self.loop.call(self.manager.stop()))

    def _load_data(self) -> None:
        """The verifiers and the environments, then the prompts (checked against them, and the
        model's context), then the multi-turn rollout if a prompt's environment is multi-turn."""
        from megatron_rl.data.run_prompts import load_run_prompts
        from megatron_rl.rewards.failures import VerifierFailureCounter
        from megatron_rl.rewards.registry import start_run_verifiers

        self.math_verifier, self.sandbox, self.registry = start_run_verifiers(self.cfg,
                                                                             self._stack)
        self.verifier_failures = VerifierFailureCounter.from_run_config(self.cfg)
        self.environments = self._environments(self.sandbox)
        self.data = load_run_prompts(self.cfg, self.tokenizer, self.registry, self.environments)
        self.multi_turn = self._multi_turn()

    def _environments(self, sandbox):
        """The environments of the run's tasks: the verifiers (single-turn), the Python tool
        environment ("tool/<task>", calls run in `sandbox`) and environment.modules' own."""
        from megatron_rl.environments import (ToolSettings, default_environments,
                                              load_environment_modules)

        env = self.cfg.environment
        tools = ToolSettings(call_open=env.tool_call_open, call_close=env.tool_call_close,
                             wall_time_s=env.tool_wall_time_s,
                             max_output_chars=env.tool_max_output_chars,
                             system_prompt=env.tool_system_prompt)
        environments = default_environments(self.registry, sandbox, tool_settings=tools)
        try:
            load_environment_modules(environments, env.modules, sandbox=sandbox,
                                     reward_registry=self.registry, tokenizer=self.tokenizer,
                                     cfg=self.cfg)
        except ValueError as exc:  # a module that does not import or register
            raise ConfigError(f"environment.modules: {exc}") from None
        return environments

    def _multi_turn(self):
        """The multi-turn rollout (rollout/multi_turn.py) when a prompt's environment is
        multi-turn, None otherwise (the single-turn loop, exactly as before environments).
        Each environment's stop texts become stop token ids here, at start: one that is not a
        single token of the tokenizer is a ConfigError before anything runs."""
        from megatron_rl.environments import stop_token_ids, turn_format_for
        from megatron_rl.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings

        cfg, data = self.cfg, self.data
        records = [*data.train_records, *data.heldout_records]
        if not self.environments.any_multi_turn(records):
            return None
        end_of_turn = end_of_turn_ids(self.tokenizer, cfg.model.hf_checkpoint)
        # One per environment object, by identity: a user's environment need not be hashable.
        known: dict[int, MultiTurnSettings] = {}

        def settings_for(environment) -> MultiTurnSettings:
            if id(environment) not in known:
                try:
                    stops = stop_token_ids(self.tokenizer, environment.stop_texts)
                except ValueError as exc:
                    raise ConfigError(f"{type(environment).__name__} stop texts: {exc}") \
                        from None
                known[id(environment)] = MultiTurnSettings(
                    max_turns=cfg.environment.max_turns,
                    max_trajectory_tokens=cfg.max_trajectory_tokens, turn_stop_ids=stops,
                    end_of_turn_ids=end_of_turn, step_timeout_s=cfg.environment.step_timeout_s)
            return known[id(environment)]

        for task in {record.task for record in records}:  # stop texts checked now, not mid-run
            environment = self.environments.for_task(task)
            if environment.multi_turn:
                settings_for(environment)
        return MultiTurnRollout(
            environments=lambda record: self.environments.for_task(record.task),
            turn_format=turn_format_for(self.tokenizer, cfg.environment.observation_template),
            settings_for=settings_for, decode=self.tokenizer.decode)

    def _reserve_open_files(self) -> None:
        """A socket per request in flight (the engines hold the queue, async_client.py): the
        training groups the staleness bound admits and a validation's requests, at once; and
        the code sandbox's pipes with every worker busy (code rewards and tool calls: one
        worker per CPU by default, 16 pipe ends a run, 2,304 on a 144-CPU host)."""
        from megatron_rl.rollout.async_client import reserve_open_files
        from megatron_rl.rollout.staleness import StalenessSettings

        cfg = self.cfg
        reserve_open_files(StalenessSettings.from_run_config(cfg).max_outstanding_groups
                           * cfg.rollout.samples_per_prompt
                           + len(self.data.heldout_records) * cfg.eval.samples_per_prompt,
                           sandbox_files=self.sandbox.max_open_files())

    def _start_checkpoint(self, model_dir: str) -> str:
        """model.hf_checkpoint as a Megatron checkpoint (converted once per run directory)."""
        from megatron_rl.convert import converted_once

        return converted_once(model_dir, self.out / "start_checkpoint",
                              progress=self.cfg.logging.progress_bar)

    def _build_rollouts(self) -> None:
        """The rollout manager on its event loop, and the rooms that act on it."""
        from megatron_rl.algorithms import NoPositiveResamplingSampler
        from megatron_rl.cluster.weights import WeightPusher
        from megatron_rl.resilience.recovery import GeneratorHealth, TrainerRestarts
        from megatron_rl.resilience.run_checkpoints import RunCheckpoints
        from megatron_rl.rollout import SamplingParams
        from megatron_rl.rollout.event_loop import RolloutLoop
        from megatron_rl.rollout.interruption import InterruptionSettings
        from megatron_rl.rollout.manager import RolloutManager
        from megatron_rl.rollout.staleness import AdmissionGate, StalenessSettings
        from megatron_rl.validation import HeldoutValidation

        cfg, cluster = self.cfg, self.cluster
        self.loop = RolloutLoop()
        self._stack.callback(self.loop.stop, closing=self.clients)
        self.clients += [self._new_client(url) for url in cluster.generators.urls]
        self.gate = AdmissionGate(StalenessSettings.from_run_config(cfg))
        self.sampler = NoPositiveResamplingSampler(
            len(self.data.train_records), threshold=cfg.algorithm.npr_threshold, seed=cfg.seed,
            enabled=cfg.algorithm.no_positive_resampling)
        interruption = InterruptionSettings.from_rollout_config(
            cfg.rollout, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            decode=self.tokenizer.decode)
        self.manager = RolloutManager(
            clients=self.clients, prompt_token_ids=self.data.train_prompt_ids,
            records=self.data.train_records, sampler=self.sampler, gate=self.gate,
            params=SamplingParams.for_training(cfg.rollout, max_new_tokens=1, seed=cfg.seed),
            interruption=interruption, score=self.registry.score_many,
            decode=self.tokenizer.decode,
            max_finished_groups=self.gate.settings.max_outstanding_groups, seed=cfg.seed,
            multi_turn=self.multi_turn)
        self.health = GeneratorHealth(
            cfg, self.out, cluster=cluster, loop=self.loop, manager=self.manager,
            clients=self.clients, math_verifier=self.math_verifier, version=lambda: self.version,
            new_client=self._new_client, on_restarted=lambda: cluster.write_processes(self.out))
        self.weights = WeightPusher(cfg, loop=self.loop, manager=self.manager,
                                    urls=lambda: cluster.generators.urls, clients=self.clients,
                                    colocated=cluster.layout.colocated, api_key=cluster.api_key,
                                    wait=self.health.wait)
        self.checkpoints = RunCheckpoints(
            cfg, self.out, self.checkpoint_root, trainers=lambda: cluster.trainers,
            trainer_call=trainer_call, driver_state=lambda: self.loop.run(self._driver_state),
            writer=lambda: self.metrics.writer)
        self.trainer_restarts = TrainerRestarts(cfg, self.out)
        self.validation = HeldoutValidation(
            cfg, self.out, tokenizer=self.tokenizer, registry=self.registry,
            records=self.data.heldout_records, prompt_ids=self.data.heldout_prompt_ids,
            manager=self.manager, interruption=interruption, wait=self.health.wait,
            multi_turn=self.multi_turn)

    def _new_client(self, url: str):
        from megatron_rl.rollout.async_client import AsyncSGLangClient

        return AsyncSGLangClient(url, api_key=self.cluster.api_key,
                                 return_routed_experts=self.cluster.routing_replay)

    # ------------------------------------------------------------------ restore

    def _restore(self, path: Path | None, state: dict, *, in_run: bool = False) -> None:
        """Trainer, driver and rollout state as of a checkpoint (None: the start of the run),
        the generators at its weights and version; the manager must not be running. The compute
        axis goes on through an in-run restore (metrics.py); a resume starts at the checkpoint's."""
        trainers = self.cluster.trainers
        if path is None:
            trainer_call(lambda: trainers.call(
                "load_model_weights", self._start_checkpoint(self.cluster.model_dir)))
        else:
            trainer_call(lambda: trainers.load_checkpoint(str(path / run_checkpoint.TRAINER_DIR)))
        self.step, self.version = state["step"], state["version"]
        if not in_run:
            self.metrics.resume_compute(state["compute_gpu_hours"])
        self.verifier_failures.load_state_dict(state["verifier_failures"])
        self.manager.load_state_dict(state["manager"])
        self.checkpoints.last_step = self.step if path is not None else None
        trainer_call(lambda: trainers.sync_weights(self.version))  # weight_sync.sync_timeout_s

    def _driver_state(self) -> dict:
        """The driver's part of a run checkpoint (run it on the rollout loop: one moment)."""
        return {"step": self.step, "version": self.version,
                "compute_gpu_hours": self.metrics.compute_gpu_hours,
                "verifier_failures": self.verifier_failures.state_dict(),
                "manager": self.manager.state_dict()}

    def recover_trainers(self, failure: TrainerFailure) -> None:
        """Restart the trainer group and restore the run from its last checkpoint (the start
        of the run if there is none): the steps since are redone. The generators keep their
        engines and receive the restored weights. Bounded by train.max_trainer_restarts."""
        failed_step = self.step + 1
        detected = self.trainer_restarts.begin(  # a lost node first: it is no restart
            failure, failed_step=failed_step,
            stop_if_node_lost=lambda: self.cluster.stop_if_trainer_node_lost(self.cfg))
        self.cluster.restart_trainers(self.cfg)
        self.checkpoints.abandon_pending()  # its shards died with their writer: left partial
        self.loop.call(self.manager.stop())
        point = self.checkpoints.restore_point(self._initial)
        if point is None:
            raise RunStopped(f"the trainer failed at step {failed_step} ({failure}) before the "
                             "run had a restore point") from failure
        path, state, files = point
        put_back_files(self.out, files)
        self.metrics.open_logs(purge_after=state["step"])
        self._restore(path, state, in_run=True)
        self.loop.run(self.manager.start)
        self.cluster.write_processes(self.out)
        self.trainer_restarts.done(failure, detected=detected, failed_step=failed_step,
                                   restored_step=self.step, restored_from=path)

    # ------------------------------------------------------------------ the loop's steps

    def progress(self, steps: Iterable[int]):
        bar = self.metrics.progress(steps)
        if self.step == 0:  # a trainer failure before the first checkpoint restores this
            self._initial = (self.loop.run(self._driver_state), restored_files(self.out))
        return bar

    def take_groups(self, num_groups: int) -> list:
        """The step's groups; while waiting, the generators are health-checked and any that
        failed is restarted (the others keep generating)."""
        started = time.perf_counter()
        groups = self.health.wait(self.manager.take(num_groups), put_back=self.manager.put_back)
        self._wait_s = time.perf_counter() - started
        return groups

    def record_ledger(self, step: int, groups: Sequence) -> None:
        discarded = self.loop.run(self.manager.take_discarded)
        ledger.record_step(self.out, step=step, version=self.version,
                           trained=[(g.group_id, g.prompt_index) for g in groups],
                           discarded=discarded, digest=ledger.groups_digest(groups))

    def rewards_of(self, groups: Sequence):
        """[prompts, G] rewards, NaN where the verifier failed (past the limit: stops)."""
        return self.verifier_failures.rewards_of(groups, self.cfg.rollout.samples_per_prompt)

    def rollout_metrics(self, groups: Sequence, rewards, keep) -> dict[str, float]:
        return self.metrics.rollout(groups, rewards, keep, sampler=self.sampler, gate=self.gate,
                                    verifier_failures=self.verifier_failures,
                                    version=self.version, wait_s=self._wait_s) \
            | self.health.metrics()  # engines in the rotation

    def train_step(self, batch) -> dict[str, float]:
        colocated = self.cluster.layout.colocated
        release_s = self.weights.release() if colocated else 0.0
        started = time.perf_counter()
        step = trainer_call(lambda: self.cluster.trainers.train_step(
            batch, timeout_s=self.cfg.train.step_timeout_s))
        metrics = self.metrics.train(step, time.perf_counter() - started)
        return metrics | ({"colocated/release_seconds": release_s} if colocated else {})

    def push_weights(self) -> dict[str, float]:
        """Sync the new weights into the generators in flight and publish the version."""
        report, paused_busy = self.weights.push(
            lambda: trainer_call(lambda: self.cluster.trainers.sync_weights()),
            check_generators=self.health.check)
        self.metrics.add_paused_busy(paused_busy)
        self.version = report.version
        self.step += 1
        self.loop.run(lambda: self.manager.publish_version(self.version))
        return report.metrics()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.log(step, metrics, version=self.version)

    def validate(self, step: int) -> None:
        """mean@k per task on the held-out prompts with the current weights -> scaling log."""
        self.validation(step, version=self.version, metrics=self.metrics)

    # ------------------------------------------------------------------ checkpoints, the end

    @property
    def last_checkpoint_step(self) -> int | None:
        return self.checkpoints.last_step

    def save_checkpoint(self, step: int, *, wait: bool = False) -> None:
        self.checkpoints.save(step, self.version, wait=wait)

    def commit_checkpoint(self, *, blocking: bool) -> None:
        self.checkpoints.commit(blocking=blocking)

    def finish(self) -> None:
        """After the last step (or a graceful stop): close the progress bar and end the ledger
        with the groups still outstanding (fit the run's curve with `megatron-rl fit
        output_dir`)."""
        self.checkpoints.commit(blocking=True)
        self.health.record_reward_faults()
        self.metrics.close_progress()
        next_id, outstanding = self.loop.run(
            lambda: (self.manager.next_group_id, self.manager.outstanding_group_ids()))
        ledger.record_end(self.out, next_group_id=next_id, outstanding=outstanding)


def end_of_turn_ids(tokenizer, model_dir: str) -> tuple[int, ...]:
    """The token ids that end a generation: config.json's eos_token_id and
    generation_config.json's, an int or a list each, which SGLang stops on (0.5.23
    srt/configs/model_config.py ModelConfig._get_hf_eos_token_id), and the tokenizer's
    eos_token_id (the same id in practice). A turn that ends with one is closed: the chat
    template's end of message is already in the sequence (TurnFormat turn_closed)."""
    from transformers import AutoConfig, GenerationConfig

    ids = {tokenizer.eos_token_id}
    configs = [AutoConfig.from_pretrained(model_dir)]
    try:
        configs.append(GenerationConfig.from_pretrained(model_dir))
    except OSError:  # no generation_config.json
        pass
    for config in configs:
        eos = getattr(config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or ())
    return tuple(sorted(i for i in ids if i is not None))
