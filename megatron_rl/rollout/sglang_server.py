"""SGLang generators: launch a server as a subprocess, wait until it is healthy, and talk to it
over HTTP (token ids in, token ids + log-probs out; the server runs with skip_tokenizer_init, so
nothing is detokenised and retokenised).

`SGLangServerSettings` maps our rollout configuration onto SGLang's own server arguments (tp_size,
ep_size, dtype, mem_fraction_static, enable_fp32_lm_head (on by default, SCALERL.md section 6),
attention_backend, ...); on CPU with tp_size > 1 it also gives each rank its own cores and a
KV-cache bound (`cpu_threads_bind`, `cpu_rank_max_total_tokens`); on GPU a chunked-attention
model (Llama-4) gets a backend that honours the chunk (fa3 on Hopper, or a requested torch_native,
patched, on any GPU) or is refused (`gpu_attention_backend`),
and a colocated Llama-4 engine keeps its weights region across a release
(WEIGHTS_CPU_BACKUP_ARGS). `SGLangServer.launch(settings)`
starts `python -m megatron_rl.rollout.sglang_launch <args>` (which applies
megatron_rl.platform.sglang_cpu's fixes on a CPU-only machine, so the same code path runs here and
on GPU) in its own process group, tied to the launching process (it and its children die with
it, also when it is SIGKILLed: megatron_rl.rollout.engine_lifetime), and waits for /health with a
timeout, failing early with the server's log tail if the process exits. With
`SGLangServerSettings.api_key` the server refuses every request without that key (SGLang's
--api-key; the key reaches it in its environment, not on its command line) and the clients below
send it (`api_key`, or the key of the `server` they are given).
`SGLangGenerator` implements the Generator interface over HTTP: every call has a timeout; calls
that cannot have reached the server (connection refused) are retried with exponential backoff;
errors carry the server's own message; a server whose process exited or that no longer answers is
reported as GeneratorDeadError instead of being waited on.

For in-flight weight updates (Pipeline-RL, docs/generators.md) the server runs without SGLang's
overlap schedule (exact per-token versions), `generate` takes an `extra_key` that namespaces the
prefix cache (the admission version), bucket updates carry no version and `set_weight_version`
labels a completed update without aborting requests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_rl.rollout import engine_lifetime
from megatron_rl.rollout.generator import Generator
from megatron_rl.rollout.types import (GenerationResult, GeneratorDeadError, GeneratorError,
                                       SamplingParams, TensorSpec, WeightUpdateGroup,
                                       decode_routed_experts)

_PAUSE_MODES = ("in_place", "retract", "abort")
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
# The sglang.srt.models module whose EntryClass is each architecture our families serve.
_MODEL_MODULES = {"LlamaForCausalLM": "llama", "Llama4ForCausalLM": "llama4",
                  "Llama4ForConditionalGeneration": "mllama4", "Qwen3MoeForCausalLM": "qwen3_moe"}
_DISABLED_MODELS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"
# How SGLangServerSettings.api_key reaches the server process (megatron_rl.rollout.sglang_launch).
API_KEY_ENV = "MEGATRON_RL_ENGINE_API_KEY"
# rollout.continuations_first: priority scheduling over SGLang's first-come-first-served queue
# (a request without a priority gets 0; continuations are sent with
# rollout/interruption.py CONTINUATION_PRIORITY), never preempting a running request.
CONTINUATIONS_FIRST_ARGS = ("--enable-priority-scheduling", "--default-priority-value", "0",
                            "--disable-priority-preemption")
# Llama-4's chunked attention (attention_chunk_size: on its RoPE layers, RadixAttention.use_irope,
# a token attends within its chunk only) is implemented on GPU in SGLang 0.5.23 by the
# flash-attention backend alone (layers/attention/flashattention_backend.py builds chunk-local
# metadata, LocalAttentionMetadataBuilder). triton and trtllm_mha (SGLang's Llama-4 default on
# SM100, i.e. GB200) read layer.sliding_window_size, which stays -1 for Llama-4: full causal
# attention, every token past the first chunk from another model (and the hybrid sliding-window
# KV pool SGLang gives Llama-4 evicts entries those kernels still read). fa4 implements it too,
# but SGLang's model hook refuses fa4 for Llama-4 (arg_groups/model_hook.py), and fa3 is built
# for Hopper (compute capability 9.x) only. So a chunked model is served with fa3 on Hopper (the
# default there), or on any GPU with torch_native, which megatron_rl patches to honour the chunk
# (platform/sglang_chunked_attention.py, with --disable-hybrid-swa-memory): correct, but without
# CUDA graphs or paged / fused kernels (one SDPA call per request and layer over its gathered
# KV), so decode is far slower (unmeasured); never chosen without being asked for.
CHUNKED_ATTENTION_BACKENDS = ("fa3", "torch_native")
CHUNKED_ATTENTION_CAPABILITY = 9  # fa3: Hopper (SM90)
# Colocated Llama-4 (release / resume with the memory saver): SGLang builds the q/k norm as
# RMSNorm(has_weight=False), whose weight of ones is a plain tensor attribute allocated in the
# memory saver's weights region. A release frees the region; the resume restores parameters
# (from the weight sync) and buffers (SGLang stashes them) but not that tensor, so q and k would
# be scaled by whatever the memory then holds. SGLang's weights CPU backup copies the whole
# region to host memory at release and back at resume (one copy of the weights in host memory
# per engine rank; the sync overwrites the parameters afterwards anyway).
WEIGHTS_CPU_BACKUP_ARGS = ("--enable-weights-cpu-backup",)


def unused_model_modules(model_path: str) -> list[str] | None:
    """SGLang's model registry imports every module of sglang.srt.models (~250) in each scheduler
    process it starts (~2 s each on an idle 2-core machine, ~10 s under load), whatever the
    model. For a model of the architectures our families serve, the modules it does not need, to
    name in SGLang's own SGLANG_DISABLED_MODEL_ARCHS; None for any other model (all imported)."""
    import importlib.util
    import json

    try:
        architectures = json.loads((Path(model_path) / "config.json").read_text())[
            "architectures"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not architectures or not all(a in _MODEL_MODULES for a in architectures):
        return None
    spec = importlib.util.find_spec("sglang")  # the package's folder, without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    needed = {_MODEL_MODULES[a] for a in architectures}
    models = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    return sorted(p.stem for p in models.glob("*.py")
                  if p.stem not in needed and not p.stem.startswith("_"))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SGLangServerSettings:
    """One SGLang server. Field names are SGLang's server arguments where they exist."""

    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    tp_size: int = 1
    ep_size: int = 1
    dtype: str = "auto"
    mem_fraction_static: float | None = None
    enable_fp32_lm_head: bool = True  # ScaleRL: FP32 logits on the generator too
    attention_backend: str | None = None  # None: SGLang's default (torch_native on CPU)
    device: str | None = None  # None: cuda when available, else cpu
    max_total_tokens: int | None = None
    context_length: int | None = None
    # CPU engines with several ranks (tp_size > 1; ep_size splits the same ranks). SGLang reads
    # rank r's cores from the r-th '|'-separated entry of SGLANG_CPU_OMP_THREADS_BIND and,
    # without it, asserts ranks <= NUMA nodes (one on most machines); and every rank sizes its
    # KV cache from the whole machine's memory (a rank is OOM-killed). None: automatic (the
    # process's cores split evenly across the ranks, `cpu_threads_bind_for`; and, unless
    # mem_fraction_static or max_total_tokens is set, max_total_tokens = cpu_rank_max_total_tokens
    # per rank). Ignored on GPU and at tp_size 1.
    cpu_threads_bind: str | None = None
    cpu_rank_max_total_tokens: int = 16384
    random_seed: int = 0
    sleep_on_idle: bool = True  # the idle scheduler blocks instead of spinning a core at 100%
    # Exact per-token policy versions across in-flight weight updates (Pipeline-RL). SGLang's
    # overlap schedule launches decode step t+1 before it has recorded step t; the step already
    # launched when an update pauses the engine is recorded after the version change, so its
    # token is labelled with the new version though the old weights produced it. Without the
    # overlap schedule every label is exact (docs/generators.md, hazard 1). Set False only for
    # servers whose labels do not matter (evaluation).
    disable_overlap_schedule: bool = True
    # gc.freeze() the start-up objects once healthy: later collections (SGLang runs one at every
    # cache flush on CPU: ~0.4 s with a tiny model's heap) walk only newer objects (~5 ms).
    freeze_gc: bool = True
    # Colocated placement (GPU): SGLang's memory saver, so that released memory is freed for
    # the trainer; and the GPUs the server uses (CUDA_VISIBLE_DEVICES), those of the trainer
    # ranks it shares (None: what the process sees).
    enable_memory_saver: bool = False
    visible_devices: tuple[str, ...] | None = None
    # Routing replay (rollout.routing_replay): SGLang records each token's routed experts and
    # returns them to requests that ask (`SGLangGenerator(return_routed_experts=True)`).
    enable_return_routed_experts: bool = False
    extra_args: tuple[str, ...] = ()  # further SGLang CLI arguments, verbatim
    # Sample each request from its own sampling_seed (rollout.deterministic): on CPU through
    # megatron_rl.platform.sglang_cpu's fix 8, on GPU with --enable-deterministic-inference.
    honour_sampling_seeds: bool = False
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    max_retries: int = 3
    log_path: str | None = None  # None: a temporary file
    # SGLang's --api-key: every endpoint but /health*, /ready and /metrics then refuses a request
    # without it (HTTP 401), weight updates, pause and cache flushes included (SGLang 0.5.23 lets
    # --api-key guard its admin endpoints when no --admin-api-key is set). A run gives all its
    # engines one secret of its own (cluster/launch.py); None: no key (anyone who reaches the
    # port commands the engine). It reaches the server in its environment, not its command line.
    api_key: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"tp_size {self.tp_size} / ep_size {self.ep_size}: both must be >= 1 "
                             "and ep_size must divide tp_size")
        if self.cpu_threads_bind is not None \
                and len(self.cpu_threads_bind.split("|")) != self.tp_size:
            raise ValueError(f"cpu_threads_bind {self.cpu_threads_bind!r}: one '|'-separated "
                             f"core list per rank, {self.tp_size} (tp_size) in all, e.g. "
                             f"{cpu_threads_bind_for(self.tp_size, range(2 * self.tp_size))!r}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable()
                                         or any(c.isspace() for c in self.api_key)):
            raise ValueError("api_key: a non-empty string without spaces or control characters "
                             "(it travels in an HTTP header), e.g. secrets.token_urlsafe(32); "
                             "or None for no key")
        if not Path(self.model_path).exists():
            raise FileNotFoundError(f"model_path {self.model_path} does not exist: point it at an "
                                    "HF model folder (config.json + *.safetensors)")

    @classmethod
    def from_rollout_config(cls, rollout, model_path: str, **fields) -> "SGLangServerSettings":
        """From megatron_rl.config's RolloutConfig (tp_size, ep_size, dtype, ...)."""
        if rollout.backend != "sglang":
            raise ValueError(f"rollout.backend is {rollout.backend!r}; these are SGLang server "
                             "settings (rollout.backend: sglang)")
        if rollout.continuations_first:  # InterruptionSettings.continuation_priority
            fields["extra_args"] = (*fields.get("extra_args", ()),
                                    *CONTINUATIONS_FIRST_ARGS)
        if rollout.deterministic:  # a completion = f(prompt, seed, weights)
            fields["extra_args"] = (*fields.get("extra_args", ()), "--max-running-requests", "1",
                                    "--disable-radix-cache")
            fields["honour_sampling_seeds"] = True
        # Routing replay: MoE models only (a dense model has no routing to return).
        fields.setdefault("enable_return_routed_experts",
                          getattr(rollout, "routing_replay", False) and is_moe_model(model_path))
        fields.setdefault("max_total_tokens", rollout.max_total_tokens)
        return cls(model_path=model_path, tp_size=rollout.tp_size, ep_size=rollout.ep_size,
                   dtype=rollout.dtype, mem_fraction_static=rollout.mem_fraction_static,
                   enable_fp32_lm_head=rollout.enable_fp32_lm_head,
                   attention_backend=rollout.attention_backend,
                   disable_overlap_schedule=rollout.disable_overlap_schedule, **fields)

    @property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def server_args(self, port: int) -> list[str]:
        """SGLang's command-line arguments for this server."""
        device = self.resolved_device
        args = ["--model-path", self.model_path, "--host", self.host, "--port", str(port),
                "--tp-size", str(self.tp_size), "--ep-size", str(self.ep_size),
                "--dtype", self.dtype, "--device", device, "--random-seed", str(self.random_seed),
                "--skip-tokenizer-init", "--skip-server-warmup", "--weight-version", "0"]
        if self.enable_fp32_lm_head:
            args.append("--enable-fp32-lm-head")
        if self.sleep_on_idle:
            args.append("--sleep-on-idle")
        if self.disable_overlap_schedule:
            args.append("--disable-overlap-schedule")
        if self.enable_return_routed_experts:
            args.append("--enable-return-routed-experts")
        if self.enable_memory_saver:
            args.append("--enable-memory-saver")
        if device == "cpu":
            attention_backend = self.attention_backend or "torch_native"
        else:
            attention_backend = gpu_attention_backend(
                self.attention_backend, chunk_size=_attention_chunk_size(self.model_path),
                compute_capability=gpu_compute_capability())
            if self.enable_memory_saver and _has_weightless_qk_norm(self.model_path):
                args += WEIGHTS_CPU_BACKUP_ARGS
        if attention_backend is not None:
            args += ["--attention-backend", attention_backend]
        if ((device == "cpu" or attention_backend == "torch_native")
                and _uses_chunked_attention(self.model_path)):
            # torch_native reads a separate sliding-window KV pool with the wrong slot indices
            # (platform/sglang_chunked_attention.py): one pool for all layers, CPU and GPU.
            args.append("--disable-hybrid-swa-memory")
        if device == "cpu":
            args.append("--disable-cuda-graph")  # no CUDA graphs without CUDA
        elif self.honour_sampling_seeds:  # SGLang's own switch (needs a GPU attention backend)
            args.append("--enable-deterministic-inference")
        max_total_tokens = self.max_total_tokens
        if self._multi_rank_cpu and max_total_tokens is None and self.mem_fraction_static is None:
            max_total_tokens = self.cpu_rank_max_total_tokens  # a bound per rank (see field)
        for flag, value in (("--mem-fraction-static", self.mem_fraction_static),
                            ("--max-total-tokens", max_total_tokens),
                            ("--context-length", self.context_length)):
            if value is not None:
                args += [flag, str(value)]
        return args + list(self.extra_args)

    @property
    def _multi_rank_cpu(self) -> bool:
        return self.resolved_device == "cpu" and self.tp_size > 1

    def cpu_environment(self) -> dict[str, str]:
        """Environment of a multi-rank CPU engine's processes ({} otherwise): the cores of each
        rank (SGLANG_CPU_OMP_THREADS_BIND) and as many torch threads per rank (OMP_NUM_THREADS:
        SGLang's thread binding needs its AMX kernels, so without them every rank would run one
        thread per core of the machine and the ranks would fight over the same cores)."""
        if not self._multi_rank_cpu:
            return {}
        bind = self.cpu_threads_bind or cpu_threads_bind_for(self.tp_size)
        threads = min(_num_cpus(entry) for entry in bind.split("|"))
        return {"SGLANG_CPU_OMP_THREADS_BIND": bind, "OMP_NUM_THREADS": str(max(threads, 1))}


def cpu_threads_bind_for(num_ranks: int, cpus: Sequence[int] | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `num_ranks` ranks over `cpus` (default: the cores this
    process may run on): consecutive equal shares, "0|1" for 2 ranks on 2 cores; with fewer cores
    than ranks, ranks share cores round-robin."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < num_ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(num_ranks))
    share = len(cpus) // num_ranks
    return "|".join(",".join(str(c) for c in cpus[r * share:(r + 1) * share])
                    for r in range(num_ranks))


def _num_cpus(entry: str) -> int:
    """The number of cores in one SGLANG_CPU_OMP_THREADS_BIND entry ("0-3,8" -> 5)."""
    count = 0
    for part in entry.split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def is_moe_model(model_path: str) -> bool:
    """Whether the HF config (or its text_config) has routed experts (num_experts /
    num_local_experts): the models routing replay applies to."""
    import json

    path = Path(model_path) / "config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    return any(c.get("num_experts") or c.get("num_local_experts")
               for c in (config, config.get("text_config") or {}))


def _hf_configs(model_path: str) -> list[dict]:
    """The HF config and its text_config ([] without a config.json)."""
    import json

    path = Path(model_path) / "config.json"
    if not path.is_file():
        return []
    config = json.loads(path.read_text())
    return [config, config.get("text_config") or {}]


def _attention_chunk_size(model_path: str) -> int | None:
    """The HF config's (or its text_config's) attention_chunk_size (Llama-4), else None."""
    return next((c["attention_chunk_size"] for c in _hf_configs(model_path)
                 if c.get("attention_chunk_size")), None)


def _uses_chunked_attention(model_path: str) -> bool:
    """Whether the HF config (or its text_config) sets attention_chunk_size (Llama-4)."""
    return _attention_chunk_size(model_path) is not None


def _has_weightless_qk_norm(model_path: str) -> bool:
    """Whether SGLang builds the model's q/k norm with a weight outside its parameters and
    buffers (Llama-4 with use_qk_norm: see WEIGHTS_CPU_BACKUP_ARGS)."""
    configs = _hf_configs(model_path)
    llama4 = any(a in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
                 for a in (configs[0].get("architectures") or [] if configs else []))
    return llama4 and any(c.get("use_qk_norm") for c in configs)


def gpu_compute_capability() -> tuple[int, int] | None:
    """The compute capability of this node's first GPU, from NVML (no CUDA context: the
    launching process may share the GPU with a trainer rank); None without NVML or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 (no NVML: unknown)
        return None
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(
            pynvml.nvmlDeviceGetHandleByIndex(0))
        return int(major), int(minor)
    except Exception:  # noqa: BLE001
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def gpu_attention_backend(requested: str | None, *, chunk_size: int | None,
                          compute_capability: tuple[int, int] | None) -> str | None:
    """The attention backend of a GPU engine: `requested` (None: SGLang's default) for a model
    without chunked attention; for one with it (`chunk_size`), a backend that honours the chunk
    (CHUNKED_ATTENTION_BACKENDS: fa3 on Hopper, its default there; torch_native, patched, on any
    GPU, only when requested) or a ValueError that names the fixes. `compute_capability` None
    (unknown): fa3, which SGLang refuses loudly off Hopper."""
    if chunk_size is None:
        return requested
    hopper = compute_capability is None or compute_capability[0] == CHUNKED_ATTENTION_CAPABILITY
    where = ("" if compute_capability is None
             else f" on compute capability {compute_capability[0]}.{compute_capability[1]}")
    if requested is not None and requested not in CHUNKED_ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend {requested!r} ignores the model's chunked attention "
            f"(attention_chunk_size {chunk_size}: Llama-4): every token past position "
            f"{chunk_size} would be generated by another model than the trainer's. Set "
            "rollout.attention_backend to fa3 (Hopper GPUs, the default there) or torch_native "
            "(any GPU; correct but slower decode), or leave it unset on Hopper "
            "(docs/generators.md, 'Chunked attention on GPU')")
    if requested == "torch_native":
        return requested
    if not hopper:
        raise ValueError(
            f"no fast attention backend of SGLang 0.5.23 serves the model's chunked attention "
            f"(attention_chunk_size {chunk_size}: Llama-4){where}: trtllm_mha (SGLang's default "
            "there) and triton ignore the chunk, fa4 is refused for Llama-4, and fa3 needs "
            "Hopper (9.x). Either serve the generator engines on Hopper GPUs (H100 / H200, fa3) "
            "or set rollout.attention_backend: torch_native, which megatron_rl patches to "
            "honour the chunk: correct, but with no CUDA graphs and no paged or fused kernels "
            "decode is far slower (unmeasured; unverified on a GPU) (docs/generators.md, "
            "'Chunked attention on GPU')")
    return requested or CHUNKED_ATTENTION_BACKENDS[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (port 0). It comes from the ephemeral range, which
    the kernel also hands to outgoing connections: for a port a server binds later, use
    `listen_port`."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_port(host: str = "127.0.0.1", *, lowest: int = 20000, attempts: int = 64) -> int:
    """A port free on `host` for a server that binds it a little later (an SGLang server, a
    TCPStore), chosen below the ephemeral range: a port from `free_port` can be taken by any
    outgoing connection on the machine before the server binds it (seen in the suite: an SGLang
    server's "[Errno 98] address already in use", and the store's EADDRINUSE)."""
    import random

    highest = _ephemeral_port_floor()
    if highest - lowest < attempts:  # an unusual ephemeral range: let the kernel choose
        return free_port(host)
    for port in random.Random().sample(range(lowest, highest), k=attempts):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


def _log_tail(path: str | None, num_lines: int = 25) -> str:
    if path is None or not os.path.exists(path):
        return "(no server log)"
    lines = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


class SGLangServer:
    """An SGLang server subprocess (its own process group: shutdown ends all its processes)."""

    def __init__(self, settings: SGLangServerSettings, process: subprocess.Popen, port: int,
                 log_path: str, scratch_dir: str | None = None):
        self.settings = settings
        self.process = process
        self.port = port
        self.log_path = log_path
        self.scratch_dir = scratch_dir  # the server's TMPDIR, removed at shutdown

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    @classmethod
    def launch(cls, settings: SGLangServerSettings, *, wait: bool = True) -> "SGLangServer":
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        from megatron_rl.platform.sglang_cpu import SAMPLING_SEEDS_ENV, sglang_cpu_environment

        port = settings.port or listen_port(settings.host)
        log_path = settings.log_path or tempfile.mkstemp(prefix="sglang_", suffix=".log")[1]
        env = dict(os.environ)
        # SGLang names its ZMQ sockets (and multiprocessing its forkserver's) with temporary
        # files that nothing removes: give each server a directory of its own, removed at
        # shutdown. Inductor's compile cache stays where it is shared (its default).
        scratch = tempfile.mkdtemp(prefix="megatron_rl_sglang_")
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
        env["TMPDIR"] = scratch
        if settings.resolved_device == "cpu":
            env.update(sglang_cpu_environment())
            env.update(settings.cpu_environment())
            # Eager on CPU. SGLang torch.compiles a few functions (the MoE top-k, Llama-4's
            # router and RoPE, the seeded sampler): on CPU each is an inductor C++ build at the
            # first request that uses it (seconds, more under load, during which the scheduler
            # answers nothing: /server_info timed out on loaded machines), into one cache under
            # /tmp where a server killed mid-build leaves a truncated .so that crashes every
            # later server. Eager computes the same functions and is fast enough here.
            env["TORCHDYNAMO_DISABLE"] = "1"
            if settings.honour_sampling_seeds:
                env[SAMPLING_SEEDS_ENV] = "1"
        if settings.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(settings.visible_devices)
        if _DISABLED_MODELS_ENV not in env:  # a user's own list stands
            unused = unused_model_modules(settings.model_path)
            if unused:
                env[_DISABLED_MODELS_ENV] = ",".join(unused)
        env.pop(API_KEY_ENV, None)
        if settings.api_key is not None:
            env[API_KEY_ENV] = settings.api_key
        command = [sys.executable, "-m", "megatron_rl.rollout.sglang_launch",
                   *settings.server_args(port)]
        try:
            with open(log_path, "ab") as log:
                # Tied to this process: the server and its children die with it, SIGKILL too.
                process = engine_lifetime.popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env,
                    cwd=str(Path(__file__).resolve().parents[2]), start_new_session=True)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        server = cls(settings, process, port, log_path, scratch_dir=scratch)
        if wait:
            try:
                server.wait_until_healthy()
            except BaseException:
                server.shutdown()
                raise
        return server

    def exit_error(self) -> GeneratorDeadError | None:
        """The error describing an exited server process, or None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        return GeneratorDeadError(f"SGLang server {self.url} exited with code {code}; last log "
                                  f"lines ({self.log_path}):\n{_log_tail(self.log_path)}")

    def wait_until_healthy(self, timeout_s: float | None = None) -> None:
        """Wait for /health; then, with settings.freeze_gc, freeze the start-up objects."""
        wait_for_health(self.url, timeout_s or self.settings.startup_timeout_s,
                        exit_error=self.exit_error, log_path=self.log_path,
                        api_key=self.settings.api_key)
        if self.settings.freeze_gc:
            SGLangGenerator(self.url, server=self).freeze_gc()

    def shutdown(self, timeout_s: float = 20.0, *, graceful: bool | None = None) -> None:
        """End the server and every process of its group, then remove its temporary files.

        graceful (default: on GPU): SIGTERM to the server process alone. SGLang then drains,
        asks its schedulers to release their GPU memory and ends its process tree (a SIGTERM to
        the whole group would kill the schedulers mid-release, and their death sends the server
        into its crash path, which sleeps 5 s before py-spy diagnostics). SIGKILL to the group
        if it has not ended within timeout_s. Not graceful (default on CPU, where there is
        nothing to release): SIGKILL to the group at once."""
        if graceful is None:
            graceful = self.settings.resolved_device != "cpu"
        try:
            if self.process.poll() is not None:
                return  # reaped: its pid, and so its group id, may belong to another process now
            if graceful:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=timeout_s)
                    return  # SGLang ended its own processes before it exited
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(self.process.pid)  # alive, not reaped: the group id is still its own
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass  # unkillable (D state): nothing more to do from here
        finally:
            if self.scratch_dir is not None:
                shutil.rmtree(self.scratch_dir, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process of group `pgid` (a server's: it leads its own session)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for_health(url: str, timeout_s: float, *, exit_error=lambda: None,
                    log_path: str | None = None, poll_s: float = 0.5,
                    api_key: str | None = None) -> None:
    """Poll GET {url}/health until it answers 200; raise GeneratorDeadError as soon as
    `exit_error()` reports an exited process, GeneratorError after `timeout_s`. (SGLang answers
    /health without the API key; it is sent all the same.)"""
    import requests

    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        error = exit_error()
        if error is not None:
            raise error
        try:
            response = requests.get(f"{url}/health", timeout=5, headers=auth_headers(api_key))
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except requests.RequestException as exc:
            last = f"{type(exc).__name__}"
        time.sleep(poll_s)
    raise GeneratorError(f"SGLang server {url} not healthy after {timeout_s:.0f} s ({last}); "
                         f"last log lines ({log_path}):\n{_log_tail(log_path)}")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP headers that carry an engine's API key (SGLang: a bearer token)."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


# SGLang 0.5.23's answer to begin_weight_update while a session is open
# (scheduler_components/weight_updater.py).
_STALE_SESSION = "a weight-update session is already open"


class SGLangGenerator(Generator):
    """The Generator interface over one SGLang server's HTTP API."""

    def __init__(self, url: str, *, num_ranks: int | None = 1,
                 server: SGLangServer | None = None, api_key: str | None = None,
                 request_timeout_s: float = 300.0, max_retries: int = 3,
                 backoff_s: float = 0.5, return_routed_experts: bool = False):
        self.url = url.rstrip("/")
        self.server = server
        # The engine's API key (None: the server's, when given).
        if api_key is None and server is not None:
            api_key = server.settings.api_key
        self._headers = auth_headers(api_key)
        # Ask for every position's routed experts (the server needs
        # enable_return_routed_experts); GenerationResult.routed_experts carries them.
        self.return_routed_experts = return_routed_experts
        self._num_ranks = num_ranks
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._weight_version = 0

    @classmethod
    def launch(cls, settings: SGLangServerSettings) -> "SGLangGenerator":
        server = SGLangServer.launch(settings)
        return cls(server.url, num_ranks=settings.tp_size, server=server,
                   request_timeout_s=settings.request_timeout_s, max_retries=settings.max_retries,
                   return_routed_experts=settings.enable_return_routed_experts)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.shutdown()

    @property
    def num_ranks(self) -> int:
        """The engine ranks that join a weight-update group (SGLang: rank_offset + tp_rank;
        ep_size splits the same ranks). Constructed with num_ranks=None: asked of the server."""
        if self._num_ranks is None:
            self._num_ranks = int(self._request("GET", "/server_info")["tp_size"])
        return self._num_ranks

    @property
    def weight_version(self) -> int:
        return self._weight_version

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, payload: dict | None = None, *,
                 timeout_s: float | None = None, retry: bool = True):
        """One HTTP call; JSON answer (or text). Raises GeneratorDeadError / GeneratorError."""
        import requests

        timeout = timeout_s or self.request_timeout_s
        attempts = self.max_retries + 1 if retry else 1
        for attempt in range(attempts):
            self._raise_if_exited()
            try:
                response = requests.request(method, f"{self.url}{path}", json=payload,
                                            timeout=timeout, headers=self._headers)
            except requests.ConnectionError as exc:
                # Refused / reset before an answer: the server is down or not up yet.
                if attempt + 1 < attempts:
                    time.sleep(self.backoff_s * 2 ** attempt)
                    continue
                self._raise_if_exited()
                raise GeneratorDeadError(
                    f"SGLang server {self.url} does not answer {method} {path} after {attempts} "
                    f"attempt(s): {exc.__class__.__name__}: {exc}") from None
            except requests.Timeout:
                self._raise_if_exited()
                raise GeneratorError(f"SGLang server {self.url}: {method} {path} timed out after "
                                     f"{timeout:.0f} s") from None
            if response.status_code == 401:
                raise GeneratorError(unauthorized_message(self.url, f"{method} {path}",
                                                          bool(self._headers)))
            if response.status_code >= 400:
                raise GeneratorError(f"SGLang server {self.url}: {method} {path} failed with HTTP "
                                     f"{response.status_code}: {_server_message(response)}")
            try:
                return response.json()
            except ValueError:
                return response.text
        raise AssertionError("unreachable")

    def _raise_if_exited(self) -> None:
        if self.failure is not None:
            raise GeneratorDeadError(f"SGLang server {self.url} was failed by the weight sync and "
                                     f"must be restarted: {self.failure}")
        if self.server is not None:
            error = self.server.exit_error()
            if error is not None:
                raise error

    def _post_checked(self, path: str, payload: dict, **kwargs) -> dict:
        """POST to an endpoint answering {"success": bool, "message": str}."""
        answer = self._request("POST", path, payload, **kwargs)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise GeneratorError(f"SGLang server {self.url}: {path} failed: "
                                 f"{answer.get('message')}")
        return answer

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 extra_key: str | None = None) -> list[GenerationResult]:
        if not prompts:
            return []
        _check_extra_key(extra_key)
        items = [(p, k) for p in range(len(prompts)) for k in range(params.num_samples)]
        sampling = []
        for p, k in items:
            item = params.to_sglang()
            if params.seed is not None:
                item["sampling_seed"] = params.seed + p * params.num_samples + k
            sampling.append(item)
        payload = {"input_ids": [list(map(int, prompts[p])) for p, _ in items],
                   "sampling_params": sampling, "return_logprob": True}
        if self.return_routed_experts:
            payload["return_routed_experts"] = True
        if extra_key is not None:
            payload["extra_key"] = extra_key  # one prefix-cache namespace for the whole batch
        outputs = self._request("POST", "/generate", payload)
        if not isinstance(outputs, list) or len(outputs) != len(items):
            raise GeneratorError(f"SGLang server {self.url}: /generate returned "
                                 f"{type(outputs).__name__} for {len(items)} requests")
        return [_generation_result(out, prompts[p], p, k, self.url,
                                   routed_experts=self.return_routed_experts)
                for (p, k), out in zip(items, outputs)]

    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        # logprob_start_len 0 caps SGLang's prefix match at 0 tokens (schedule_batch.py,
        # init_next_round_input): a scored sequence never reuses cached KV of older weights.
        if any(len(seq) < 2 for seq in sequences):
            raise ValueError("score needs sequences of at least 2 tokens")
        payload = {"input_ids": [list(map(int, seq)) for seq in sequences],
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                   "return_logprob": True, "logprob_start_len": 0}
        outputs = self._request("POST", "/generate", payload)
        scores = []
        for seq, out in zip(sequences, outputs):
            entries = out["meta_info"]["input_token_logprobs"]  # [logprob, token id, text]
            if len(entries) != len(seq) or [e[1] for e in entries] != list(seq):
                raise GeneratorError(f"SGLang server {self.url}: prompt log-probs do not cover "
                                     f"the {len(seq)} scored tokens")
            scores.append(torch.tensor([e[0] for e in entries[1:]], dtype=torch.float32))
        return scores

    # ------------------------------------------------------------------ control

    def pause(self, mode: str = "in_place") -> None:
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {_PAUSE_MODES}")
        self._request("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._request("POST", "/continue_generation", {})

    def abort(self) -> None:
        self._request("POST", "/abort_request", {"abort_all": True})

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache", None)

    # Colocated placement: SGLang's memory types, released before a training phase and resumed
    # after it (weights first, so that the weight sync has somewhere to load; then the rest).
    MEMORY_WEIGHTS = ("weights",)
    MEMORY_AFTER_WEIGHTS = ("kv_cache", "cuda_graph")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """SGLang /release_memory_occupation (None: every memory type). The engine must be
        idle. The memory is freed with `--enable-memory-saver` on GPU; on CPU SGLang's memory
        saver is a no-op and only the bookkeeping (cache flush, static state stash) runs."""
        self._post_checked("/release_memory_occupation",
                           {"tags": list(tags) if tags is not None else None})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """SGLang /resume_memory_occupation of `tags` (None: every memory type)."""
        self._post_checked("/resume_memory_occupation",
                           {"tags": list(tags) if tags is not None else None})

    def freeze_gc(self) -> None:
        """Move every object the server holds now out of Python's garbage collection (SGLang's
        /freeze_gc): do it once after start-up so that later collections stay short."""
        self._request("POST", "/freeze_gc", {})

    def check_health(self) -> None:
        # /server_info is answered by the scheduler process itself (a dead or wedged scheduler
        # fails it) in milliseconds; /health runs a one-token generation and polls it once a
        # second, which made every weight sync a second slower.
        self._raise_if_exited()
        self._request("GET", "/server_info", timeout_s=10.0, retry=False)

    def server_weight_version(self) -> str:
        return str(self._request("GET", "/model_info")["weight_version"])

    # ------------------------------------------------------------------ weights

    def begin_weight_update(self) -> None:
        """Open a weight-update session. One left open by a sender that died mid-update (a
        trainer rank killed during a sync; its replacement restores and syncs every weight) is
        ended first: otherwise SGLang refuses every later update of the engine."""
        try:
            self._post_checked("/begin_weight_update", {})
        except GeneratorError as exc:
            if _STALE_SESSION not in str(exc):
                raise
            self._post_checked("/end_weight_update", {})
            self._post_checked("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._post_checked("/end_weight_update", {})

    def init_weight_update_group(self, group: WeightUpdateGroup) -> None:
        self._post_checked("/init_weights_update_group", {
            "master_address": group.master_address, "master_port": group.master_port,
            "rank_offset": group.rank_offset, "world_size": group.world_size,
            "group_name": group.group_name, "backend": group.backend}, retry=False)

    def destroy_weight_update_group(self, group_name: str) -> None:
        self._post_checked("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(self, tensors: Sequence[TensorSpec], *, group_name: str,
                                        version: int | None = None,
                                        flush_cache: bool = True) -> None:
        payload = {
            "names": [t.name for t in tensors], "dtypes": [t.dtype_name for t in tensors],
            "shapes": [list(t.shape) for t in tensors], "group_name": group_name,
            "flush_cache": flush_cache,
            # One broadcast of the bucket's bytes instead of one per tensor.
            "load_format": "flattened_bucket"}
        self._post_checked("/update_weights_from_distributed",
                           _with_version(payload, version), retry=False)
        if version is not None:
            self._weight_version = version

    def update_weights_from_tensors(self, named_tensors: Sequence[tuple[str, torch.Tensor]], *,
                                    version: int | None = None,
                                    flush_cache: bool = True) -> None:
        from megatron_rl.rollout.sglang_tensors import serialize_for_ranks

        # SGLang's contract: one serialisation per engine rank, with SGLang's CUDA reductions.
        self._post_checked("/update_weights_from_tensor", _with_version({
            "serialized_named_tensors": serialize_for_ranks(named_tensors, self.num_ranks),
            "flush_cache": flush_cache}, version), retry=False)
        if version is not None:
            self._weight_version = version

    def update_weights_from_disk(self, model_path: str, *, version: int) -> None:
        self._post_checked("/update_weights_from_disk", {
            "model_path": model_path, "weight_version": str(version)}, retry=False)
        self._weight_version = version

    def set_weight_version(self, version: int) -> None:
        """Label the served weights `version` (/update_weight_version). SGLang records the change
        for every live request at its current output length, so tokens decoded from here on
        carry the new version. Its default aborts every request first: never here."""
        self._post_checked("/update_weight_version", {"new_version": str(version),
                                                      "abort_all_requests": False})
        self._weight_version = version


def unauthorized_message(url: str, request: str, sent_key: bool) -> str:
    """The error for an engine's HTTP 401: the client lacks the key the engine started with."""
    what = "refused the API key sent" if sent_key else "requires an API key and none was sent"
    return (f"SGLang server {url}: {request} was refused (HTTP 401): the server {what}; give "
            "the client the api_key of the server's SGLangServerSettings (a run's engines share "
            "one, made at its start)")


def _with_version(payload: dict, version: int | None) -> dict:
    """A weight-update payload; `weight_version` only when the call itself completes an update
    (a bucket of an in-flight update carries none: SGLang relabels on every loaded bucket)."""
    return payload if version is None else {**payload, "weight_version": str(version)}


def _check_extra_key(extra_key) -> None:
    # SGLang treats "" as no key (io_struct._normalize_extra_key): refuse it rather than
    # silently share the default namespace.
    if extra_key is not None and (not isinstance(extra_key, str) or not extra_key):
        raise ValueError(f"extra_key must be a non-empty string or None, got {extra_key!r}")


def _server_message(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            if key in body:
                value = body[key]
                return value.get("message", str(value)) if isinstance(value, dict) else str(value)
    return str(body)[:2000]


def _version_of(label, url: str) -> int:
    """A policy version reported by the server. Versions feed the staleness bound, so a label
    that is not an integer (a server started without --weight-version reports "default") is an
    error, never a guess."""
    try:
        return int(label)
    except (TypeError, ValueError):
        raise GeneratorError(
            f"SGLang server {url} reports weight version {label!r}, not an integer policy "
            "version: start it with --weight-version 0 (SGLangServerSettings does) and change "
            "versions only through this client's weight updates") from None


def _token_versions(meta: dict, num_tokens: int, url: str) -> tuple[int, ...]:
    """The policy version of every output token, from SGLang's `weight_versions` spans
    ([{version, start, end}] over output tokens, reported for every finished request)."""
    if num_tokens == 0:
        return ()
    spans = meta.get("weight_versions")
    if not spans:
        raise GeneratorError(
            f"SGLang server {url}: a finished request with {num_tokens} output tokens came "
            "without per-token weight versions (meta_info['weight_versions']); the staleness "
            "bound needs them: use SGLang 0.5.23 (requirements/) and a server launched by "
            "SGLangServer")
    versions: list[int | None] = [None] * num_tokens
    for span in spans:
        version = _version_of(span["version"], url)
        for t in range(span["start"], min(span["end"], num_tokens)):
            versions[t] = version
    missing = [t for t, v in enumerate(versions) if v is None]
    if missing:
        raise GeneratorError(
            f"SGLang server {url}: weight-version spans {spans} leave output tokens "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''} of {num_tokens} without a version")
    return tuple(versions)


def _generation_result(out: dict, prompt: Sequence[int], prompt_index: int,
                       sample_index: int, url: str, *,
                       routed_experts: bool = False) -> GenerationResult:
    meta = out["meta_info"]
    token_ids = tuple(int(t) for t in out["output_ids"])
    entries = meta.get("output_token_logprobs") or []
    if [int(e[1]) for e in entries] != list(token_ids):
        raise GeneratorError("SGLang returned output log-probs that do not match its output ids")
    finish = meta.get("finish_reason") or {}
    finish_type = finish.get("type", "abort") if isinstance(finish, dict) else str(finish)
    routed = None
    num_positions = len(prompt) + len(token_ids) - 1  # every token but the last went through
    if meta.get("routed_experts") and num_positions > 0:
        routed = decode_routed_experts(meta["routed_experts"], num_positions,
                                       f"SGLang server {url}, completion of prompt {prompt_index}")
    elif routed_experts and num_positions > 0:
        raise GeneratorError(
            f"SGLang server {url}: asked for routed experts (routing replay) but the response has "
            "none; start the server with enable_return_routed_experts "
            "(--enable-return-routed-experts) or set rollout.routing_replay=false")
    return GenerationResult(
        prompt_index=prompt_index, sample_index=sample_index,
        prompt_token_ids=tuple(int(t) for t in prompt), token_ids=token_ids,
        logprobs=tuple(float(e[0]) for e in entries),
        versions=_token_versions(meta, len(token_ids), url),
        finish_reason=_FINISH_REASONS.get(finish_type, finish_type), routed_experts=routed,
        cached_tokens=None if meta.get("cached_tokens") is None else int(meta["cached_tokens"]))
