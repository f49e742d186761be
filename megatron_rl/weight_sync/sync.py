"""`WeightSync`: push the trainer's current weights to the generators, one version at a time.

Built on every trainer rank (its calls are collective over the trainer world) from the trainer's
model chunk, the family's HF <-> Megatron mapping (`weight_groups(hf_config)` of
models/<family>/convert.py: the same mapping the checkpoint tools use) and the generators. Each
pipeline stage owns the mapping groups whose Megatron tensors it holds; its ranks gather those
tensors (gather.py), its one sender converts them to HF names and layouts (`WeightGroup.to_hf`),
casts them to the generators' dtype, packs buckets (buckets.py) and moves them (transport.py).
The global rank 0 wraps the update: pause in place (Pipeline-RL: running requests keep their KV
cache), begin_weight_update, ..., end_weight_update, continue. The policy version increases by one
per successful sync.

Failure handling: before any collective, senders check their generators' health and all ranks
agree (all-reduce) whether to go on; after every bucket the stage's ranks agree whether the sender
succeeded, and at the end the whole world agrees. A failed sync raises `WeightSyncError` on every
rank with the sender's message, leaves the trainer's weights and process groups untouched, does not
advance the version, and drops the weight-update group (the next sync rebuilds it).
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_rl.rollout.generator import Generator
from megatron_rl.weight_sync.buckets import BucketPacker
from megatron_rl.weight_sync.gather import StageGatherer, WeightSyncGroups
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
    transfer_s: float  # moving bucket bytes
    load_s: float  # waiting for the generators to load after the bytes arrived
    cache_flushed: bool = True  # coordinator: every generator's prefix cache was dropped

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9)


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
        self.version = 0
        self.transport = self._make_transport()

    # ------------------------------------------------------------------ set-up

    def _stage_mapping(self, mapping: list) -> list:
        """The mapping groups this stage sends: each group goes to the first stage holding all
        of its Megatron tensors; a group no stage holds is a configuration error."""
        local = self.gatherer.names()
        holders = [None] * dist.get_world_size()
        dist.all_gather_object(holders, (self.groups.pp_rank, sorted(local)))
        by_stage: dict[int, set[str]] = {}
        for stage, names in holders:
            by_stage.setdefault(stage, set()).update(names)
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
        if self.groups.is_sender or self._is_coordinator:
            try:
                for generator in self.generators:
                    generator.check_health()
                if self._is_coordinator:
                    began = self._begin()
                if self.groups.is_sender:
                    self.transport.connect()
            except Exception as exc:  # noqa: BLE001 (agreed on below, re-raised everywhere)
                error = exc
        self._agree(error, dist.group.WORLD, "before sending", cleanup=began)
        counts = _Counts()
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
            try:
                if isinstance(self.transport, DiskTransport):
                    self.transport.reload_generators(version=version)
                flushed = self._end(began, version)
            except Exception as exc:  # noqa: BLE001
                error = exc
        self._agree(error, dist.group.WORLD, "ending the update", cleanup=False)
        self.version = version
        times = self.transport.times
        return SyncReport(version=version, num_bytes=counts.num_bytes,
                          num_tensors=counts.num_tensors, num_buckets=counts.num_buckets,
                          seconds=time.perf_counter() - start, gather_s=counts.gather_s,
                          convert_s=counts.convert_s, transfer_s=times.transfer,
                          load_s=times.load, cache_flushed=flushed)

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
        """Gather, convert, pack and send this stage's groups; the first send error. After a
        failed send the sender keeps taking part in the stage's gathers (its TP / EP peers are
        waiting in them) but sends nothing more."""
        flush_cache = self.settings.pause_mode != "in_place"
        packer = BucketPacker(self.settings.bucket_bytes, device="cpu")
        self.transport.times.transfer = self.transport.times.load = 0.0
        error = None
        for group in self.mapping:
            tick = time.perf_counter()
            megatron = {name: self.gatherer.get(name) for name in group.megatron_names}
            counts.gather_s += time.perf_counter() - tick
            if not self.groups.is_sender or error is not None:
                continue
            tick = time.perf_counter()
            buckets = []
            for name, tensor in group.to_hf(megatron).items():
                if self.settings.dtype is not None:
                    tensor = tensor.to(self.settings.dtype)
                buckets += packer.add(name, tensor.contiguous())
                counts.num_tensors += 1
            counts.convert_s += time.perf_counter() - tick
            error = self._send_buckets(buckets, version, flush_cache, counts)
        if self.groups.is_sender and error is None:
            error = self._send_buckets(packer.flush(), version, flush_cache, counts)
        return error

    def _send_buckets(self, buckets, version: int, flush_cache: bool,
                      counts: "_Counts") -> Exception | None:
        for bucket in buckets:
            try:
                self.transport.send(bucket, version=version, flush_cache=flush_cache)
            except Exception as exc:  # noqa: BLE001 (agreed on by all ranks, then re-raised)
                return exc
            counts.num_bytes += bucket.num_bytes
            counts.num_buckets += 1
        return None

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
