"""How a pipeline stage's sender moves buckets to the generators.

- `DistributedTransport` (default): the sender is rank 0 of a torch.distributed group that every
  generator rank joins (`init_weights_update_group`; gloo on CPU, NCCL on GPU). Per bucket it asks
  each generator to receive (`update_weights_from_distributed`, load format "flattened_bucket":
  the request blocks in the generator until the bytes arrive) and broadcasts the bucket once.
  A generator of several ranks (`Generator.num_ranks`, SGLang's tp_size; expert parallelism
  splits the same ranks) takes that many consecutive ranks of the group (SGLang: rank_offset +
  tp_rank); every one of them receives the full HF tensors and its weight loaders keep its shard.
  With pipeline parallelism every stage's sender has a group of its own over the same generator
  ranks, and a generator serves one weight request at a time, in arrival order: two stages
  sending at once could reach two generators in opposite orders, each then waiting in a
  broadcast that needs the other (the same holds for the groups' joins). So the stages take
  turns per bucket and per join (`BucketTurns`), one in flight cluster-wide, every generator
  seeing the same order (slime serialises its
  engines' updates with a lock for the same reason); the stages still gather in parallel.
- `TensorTransport` (colocated fallback): hands the tensors over in memory
  (`update_weights_from_tensor`). The engine may still read a bucket's memory after it replied,
  so a sent bucket's memory is never written again (`Transport.shares_bucket_memory`).
- `DiskTransport` (last resort): writes an HF folder (safetensors + config) and asks the
  generators to reload it (`update_weights_from_disk`).

The group is created outside torch's default world (the generators are not trainer ranks): torch
has no public API for that, so `init_sender_group` uses the same private helper that SGLang uses on
the receiving side (`_new_process_group_helper`), over a TCPStore that the sender (rank 0) hosts.
"""
from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.rollout.generator import Generator
from megatron_rl.rollout.types import WeightUpdateGroup
from megatron_rl.weight_sync.buckets import Bucket


@dataclasses.dataclass(kw_only=True, slots=True)
class TransferTimes:
    """Seconds spent by a sender: moving bytes, and waiting for the generators to load them."""

    transfer: float = 0.0
    load: float = 0.0


class Transport(abc.ABC):
    times: TransferTimes
    # True: the generators may read a bucket's memory after `send` returned, so the sender gives
    # every bucket memory of its own and never writes a sent bucket again.
    shares_bucket_memory: bool = False

    def connect(self) -> None:
        """Prepare (idempotent); raises on failure."""

    @abc.abstractmethod
    def send(self, bucket: Bucket, *, version: int, flush_cache: bool) -> None: ...

    def finish(self, *, version: int) -> None:
        """After the last bucket of this stage."""

    def close(self) -> None:
        """Release the connection (the next `connect` rebuilds it)."""


def sender_store(group: WeightUpdateGroup, *, timeout_s: float) -> dist.Store:
    """The group's rendezvous store, hosted by the sender (rank 0). Created before the
    generators are asked to join, so they never wait on a store that does not exist yet."""
    return dist.TCPStore(group.master_address, group.master_port, group.world_size,
                         is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_sender_group(group: WeightUpdateGroup, store: dist.Store, *,
                      timeout_s: float) -> dist.ProcessGroup:
    """Rank 0 (the sender) of a process group outside the default world; blocks until every
    generator rank has joined. Mirrors SGLang's init_custom_process_group on the other side."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                    _new_process_group_helper, _world)

    pg, _ = _new_process_group_helper(
        group.world_size, 0, [], Backend(group.backend), PrefixStore(group.group_name, store),
        group_name=group.group_name, backend_options=None,
        timeout=datetime.timedelta(seconds=timeout_s))
    _world.pg_group_ranks[pg] = {i: i for i in range(group.world_size)}
    return pg


def _wait_for_device(device: torch.device) -> None:
    """Block until the work queued on `device` has run. An NCCL collective returns once it is
    queued, so a clock read right after it would put the transfer into the generators' load
    time; CPU (gloo) collectives have finished when they return."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_all(calls: Sequence, *, then=None, timeout_s: float):
    """Run `calls` (no-argument callables) in threads, run `then()` meanwhile in this thread,
    and re-raise the first error of any of them once all have returned."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(len(calls), 1)) as pool:
        futures = [pool.submit(call) for call in calls]
        error = None
        try:
            if then is not None:
                then()
        except BaseException as exc:  # noqa: BLE001 (re-raised below, after the threads end)
            error = exc
        for future in futures:
            try:
                future.result(timeout=timeout_s)
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
    if error is not None:
        raise error


def _join_while_watching(joins: Sequence, create, *, timeout_s: float):
    """Create the sender's side of the group (`create()`, blocks until all ranks joined) while
    the generators' join calls run; a join that fails (e.g. the generator refuses the group) is
    raised at once instead of after the rendezvous timeout. The abandoned rendezvous thread ends
    by itself at its timeout."""
    outcome: dict = {}

    def run():
        try:
            outcome["group"] = create()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            outcome["error"] = exc

    creator = threading.Thread(target=run, daemon=True, name="weight-sync-rendezvous")
    creator.start()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(len(joins), 1)) as pool:
        futures = [pool.submit(join) for join in joins]
        deadline = time.monotonic() + timeout_s
        while creator.is_alive() and time.monotonic() < deadline:
            for future in futures:
                if future.done() and future.exception() is not None:
                    raise future.exception()
            creator.join(timeout=0.05)
        if creator.is_alive():
            raise TimeoutError(f"the generators did not join the weight-update group within "
                               f"{timeout_s:.0f} s")
        for future in futures:
            future.result(timeout=timeout_s)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["group"]


class BucketTurns:
    """A ticket lock over a store every pipeline stage's sender reaches (the trainer world's):
    `with turns.turn():` runs one bucket's send while no other stage's is running, in the order
    the senders asked. A sender that died holding the turn makes the others time out (the sync
    then fails and is retried over a new session's turns)."""

    POLL_S = 0.002

    def __init__(self, store: dist.Store, prefix: str, *, timeout_s: float):
        self.store = dist.PrefixStore(prefix, store)
        self.timeout_s = timeout_s

    @classmethod
    def of_trainer_world(cls, session: str, *, timeout_s: float) -> "BucketTurns":
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(_get_default_store(), f"{session}/bucket_turns/", timeout_s=timeout_s)

    @contextlib.contextmanager
    def turn(self):
        ticket = self.store.add("next", 1) - 1
        deadline = time.monotonic() + self.timeout_s
        while (serving := self.store.add("serving", 0)) != ticket:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"another pipeline stage's sender held the weight-sync turn for more than "
                    f"{self.timeout_s:.0f} s (ticket {ticket}, serving {serving}): a stage "
                    "stopped mid-bucket")
            time.sleep(self.POLL_S)
        try:
            yield
        finally:
            self.store.add("serving", 1)


class DistributedTransport(Transport):
    def __init__(self, generators: Sequence[Generator], *, master_address: str, master_port: int,
                 group_name: str, backend: str, timeout_s: float,
                 device: torch.device | str = "cpu", turns: BucketTurns | None = None):
        self.generators = list(generators)
        self.group = WeightUpdateGroup(
            master_address=master_address, master_port=master_port, rank_offset=0,
            world_size=1 + sum(g.num_ranks for g in self.generators), group_name=group_name,
            backend=backend)
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.turns = turns  # None: this is the only stage
        self.times = TransferTimes()
        self._pg: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None

    def connect(self) -> None:
        if self._pg is not None:
            return
        offsets, offset = [], 1
        for generator in self.generators:
            offsets.append(offset)
            offset += generator.num_ranks
        joins = [lambda g=g, o=o: g.init_weight_update_group(
            dataclasses.replace(self.group, rank_offset=o))
            for g, o in zip(self.generators, offsets)]
        store = sender_store(self.group, timeout_s=self.timeout_s)
        # The engines serve group joins one at a time too: the stages take turns here as well.
        with self._turn():
            self._pg = _join_while_watching(
                joins, lambda: init_sender_group(self.group, store, timeout_s=self.timeout_s),
                timeout_s=self.timeout_s)
        self._store = store

    def send(self, bucket: Bucket, *, version: int, flush_cache: bool) -> None:
        receives = [lambda g=g: g.update_weights_from_distributed(
            bucket.specs, group_name=self.group.group_name, version=version,
            flush_cache=flush_cache) for g in self.generators]
        marks = {}

        def broadcast():
            start = time.perf_counter()
            dist.broadcast(bucket.data.to(self.device), src=0, group=self._pg)
            _wait_for_device(self.device)  # NCCL returns once the broadcast is queued
            marks["sent"] = time.perf_counter()
            marks["start"] = start

        with self._turn():
            _run_all(receives, then=broadcast, timeout_s=self.timeout_s)
        done = time.perf_counter()
        self.times.transfer += marks["sent"] - marks["start"]
        self.times.load += done - marks["sent"]

    def _turn(self):
        return self.turns.turn() if self.turns is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self._pg is None:
            return
        for generator in self.generators:
            try:
                generator.destroy_weight_update_group(self.group.group_name)
            except Exception:  # noqa: BLE001 (a dead generator has nothing to destroy)
                pass
        try:
            dist.destroy_process_group(self._pg)
        except Exception:  # noqa: BLE001 (a group broken by a dead peer may refuse)
            pass
        self._pg = self._store = None


class TensorTransport(Transport):
    """Colocated generators: tensors handed over in memory, bucket by bucket
    (`Generator.update_weights_from_tensors`; SGLang's payload contract is
    megatron_rl.rollout.sglang_tensors).

    SGLang replies once its ranks have passed a CPU barrier after loading, but on GPU the copies
    into its parameters may still be queued then, reading the bucket's memory (slime's
    update_weight_from_tensor.py warns of this). So a sent bucket's memory is never written
    again: the sender gives every bucket a fresh buffer and drops the sent one, whose memory
    torch's CUDA IPC reference counting keeps out of the caching allocator until every engine
    rank has released it (an engine synchronises its stream before it does)."""

    shares_bucket_memory = True

    def __init__(self, generators: Sequence[Generator], *, timeout_s: float):
        self.generators = list(generators)
        self.timeout_s = timeout_s
        self.times = TransferTimes()

    def send(self, bucket: Bucket, *, version: int, flush_cache: bool) -> None:
        start = time.perf_counter()
        tensors = bucket.tensors()
        _run_all([lambda g=g: g.update_weights_from_tensors(tensors, version=version,
                                                            flush_cache=flush_cache)
                  for g in self.generators], timeout_s=self.timeout_s)
        self.times.load += time.perf_counter() - start


class DiskTransport(Transport):
    """Writes this stage's tensors into an HF folder; `reload_generators` (once every stage has
    written) asks the generators to load it.

    Every stage writes its own safetensors file into `directory`; `config_dir` supplies
    config.json (and the rest of the HF side files): the folder the generators serve, so that
    with rollout.precision=fp8 it is the served FP8 copy, whose config.json carries the
    `quantization_config` the written FP8 weights and scales need. (SGLang itself keeps the
    config it started with on a reload: weight_updater.py `update_weights_from_disk` only swaps
    `model_config.model_path`; the folder must still describe what it holds.)"""

    def __init__(self, generators: Sequence[Generator], *, directory: str, config_dir: str,
                 stage: int, timeout_s: float):
        self.generators = list(generators)
        self.directory = Path(directory)
        self.config_dir = Path(config_dir)
        self.stage = stage
        self.timeout_s = timeout_s
        self.times = TransferTimes()
        self._tensors: dict[str, torch.Tensor] = {}

    def send(self, bucket: Bucket, *, version: int, flush_cache: bool) -> None:
        start = time.perf_counter()
        self._tensors.update((name, t.clone()) for name, t in bucket.tensors())
        self.times.transfer += time.perf_counter() - start

    def finish(self, *, version: int) -> None:
        from safetensors.torch import save_file

        start = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        for side_file in self.config_dir.iterdir():
            if side_file.is_file() and not side_file.name.startswith("model") \
                    and side_file.suffix != ".safetensors":
                shutil.copy(side_file, self.directory / side_file.name)
        fp8 = [n for n, t in self._tensors.items() if t.dtype == torch.float8_e4m3fn]
        config = json.loads((self.directory / "config.json").read_text())
        if fp8 and "quantization_config" not in config:
            raise ValueError(
                f"weight sync (disk): {len(fp8)} FP8 tensors (e.g. {fp8[0]}) but "
                f"{self.config_dir}/config.json has no quantization_config: pass the served FP8 "
                "copy (cluster/served_checkpoint.py), not the bf16 checkpoint, as config_dir")
        save_file(self._tensors, str(self.directory / f"model-stage{self.stage:03d}.safetensors"),
                  metadata={"format": "pt", "version": json.dumps(version)})
        self._tensors = {}
        self.times.transfer += time.perf_counter() - start

    def reload_generators(self, *, version: int) -> None:
        start = time.perf_counter()
        _run_all([lambda g=g: g.update_weights_from_disk(str(self.directory), version=version)
                  for g in self.generators], timeout_s=self.timeout_s)
        self.times.load += time.perf_counter() - start
