"""`WeightSync`: push the trainer's current weights to the generators, one version at a time.

Built on every trainer rank (its calls are collective over the trainer world) from the trainer's
model chunk, the family's HF <-> Megatron mapping (`weight_groups(hf_config)` of
models/<family>/convert.py: the same mapping the checkpoint tools use) and the generators. Each
pipeline stage sends the mapping groups whose Megatron tensors it holds, through its one sender
(its lowest rank). At construction the sync is planned (plan.py): every bucket's groups and byte
layout. Per bucket the stage's shard holders send their shards to the sender (gather.py), which
converts them to HF names and layouts (`WeightGroup.to_hf`, casting to the generators' dtype)
straight into the bucket's bytes (for FP8-serving generators the tensors they hold in FP8 are
quantised there, fp8.py `SyncQuantiser`: fp8 weight plus float32 scale under their HF names, the
rest sent as it is); a background thread moves each full bucket (transport.py) while
the sender gathers and converts the next one into a second buffer. Buckets, scratch memory and
the weight-update group are reused from sync to sync; bucket buffers are not where the transport
shares their memory with the generators (colocated tensors: the engine may still be reading a
sent bucket), which get a fresh buffer per bucket.

The global rank 0 wraps the update in SGLang's in-flight protocol (`_UpdateControl`), in this
order: health check -> pause (in place by default: running requests keep their KV cache) ->
begin_weight_update (its reply waits for the decode step in progress: the pause is acknowledged)
-> the buckets (flush_cache false, no weight_version: a bucket that failed must not relabel
anything) -> set_weight_version (/update_weight_version without aborting requests) ->
end_weight_update -> the prefix-cache flush (required after retract and abort; in place only on
a generator where nothing runs) -> continue. The policy version increases by one per successful
sync.

Failure handling: before any transfer, senders check their generators' health and all ranks
agree (all-reduce) whether to go on; a failure there continues the generators on their old
weights (nothing was loaded). A sender whose transfer fails stops sending but keeps receiving its
stage's shards (the holders are sending them), and at the end the whole world agrees. Once a
bucket has reached the generators they are never continued on a partial load: they stay paused
while the whole update is retried (`update_attempts`, each over a rebuilt weight-update group);
if every attempt fails they are marked failed (`Generator.mark_failed`) and stay paused. A failed
sync raises `WeightSyncError` on every rank naming what failed, leaves the trainer's weights and
process groups untouched and does not advance the version.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_rl.platform import collective_device
from megatron_rl.rollout.generator import Generator
from megatron_rl.rollout.types import GeneratorDeadError, GeneratorError
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.fp8 import SyncQuantiser
from megatron_rl.weight_sync.gather import Arena, StageGatherer, WeightSyncGroups
from megatron_rl.weight_sync.plan import PlannedBucket, plan_buckets
from megatron_rl.weight_sync.transport import (BucketTurns, DiskTransport, DistributedTransport,
                                               TensorTransport, Transport)

TRANSPORTS = ("distributed", "tensor", "disk")
PAUSE_MODES = (None, "in_place", "retract", "abort")


class WeightSyncError(RuntimeError):
    """A sync failed; the trainer is unaffected and the generators keep their previous version."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncSettings:
    transport: str = "distributed"  # distributed | tensor (colocated) | disk
    bucket_bytes: int = 512 * 2**20
    dtype: torch.dtype | None = None  # the generators' weight dtype; None: the trainer's
    master_address: str = "127.0.0.1"  # where each stage's sender listens (reachable by the
    master_port: int | None = None  # generators); None: each stage's sender picks a port
    # free on its own host (`sender_port`); a given port: port + pp_rank for stage pp_rank
    backend: str | None = None  # None: nccl with CUDA, else gloo
    pause_mode: str | None = "in_place"  # None: do not pause (updates wait for running requests)
    timeout_s: float = 600.0
    # Attempts at loading one version while the generators stay paused; after the last failed
    # attempt they hold a partial load and are failed (never continued on it).
    update_attempts: int = 3
    disk_dir: str | None = None  # disk transport: where the HF folder is written
    # disk transport: config.json and tokenizer to copy (those of the folder the generators
    # serve: with quantization_config set, the run's FP8 copy)
    hf_config_dir: str | None = None
    # The served config's quantization_config (fp8.served_quantization_config) when the
    # generators serve FP8: the sync quantises what they hold in FP8. None: nothing quantised.
    quantization_config: dict | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport {self.transport!r}: choose one of "
                             f"{TRANSPORTS}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"weight_sync.pause_mode {self.pause_mode!r}: choose one of "
                             f"{PAUSE_MODES}")
        if self.bucket_bytes < 1:
            raise ValueError(f"weight_sync.bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.update_attempts < 1:
            raise ValueError(f"weight_sync.update_attempts must be >= 1, got "
                             f"{self.update_attempts}")
        if self.transport == "disk" and (self.disk_dir is None or self.hf_config_dir is None):
            raise ValueError("weight_sync.transport='disk' needs disk_dir (where to write) and "
                             "hf_config_dir (the HF folder whose config.json to copy)")

    @classmethod
    def from_run_config(cls, run, *, hf_config_dir: str | None = None,
                        **fields) -> "WeightSyncSettings":
        """From megatron_rl.config's RunConfig: its weight_sync section, and rollout.dtype as
        the generators' dtype (auto: the trainer's), rollout.precision / fp8_* as the served
        quantization_config. `hf_config_dir` (the HF checkpoint the generators started from) is
        needed by the disk transport; served in FP8, the generators started from the run's FP8
        copy of it, whose config.json (with the quantization_config the FP8 weights and scales
        written need) the disk folder takes instead (DiskTransport)."""
        from megatron_rl.weight_sync.fp8 import SERVED_FP8_DIR, served_quantization_config

        section = run.weight_sync
        quantization_config = served_quantization_config(run.rollout)
        if quantization_config is not None and hf_config_dir is not None:
            # launch.py points the engines at served_model_dir's copy: output_dir/served_fp8.
            hf_config_dir = os.path.join(run.output_dir, SERVED_FP8_DIR)
        dtype = None if run.rollout.dtype == "auto" else getattr(torch, run.rollout.dtype)
        disk_dir = section.disk_dir or os.path.join(run.output_dir, "weight_sync")
        return cls(transport=section.transport, bucket_bytes=section.bucket_mb * 2**20,
                   dtype=dtype, pause_mode=None if section.pause_mode == "none"
                   else section.pause_mode, timeout_s=section.timeout_s,
                   update_attempts=section.update_attempts, disk_dir=disk_dir if section.transport == "disk" else None,
                   hf_config_dir=hf_config_dir,
                   quantization_config=quantization_config, **fields)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncReport:
    """One sync, as measured on this rank (the time split is meaningful on senders)."""

    version: int
    num_bytes: int  # sent by this rank (0 on non-senders)
    num_tensors: int
    num_buckets: int
    seconds: float  # whole sync, wall clock
    gather_s: float  # TP / EP collectives
    convert_s: float  # HF names and layouts, dtype cast, packing
    transfer_s: float  # moving bucket bytes (overlaps the next bucket's gather and convert)
    load_s: float  # waiting for the generators to load after the bytes arrived
    control_s: float = 0.0  # health checks, pause / begin / version / end / flush / continue
    # Coordinator: every generator's prefix cache was dropped. Pause modes retract and abort
    # always flush; in place, requests keep their KV and the flush happens only on a generator
    # with nothing running (SGLang refuses it otherwise): versions are kept apart by extra_key.
    cache_flushed: bool = True
    attempts: int = 1  # loading attempts this version took (> 1: earlier ones failed)
    # Coordinator: from the first pause request to the last continue (0 when not paused): the
    # time the generators' running requests made no progress because of this update.
    paused_s: float = 0.0
    num_quantized: int = 0  # FP8 weights sent (each with its scale; 0 unless serving FP8)
    quantize_s: float = 0.0  # of convert_s: quantising to FP8

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9)

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        """Scalars for TensorBoard / logs (meaningful on a stage's sender; the coordinator's
        report carries the control time)."""
        return {f"{prefix}{name}": float(value) for name, value in (
            ("version", self.version), ("seconds", self.seconds),
            ("gib", self.num_bytes / 2**30), ("gib_per_s", self.bytes_per_s / 2**30),
            ("buckets", self.num_buckets), ("gather_s", self.gather_s),
            ("convert_s", self.convert_s), ("transfer_s", self.transfer_s),
            ("load_s", self.load_s), ("control_s", self.control_s),
            ("cache_flushed", self.cache_flushed), ("attempts", self.attempts),
            ("paused_s", self.paused_s), ("bytes", self.num_bytes),
            ("quantized_tensors", self.num_quantized), ("quantize_s", self.quantize_s))}


def sender_port(settings: WeightSyncSettings, groups: WeightSyncGroups, *, name: str,
                store: dist.Store) -> int:
    """The port this pipeline stage's sender listens on for its weight-update group `name`.

    Stages may sit on different hosts, so a port found free on one host (rank 0's) says nothing
    about another: each stage's sender picks its own, where it binds it (`listen_port` on its
    own address, settings.master_address), and publishes it in the trainer world's `store`,
    from which the stage's other ranks read it (every rank's transport describes the same
    group). A port given in the settings is taken as it is: stage p uses master_port + p."""
    if settings.master_port is not None:
        return settings.master_port + groups.pp_rank
    key = f"{name}_pp{groups.pp_rank}/master_port"
    if groups.is_sender:
        from megatron_rl.rollout.sglang_server import listen_port

        port = listen_port(settings.master_address)
        store.set(key, str(port))
        return port
    return int(store.get(key))


class WeightSync:
    """See the module docstring. `model` is this rank's (DDP / Float16Module wrapped) chunk."""

    quantiser: SyncQuantiser | None = None  # FP8-serving generators (set in __init__)

    def __init__(self, model, mapping: Sequence, generators: Sequence[Generator],
                 settings: WeightSyncSettings = WeightSyncSettings(), *,
                 groups: WeightSyncGroups | None = None, hf_vocab_size: int | None = None):
        from megatron_rl.trainer.model import unwrap

        self.settings = settings
        self.generators = list(generators)
        self.groups = groups or WeightSyncGroups.from_parallel_state()
        gpt = unwrap(model)
        self.gatherer = StageGatherer(gpt, self.groups,
                                      gated_linear_unit=bool(gpt.config.gated_linear_unit),
                                      vocab_size=hf_vocab_size)
        self.mapping = self._stage_mapping(list(mapping))
        self.quantiser = None if settings.quantization_config is None else SyncQuantiser(
            settings.quantization_config,
            [name for group in self.mapping for name in group.hf_names],
            head_dim=gpt.config.kv_channels)
        self.plan: list[PlannedBucket] = plan_buckets(
            self.mapping, self.gatherer.meta, bucket_bytes=settings.bucket_bytes,
            dtype=settings.dtype, can_fill=self.gatherer.can_fill, quantiser=self.quantiser)
        self.arena = Arena(self.gatherer.device)
        self._buffers: list[torch.Tensor] = []  # the sender's bucket buffers, kept between syncs
        self.version = 0
        self.transport = self._make_transport()

    # ------------------------------------------------------------------ set-up

    def _stage_mapping(self, mapping: list) -> list:
        """The mapping groups this stage sends: each group goes to the first stage holding all
        of its Megatron tensors; a group no stage holds is a configuration error."""
        by_stage = self.gatherer.stage_names
        mine = []
        for group in mapping:
            stages = [s for s in sorted(by_stage) if set(group.megatron_names) <= by_stage[s]]
            if not stages:
                missing = sorted(set(group.megatron_names) - set().union(*by_stage.values()))
                raise ValueError(
                    f"the HF mapping needs Megatron tensors no pipeline stage holds: "
                    f"{missing[:4]}; the mapping and the trainer's model do not match (wrong "
                    "model family or HF config?)")
            if stages[0] == self.groups.pp_rank:
                mine.append(group)
        return mine

    def _make_transport(self) -> Transport:
        settings = self.settings
        if settings.transport == "tensor":
            return TensorTransport(self.generators, timeout_s=settings.timeout_s)
        if settings.transport == "disk":
            return DiskTransport(self.generators, directory=settings.disk_dir,
                                 config_dir=settings.hf_config_dir, stage=self.groups.pp_rank,
                                 timeout_s=settings.timeout_s)
        # The session id: rank 0 picks it. It makes the group names unique per WeightSync, so a
        # group left on a generator by a crashed trainer never collides.
        shared = torch.tensor([0], device=collective_device())
        if dist.get_rank() == 0:
            shared[0] = int.from_bytes(os.urandom(3), "little")
        dist.broadcast(shared, src=0)
        session = int(shared[0])
        backend = settings.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        name = f"megatron_rl_weights_{session:06x}"
        port = sender_port(settings, self.groups, name=name,
                           store=dist.distributed_c10d._get_default_store())
        # Pipeline stages take turns per bucket and join (transport.py: otherwise two generators
        # can take two stages' requests in opposite orders and wait on each other for good). A
        # turn may wait for every other stage's, each bounded by timeout_s.
        turns = BucketTurns.of_trainer_world(
            name, timeout_s=settings.timeout_s * self.groups.pp_size) \
            if self.groups.is_sender and self.groups.pp_size > 1 else None
        return DistributedTransport(
            self.generators, master_address=settings.master_address,
            master_port=port, group_name=f"{name}_pp{self.groups.pp_rank}",
            backend=backend, timeout_s=settings.timeout_s, turns=turns,
            device=torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl" else "cpu")

    # ------------------------------------------------------------------ the sync

    @property
    def _is_coordinator(self) -> bool:
        return dist.get_rank() == 0

    def sync(self, version: int | None = None) -> SyncReport:
        """Push the current weights as policy `version` (default: the next one); every trainer
        rank calls it. Returns this rank's report. A given version re-labels: a resumed or
        restored run, or a restarted generator, gets the version the trainer's weights are."""
        start = time.perf_counter()
        version = self.version + 1 if version is None else version
        counts = _Counts()
        session = not isinstance(self.transport, DiskTransport)  # disk: one atomic reload
        control = _UpdateControl(self.generators, self.settings.pause_mode, session=session,
                                 attempts=self.settings.update_attempts) \
            if self._is_coordinator else None
        # 1. Health, pause, begin. Nothing is loaded yet: a failure continues the generators.
        error = None
        if self.groups.is_sender or control is not None:
            tick = time.perf_counter()
            try:
                for generator in self.generators:
                    generator.check_health()
                if control is not None:
                    control.open()
            except Exception as exc:  # noqa: BLE001 (agreed on below, re-raised everywhere)
                error = exc
            counts.control_s += time.perf_counter() - tick
        self._agree(error, "before sending",
                    outcome=f"generators stay at version {self.version}",
                    cleanup=control.abandon if control is not None else None)
        # 2. The buckets, retried while the generators stay paused.
        self.transport.times.transfer = self.transport.times.load = 0.0
        failures, dead = self._load(version, counts)
        if failures:
            partial = session and self._any(counts.num_attempted > 0)
            if not partial:
                self._agree(failures, "while sending",
                            outcome=f"nothing reached the generators; they stay at version "
                                    f"{self.version}",
                            cleanup=control.abandon if control is not None else None)
            names = ", ".join(_name(g) for g in self.generators)
            reason = (f"weight sync to version {version} failed after it had started loading "
                      f"({'; '.join(failures)})")
            self._agree(failures, "while sending", outcome=(
                f"{'a generator is dead; ' if dead else ''}the generators ({names}) may hold a "
                f"partially loaded model: they stay paused, are marked failed and must be "
                f"restarted"),
                cleanup=functools.partial(control.fail, reason) if control is not None
                else None)
        # 3. Label the version, end, flush where needed, continue.
        error, flushed, failed = None, True, []
        if control is not None:
            tick = time.perf_counter()
            try:
                if not session:
                    self.transport.reload_generators(version=version)
            except Exception as exc:  # noqa: BLE001 (SGLang rolls a failed disk load back)
                error = exc
            counts.control_s += time.perf_counter() - tick
        self._agree(error, "reloading from disk",
                    outcome=f"generators stay at version {self.version}")
        if control is not None:
            tick = time.perf_counter()
            flushed, failed = control.close(version)
            counts.control_s += time.perf_counter() - tick
        # A failure here leaves the version where it was, like every failed sync: the retry
        # (after the failed generators were restarted) publishes this same version again.
        self._agree(GeneratorError("; ".join(failed)) if failed else None, "ending the update",
                    version=version, outcome=(
                        f"the generators named are marked failed and stay paused with version "
                        f"{version}'s weights; the others serve version {version}, which the "
                        f"next sync labels its weights again"))
        self.version = version
        times = self.transport.times
        return SyncReport(version=version, num_bytes=counts.num_bytes,
                          num_tensors=counts.num_tensors, num_buckets=counts.num_buckets,
                          seconds=time.perf_counter() - start, gather_s=counts.gather_s,
                          convert_s=counts.convert_s,
                          transfer_s=counts.transfer_s + times.transfer,
                          load_s=counts.load_s + times.load, control_s=counts.control_s,
                          cache_flushed=flushed, attempts=counts.attempts,
                          paused_s=control.paused_s if control is not None else 0.0,
                          num_quantized=counts.num_quantized, quantize_s=counts.quantize_s)

    def _load(self, version: int, counts: "_Counts") -> tuple[list[str], bool]:
        """Send every stage's buckets, up to `update_attempts` times; each retry runs over a
        rebuilt weight-update group (a failed one may hang). Returns the failure messages of
        every attempt ([] on success) and whether a generator is dead (no further attempt)."""
        failures: list[str] = []
        for attempt in range(self.settings.update_attempts):
            counts.attempts = attempt + 1
            counts.num_bytes = counts.num_tensors = counts.num_buckets = 0
            counts.num_quantized = 0
            if attempt:
                self._rebuild_transport(counts)
            error = None
            if self.groups.is_sender:
                try:
                    self.transport.connect()
                except Exception as exc:  # noqa: BLE001 (agreed on below)
                    error = exc
            messages, dead = self._failures(error)
            if not messages:
                error = self._send_stage(counts)
                if self.groups.is_sender and error is None:
                    try:
                        self.transport.finish(version=version)
                    except Exception as exc:  # noqa: BLE001
                        error = exc
                messages, dead = self._failures(error)
            if not messages:
                return [], False
            failures.append(f"attempt {attempt + 1}: {'; '.join(messages)}")
            if dead:
                break
        return failures, dead

    def _rebuild_transport(self, counts: "_Counts") -> None:
        """Drop the weight-update group and make a new one (new port unless one is configured,
        new group name); collective."""
        counts.transfer_s += self.transport.times.transfer
        counts.load_s += self.transport.times.load
        self.transport.close()
        self.transport = self._make_transport()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights as the generators receive them ({HF name: tensor}, the
        generators' dtype; fp8 weights and their scales where they serve FP8) on the sender, {}
        elsewhere; every rank of the stage calls it."""
        state = {}
        for bucket in self.plan:
            full = self.gatherer.gather(bucket.megatron_names, arena=self.arena)
            if self.groups.is_sender:
                for name, tensor, quantized in self._hf_tensors(bucket, full):
                    dtype = tensor.dtype if quantized else self.settings.dtype or tensor.dtype
                    state[name] = tensor.to(dtype, copy=True).contiguous()
            self.arena.reset()
        return state

    def _send_stage(self, counts: "_Counts") -> Exception | None:
        """Gather, convert and send this stage's buckets; the sender's first send error. Ranks
        holding none of the shards the sender needs return at once."""
        sender = self.groups.is_sender
        names = (name for bucket in self.plan for name in bucket.megatron_names)
        if not self.plan or not self.gatherer.participates(names):
            return None
        pipeline = _SendPipeline(self.transport, self._bucket_buffers(), counts) \
            if sender else None
        convert_error = None
        try:
            for bucket in self.plan:
                into, slots, buffer = None, None, None
                if sender:
                    buffer = pipeline.take_buffer()
                    slots = bucket.slots(buffer)
                    into = {megatron: slots[hf] for hf, megatron in bucket.in_place.items()}
                tick = time.perf_counter()
                full = self.gatherer.gather(bucket.megatron_names, into=into, arena=self.arena)
                counts.gather_s += time.perf_counter() - tick
                if not sender:
                    continue
                tick = time.perf_counter()
                # After a failed send or conversion: keep receiving (the holders are sending),
                # convert and send nothing more.
                if pipeline.error is None and convert_error is None:
                    try:
                        self._convert(bucket, full, slots, counts)
                        counts.num_tensors += len(bucket.specs)
                        counts.num_quantized += bucket.num_quantized
                    except Exception as exc:  # noqa: BLE001 (agreed on by all ranks)
                        convert_error = exc
                self.arena.reset()
                counts.convert_s += time.perf_counter() - tick
                if convert_error is None:
                    pipeline.submit(buffer, bucket)
                else:
                    pipeline.give_back(buffer)
        finally:
            send_error = pipeline.close() if pipeline is not None else None
        return convert_error or send_error

    def _convert(self, bucket: PlannedBucket, full: dict[str, torch.Tensor],
                 slots: dict[str, torch.Tensor], counts: "_Counts") -> None:
        """HF names and layouts (and the generators' dtype, or FP8) into the bucket's slots;
        tensors gathered in place are there already."""
        for name, tensor, _ in self._hf_tensors(bucket, full, counts):
            if name in bucket.in_place:
                continue
            slot = slots[name]
            if slot.shape != tensor.shape or (tensor.dtype != slot.dtype and (
                    slot.dtype == torch.float8_e4m3fn or tensor.dtype == torch.float8_e4m3fn)):
                # copy_ would broadcast a shape or round into fp8: a plan / quantiser mismatch.
                raise RuntimeError(f"weight sync: {name} is {tensor.dtype} {tuple(tensor.shape)}"
                                   f" but was planned as {slot.dtype} {tuple(slot.shape)}")
            slot.copy_(tensor)

    def _hf_tensors(self, bucket: PlannedBucket, full: dict[str, torch.Tensor],
                    counts: "_Counts | None" = None):
        """(HF name, tensor, quantised) for the generators: `to_hf`'s output, quantised to FP8
        (weight and scale) where they hold it in FP8, else as it is: the caller casts those to
        the generators' dtype (`_convert` while copying into the bucket, without a temporary)."""
        dtype = self.settings.dtype
        for group in bucket.groups:
            for name, tensor in group.to_hf({n: full[n] for n in group.megatron_names}).items():
                if self.quantiser is None or name not in self.quantiser.quantised:
                    yield name, tensor, False
                    continue
                # Quantise what the generators would hold in their dtype (SGLang's online FP8
                # quantises its bf16 weights; a served FP8 checkpoint is made from the bf16 one),
                # so version 0 sent equals the checkpoint served. One piece at a time: each is
                # copied into its slot before the next is made.
                pieces = self.quantiser.iter_quantized(name, tensor.to(dtype or tensor.dtype))
                while True:
                    tick = time.perf_counter()
                    piece = next(pieces, None)
                    if counts is not None:
                        counts.quantize_s += time.perf_counter() - tick
                    if piece is None:
                        break
                    yield (*piece, True)

    def _bucket_buffers(self) -> list[torch.Tensor]:
        """Two buffers of the largest bucket (one is filled while the other is sent), kept from
        sync to sync; fresh ones every sync where the transport shares a sent bucket's memory
        with the generators (then `_SendPipeline` replaces every sent buffer as well)."""
        keep = not self.transport.shares_bucket_memory
        if keep and self._buffers:
            return self._buffers
        size = max(bucket.num_bytes for bucket in self.plan)
        buffers = [torch.empty(size, dtype=torch.uint8, device=self.gatherer.device)
                   for _ in range(min(2, len(self.plan)))]
        if keep:
            self._buffers = buffers
        return buffers

    def _failures(self, error) -> tuple[list[str], bool]:
        """Every rank's error message ([] when no rank failed) and whether any was a dead
        generator; collective over the world."""
        code = 0 if error is None else 2 if isinstance(error, GeneratorDeadError) else 1
        flag = torch.tensor([code], dtype=torch.int64, device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag):
            return [], False
        message = None if error is None else _describe(error)
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        return [m for m in messages if m], int(flag) == 2

    @staticmethod
    def _any(value: bool) -> bool:
        flag = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(int(flag))

    def _agree(self, error, when: str, *, outcome: str, cleanup=None,
               version: int | None = None) -> None:
        """All ranks learn whether any rank failed (`error`: an exception, a list of messages
        already agreed on by every rank, or None); then every rank raises the same
        WeightSyncError, after the coordinator ran `cleanup`."""
        messages = error if isinstance(error, list) else self._failures(error)[0]
        if not messages:
            return
        if cleanup is not None:
            cleanup()
        # The broken group may hang on its next use: drop it (the next sync rebuilds it).
        self.transport.close()
        raise WeightSyncError(f"weight sync to version {version or self.version + 1} failed "
                              f"{when}: {'; '.join(messages)}. The trainer is unaffected; "
                              f"{outcome}.")

    def close(self) -> None:
        self.transport.close()


@dataclasses.dataclass(kw_only=True, slots=True)
class _Counts:
    num_bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    num_attempted: int = 0  # buckets handed to the transport, over all attempts
    attempts: int = 1
    gather_s: float = 0.0
    convert_s: float = 0.0
    transfer_s: float = 0.0  # of transports dropped after a failed attempt
    load_s: float = 0.0
    control_s: float = 0.0
    num_quantized: int = 0
    quantize_s: float = 0.0


class _SendPipeline:
    """The sender's transfer thread: it sends each filled bucket buffer and hands the buffer
    back, while the caller fills the next one. The first send error stops further sends (the
    caller keeps draining its gathers) and is returned by `close`."""

    def __init__(self, transport: Transport, buffers: list[torch.Tensor], counts: _Counts):
        self.transport = transport
        self.counts = counts
        self.error: Exception | None = None
        self._free: queue.Queue = queue.Queue()
        for buffer in buffers:
            self._free.put(buffer)
        self._todo: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="weight-sync-send", daemon=True)
        self._thread.start()

    def take_buffer(self) -> torch.Tensor:
        return self._free.get()

    def submit(self, buffer: torch.Tensor, bucket: PlannedBucket) -> None:
        self._todo.put((buffer, bucket))

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)

    def close(self) -> Exception | None:
        self._todo.put(None)
        self._thread.join()
        return self.error

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            buffer, bucket = item
            if self.error is None:
                try:
                    self.counts.num_attempted += 1
                    # No version on a bucket: SGLang relabels the scheduler with every bucket
                    # that loads, so a sync failing later would leave tokens mislabelled; the
                    # coordinator labels the version once every stage has loaded. No flush:
                    # requests paused in place keep their KV, and SGLang fails a bucket whose
                    # flush it has to refuse.
                    self.transport.send(Bucket(specs=bucket.specs,
                                               data=buffer[:bucket.num_bytes]),
                                        version=None, flush_cache=False)
                    self.counts.num_bytes += bucket.num_bytes
                    self.counts.num_buckets += 1
                except Exception as exc:  # noqa: BLE001 (returned to the caller)
                    self.error = exc
            if self.transport.shares_bucket_memory:
                # The generators may still be reading the sent memory: never write it again.
                buffer = torch.empty_like(buffer)
            self._free.put(buffer)


class _UpdateControl:
    """Global rank 0's side of one update, on every generator (the module docstring's order).

    `open`: pause (the pause mode; None: not paused) and begin_weight_update, whose reply waits
    for the decode step in progress, so it also acknowledges the pause. `close(version)`: label
    the version (no request aborted), end_weight_update, flush the prefix cache where the pause
    mode needs it (below), continue. `abandon`: nothing was loaded, so end and continue. `fail`:
    a bucket may have loaded, so never continue: end the session (a later full update can then
    begin) and mark the generators failed; they stay paused.

    Prefix cache per pause mode (SGLang 0.5.23): in place, paused requests keep their KV and
    SGLang refuses a flush while any is running; requests namespace the cache by their
    admission version (`extra_key`), so none starts from another version's KV, and the cache
    is flushed only where nothing is running (then un-namespaced requests start clean too).
    retract frees the running requests' KV but leaves their prompts' KV in the radix tree
    (release_kv_cache), so the re-prefill after continue would reuse KV of the old weights:
    the flush is required (requests are queued then, so SGLang accepts it). abort ends the
    requests, whose KV stays in the tree for resubmissions to hit: the flush is required too.
    """

    _MUST_FLUSH = ("retract", "abort")

    def __init__(self, generators: Sequence[Generator], pause_mode: str | None, *,
                 session: bool, attempts: int):
        self.generators = list(generators)
        self.pause_mode = pause_mode
        self.session = session  # False (disk): one atomic reload, no pause, no session
        self.attempts = attempts
        self.paused: list[Generator] = []
        self.begun: list[Generator] = []
        self._pause_started: float | None = None
        self.paused_s = 0.0  # first pause request -> last continue (set by close)

    def open(self) -> None:
        if not self.session:
            return
        for generator in self.generators:
            if self.pause_mode is not None:
                if self._pause_started is None:
                    self._pause_started = time.perf_counter()
                generator.pause(self.pause_mode)
                self.paused.append(generator)
            generator.begin_weight_update()
            self.begun.append(generator)

    def close(self, version: int) -> tuple[bool, list[str]]:
        """Finish the update on every generator; (every prefix cache flushed, failures). A
        generator whose steps still fail after `attempts` tries is failed and left paused."""
        flushed, failed = True, []
        must_flush = self.session and self.pause_mode in self._MUST_FLUSH
        for generator in self.generators:
            try:
                _retry(functools.partial(generator.set_weight_version, version), self.attempts)
                if generator in self.begun:
                    _retry(generator.end_weight_update, self.attempts)
                if must_flush:
                    _retry(generator.flush_cache, self.attempts)
                else:
                    flushed &= _flush_if_idle(generator)
                if generator in self.paused:
                    _retry(generator.resume, self.attempts)
            except Exception as exc:  # noqa: BLE001 (the generator is failed, named)
                message = (f"generator {_name(generator)} could not finish the update to "
                           f"version {version}: {_describe(exc)}")
                generator.mark_failed(message)
                failed.append(message)
        if self._pause_started is not None:
            self.paused_s = time.perf_counter() - self._pause_started
        return flushed, failed

    def abandon(self) -> None:
        """Nothing reached the generators: close their sessions and continue (best effort)."""
        for generator in self.begun:
            _best_effort(generator.end_weight_update)
        for generator in self.paused:
            _best_effort(generator.resume)

    def fail(self, reason: str) -> None:
        """A partial load: never continue. The generators stay paused and refuse later calls."""
        for generator in self.begun:
            _best_effort(generator.end_weight_update)
        for generator in self.generators:
            generator.mark_failed(reason)


def _flush_if_idle(generator: Generator) -> bool:
    """Drop the prefix cache if nothing runs; SGLang checks that atomically in its scheduler
    (`is_fully_idle`) and otherwise refuses, changing nothing."""
    try:
        generator.flush_cache()
        return True
    except GeneratorDeadError:
        raise
    except GeneratorError:
        return False


def _retry(call, attempts: int):
    """`call()`, tried up to `attempts` times; a dead generator is not retried."""
    for attempt in range(attempts):
        try:
            return call()
        except GeneratorDeadError:
            raise
        except Exception:  # noqa: BLE001 (re-raised after the last attempt)
            if attempt + 1 == attempts:
                raise
            time.sleep(0.1 * 2 ** attempt)


def _best_effort(call) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 (a dead or failed generator cannot answer)
        pass


def _name(generator: Generator) -> str:
    return getattr(generator, "url", None) or type(generator).__name__


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
