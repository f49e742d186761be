"""`WeightSync`: push the trainer's current weights to the generators, one version at a time.

Built on every trainer rank (its calls are collective over the trainer world) from the trainer's
model chunk, the family's HF <-> Megatron mapping (`weight_groups(hf_config)` of
models/<family>/convert.py: the same mapping the checkpoint tools use) and the generators. Each
pipeline stage sends the mapping groups whose Megatron tensors it holds, through its one sender
(its lowest rank). At construction the sync is planned (plan.py): every bucket's groups and byte
layout. Per bucket the stage's shard holders send their shards to the sender (gather.py), which
converts them to HF names and layouts (`WeightGroup.to_hf`, casting to the generators' dtype)
straight into the bucket's bytes; a background thread moves each full bucket (transport.py) while
the sender gathers and converts the next one into a second buffer. Buckets, scratch memory and
the weight-update group are reused from sync to sync.

The global rank 0 wraps the update: pause in place (Pipeline-RL: running requests keep their KV
cache), begin_weight_update, ..., end_weight_update, flush the prefix cache, continue. The policy
version increases by one per successful sync.

Failure handling: before any transfer, senders check their generators' health and all ranks
agree (all-reduce) whether to go on. A sender whose transfer fails stops sending but keeps
receiving its stage's shards (the holders are sending them), and at the end the whole world
agrees. A failed sync raises `WeightSyncError` on every rank with the sender's message, leaves
the trainer's weights and process groups untouched, does not advance the version, and drops the
weight-update group (the next sync rebuilds it).
"""
from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_rl.rollout.generator import Generator
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.gather import Arena, StageGatherer, WeightSyncGroups
from megatron_rl.weight_sync.plan import PlannedBucket, plan_buckets
from megatron_rl.weight_sync.transport import (DiskTransport, DistributedTransport, TensorTransport,
                                               Transport)

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
    master_port: int | None = None  # generators); port None: a free port, + pp_rank per stage
    backend: str | None = None  # None: nccl with CUDA, else gloo
    pause_mode: str | None = "in_place"  # None: do not pause (updates wait for running requests)
    timeout_s: float = 600.0
    disk_dir: str | None = None  # disk transport: where the HF folder is written
    hf_config_dir: str | None = None  # disk transport: config.json and tokenizer to copy

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport {self.transport!r}: choose one of "
                             f"{TRANSPORTS}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"weight_sync.pause_mode {self.pause_mode!r}: choose one of "
                             f"{PAUSE_MODES}")
        if self.bucket_bytes < 1:
            raise ValueError(f"weight_sync.bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.transport == "disk" and (self.disk_dir is None or self.hf_config_dir is None):
            raise ValueError("weight_sync.transport='disk' needs disk_dir (where to write) and "
                             "hf_config_dir (the HF folder whose config.json to copy)")

    @classmethod
    def from_run_config(cls, run, *, hf_config_dir: str | None = None,
                        **fields) -> "WeightSyncSettings":
        """From megatron_rl.config's RunConfig: its weight_sync section, and rollout.dtype as
        the generators' dtype (auto: the trainer's). `hf_config_dir` (the HF checkpoint the
        generators started from) is needed by the disk transport."""
        section = run.weight_sync
        dtype = None if run.rollout.dtype == "auto" else getattr(torch, run.rollout.dtype)
        disk_dir = section.disk_dir or os.path.join(run.output_dir, "weight_sync")
        return cls(transport=section.transport, bucket_bytes=section.bucket_mb * 2**20,
                   dtype=dtype, pause_mode=None if section.pause_mode == "none"
                   else section.pause_mode, timeout_s=section.timeout_s,
                   disk_dir=disk_dir if section.transport == "disk" else None,
                   hf_config_dir=hf_config_dir, **fields)


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
    control_s: float = 0.0  # health checks, pause / begin / end / flush / continue calls
    cache_flushed: bool = True  # coordinator: every generator's prefix cache was dropped

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
            ("cache_flushed", self.cache_flushed))}


class WeightSync:
    """See the module docstring. `model` is this rank's (DDP / Float16Module wrapped) chunk."""

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
        self.plan: list[PlannedBucket] = plan_buckets(
            self.mapping, self.gatherer.meta, bucket_bytes=settings.bucket_bytes,
            dtype=settings.dtype, can_fill=self.gatherer.can_fill)
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
        from megatron_rl.rollout.sglang_server import free_port

        # [port, session id]: rank 0 picks both. The id makes the group names unique per
        # WeightSync, so a group left on a generator by a crashed trainer never collides.
        shared = torch.tensor([settings.master_port or 0, 0])
        if dist.get_rank() == 0:
            if settings.master_port is None:
                shared[0] = free_port(settings.master_address)
            shared[1] = int.from_bytes(os.urandom(3), "little")
        dist.broadcast(shared, src=0)
        port, session = int(shared[0]), int(shared[1])
        backend = settings.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        return DistributedTransport(
            self.generators, master_address=settings.master_address,
            master_port=port + self.groups.pp_rank,
            group_name=f"megatron_rl_weights_{session:06x}_pp{self.groups.pp_rank}",
            backend=backend,
            timeout_s=settings.timeout_s,
            device=torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl" else "cpu")

    # ------------------------------------------------------------------ the sync

    @property
    def _is_coordinator(self) -> bool:
        return dist.get_rank() == 0

    def sync(self) -> SyncReport:
        """Push the current weights; every trainer rank calls it. Returns this rank's report."""
        start = time.perf_counter()
        version = self.version + 1
        began = False
        error = None
        counts = _Counts()
        if self.groups.is_sender or self._is_coordinator:
            tick = time.perf_counter()
            try:
                for generator in self.generators:
                    generator.check_health()
                if self._is_coordinator:
                    began = self._begin()
                if self.groups.is_sender:
                    self.transport.connect()
            except Exception as exc:  # noqa: BLE001 (agreed on below, re-raised everywhere)
                error = exc
            counts.control_s += time.perf_counter() - tick
        self._agree(error, dist.group.WORLD, "before sending", cleanup=began)
        self.transport.times.transfer = self.transport.times.load = 0.0
        error = self._send_stage(version, counts)
        self._agree(error, dist.group.WORLD, "while sending", cleanup=began)
        error = None
        if self.groups.is_sender:
            try:
                self.transport.finish(version=version)
            except Exception as exc:  # noqa: BLE001
                error = exc
        self._agree(error, dist.group.WORLD, "finishing", cleanup=began)
        error, flushed = None, True
        if self._is_coordinator:
            tick = time.perf_counter()
            try:
                if isinstance(self.transport, DiskTransport):
                    self.transport.reload_generators(version=version)
                flushed = self._end(began, version)
            except Exception as exc:  # noqa: BLE001
                error = exc
            counts.control_s += time.perf_counter() - tick
        self._agree(error, dist.group.WORLD, "ending the update", cleanup=False)
        self.version = version
        times = self.transport.times
        return SyncReport(version=version, num_bytes=counts.num_bytes,
                          num_tensors=counts.num_tensors, num_buckets=counts.num_buckets,
                          seconds=time.perf_counter() - start, gather_s=counts.gather_s,
                          convert_s=counts.convert_s, transfer_s=times.transfer,
                          load_s=times.load, control_s=counts.control_s, cache_flushed=flushed)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights as the generators receive them ({HF name: tensor}, the
        generators' dtype) on the sender, {} elsewhere; every rank of the stage calls it."""
        state = {}
        for bucket in self.plan:
            full = self.gatherer.gather(bucket.megatron_names, arena=self.arena)
            if self.groups.is_sender:
                for group in bucket.groups:
                    for name, tensor in group.to_hf(
                            {n: full[n] for n in group.megatron_names}).items():
                        state[name] = tensor.to(self.settings.dtype or tensor.dtype,
                                                copy=True).contiguous()
            self.arena.reset()
        return state

    def _begin(self) -> bool:
        if isinstance(self.transport, DiskTransport):
            return False  # update_weights_from_disk is not a session update
        for generator in self.generators:
            if self.settings.pause_mode is not None:
                generator.pause(self.settings.pause_mode)
            generator.begin_weight_update()
        return True

    def _end(self, began: bool, version: int) -> bool:
        """Close the update and continue; True when every prefix cache was flushed."""
        from megatron_rl.rollout.types import GeneratorError

        flushed = True
        for generator in self.generators:
            if began:
                generator.end_weight_update()
            generator.set_weight_version(version)
            # Cached prefixes hold KV of the old policy: drop them so new requests start clean.
            # Requests paused in place keep their KV (Pipeline-RL), so the flush is refused
            # while any runs; those entries then age out of the cache.
            try:
                generator.flush_cache()
            except GeneratorError:
                flushed = False
            if began and self.settings.pause_mode is not None:
                generator.resume()
        return flushed

    def _send_stage(self, version: int, counts: "_Counts") -> Exception | None:
        """Gather, convert and send this stage's buckets; the sender's first send error. Ranks
        holding none of the shards the sender needs return at once."""
        sender = self.groups.is_sender
        names = (name for bucket in self.plan for name in bucket.megatron_names)
        if not self.plan or not self.gatherer.participates(names):
            return None
        pipeline = _SendPipeline(self.transport, self._bucket_buffers(), version, counts) \
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
                        self._convert(bucket, full, slots)
                        counts.num_tensors += len(bucket.specs)
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

    @staticmethod
    def _convert(bucket: PlannedBucket, full: dict[str, torch.Tensor],
                 slots: dict[str, torch.Tensor]) -> None:
        """HF names and layouts (and the generators' dtype) into the bucket's slots; tensors
        gathered in place are there already."""
        for group in bucket.groups:
            for name, tensor in group.to_hf({n: full[n] for n in group.megatron_names}).items():
                if name not in bucket.in_place:
                    slots[name].copy_(tensor)

    def _bucket_buffers(self) -> list[torch.Tensor]:
        """Two buffers of the largest bucket (one is filled while the other is sent)."""
        if not self._buffers:
            size = max(bucket.num_bytes for bucket in self.plan)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.gatherer.device)
                             for _ in range(min(2, len(self.plan)))]
        return self._buffers

    def _agree(self, error, group, when: str, *, cleanup: bool = False) -> None:
        """All ranks learn whether any rank failed; every rank raises the same WeightSyncError."""
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag):
            return
        message = None if error is None else f"{type(error).__name__}: {error}"
        messages = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
        if cleanup and self._is_coordinator:
            self._abandon()
        # The broken group may hang on its next use: drop it (the next sync rebuilds it).
        self.transport.close()
        reasons = "; ".join(m for m in messages if m)
        raise WeightSyncError(f"weight sync to version {self.version + 1} failed {when}: "
                              f"{reasons}. The trainer is unaffected; generators stay at version "
                              f"{self.version}.")

    def _abandon(self) -> None:
        """Best effort after a failure: close the generators' update session and unpause."""
        for generator in self.generators:
            for call in (generator.end_weight_update, generator.resume):
                try:
                    call()
                except Exception:  # noqa: BLE001 (a dead generator cannot answer)
                    pass

    def close(self) -> None:
        self.transport.close()


@dataclasses.dataclass(kw_only=True, slots=True)
class _Counts:
    num_bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    gather_s: float = 0.0
    convert_s: float = 0.0
    control_s: float = 0.0


class _SendPipeline:
    """The sender's transfer thread: it sends each filled bucket buffer and hands the buffer
    back, while the caller fills the next one. The first send error stops further sends (the
    caller keeps draining its gathers) and is returned by `close`."""

    def __init__(self, transport: Transport, buffers: list[torch.Tensor], version: int,
                 counts: _Counts):
        self.transport = transport
        self.version = version
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
                    self.transport.send(Bucket(specs=bucket.specs,
                                               data=buffer[:bucket.num_bytes]),
                                        version=self.version, flush_cache=False)
                    self.counts.num_bytes += bucket.num_bytes
                    self.counts.num_buckets += 1
                except Exception as exc:  # noqa: BLE001 (returned to the caller)
                    self.error = exc
            self._free.put(buffer)
