"""Typed messages between the RL driver and the generators: sampling parameters, generation and
scoring results (token ids, per-token log-probs of the sampled tokens, per-token policy versions),
and the tensor metadata of a weight update. Nothing crosses a process boundary as an untyped dict:
the SGLang client turns these into SGLang's own JSON payloads and back.
"""
from __future__ import annotations

import dataclasses
import math

import torch


class GeneratorError(RuntimeError):
    """A generator call failed; the message carries the server's own error text."""


class GeneratorDeadError(GeneratorError):
    """The generator's server is gone (process exited, or it no longer answers health checks)."""


_PURPOSES = ("train", "eval")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How completions are sampled (SGLang's sampling_params names). temperature 0 = greedy.

    `purpose` "train" (the default) is for rollouts whose log-probs enter the RL loss: SGLang
    records log softmax(logits / T) of the untruncated distribution (sglang/srt/layers/
    sampler.py) and the trainer scores the same, but top_p < 1, top_k > 0, min_p > 0 and greedy
    decoding (SGLang's top_k = 1) sample from a truncated distribution whose log-probs are not
    the recorded ones, which biases every importance ratio; so they are refused. "eval" allows
    them: evaluation log-probs feed no ratio.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    min_p: float = 0.0  # 0: no min-p cut
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_samples: int = 1  # completions per prompt (G of the group)
    # Sampling seed. Where SGLang honours it (--enable-deterministic-inference on GPU, or
    # rollout.deterministic on CPU: platform/sglang_cpu.py fix 8) a seeded request's noise comes
    # from (seed, position, token) alone (sglang/srt/layers/sampler.py multinomial_with_seed), so
    # two requests with one seed and one prompt sample the SAME completion: every sample of a
    # group needs its own seed (`for_sample`). Elsewhere SGLang samples from the engine's stream.
    seed: int | None = None
    purpose: str = "train"  # train | eval; not sent to SGLang

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (no cut) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.purpose not in _PURPOSES:
            raise ValueError(f"purpose must be one of {_PURPOSES}, got {self.purpose!r}")
        if self.purpose == "train":
            self._refuse_truncation_for_training()

    def _refuse_truncation_for_training(self) -> None:
        truncations = [name for name, on in (
            (f"top_p={self.top_p}", self.top_p < 1.0), (f"top_k={self.top_k}", self.top_k > 0),
            (f"min_p={self.min_p}", self.min_p > 0.0),
            ("temperature=0 (greedy, SGLang's top_k=1)", self.temperature == 0)) if on]
        if truncations:
            raise ValueError(
                f"SamplingParams for training rollouts cannot use {', '.join(truncations)}: "
                "SGLang samples from the truncated distribution but records the log-probs of "
                "the full softmax(logits / temperature), which the trainer also scores, so the "
                "importance ratios pi_train / pi_gen of the sampled tokens would be biased. Use "
                "top_p=1, top_k=-1, min_p=0 and temperature > 0 for training, or "
                "purpose='eval' for evaluation sampling, whose log-probs feed no ratio")

    @classmethod
    def for_training(cls, rollout, *, max_new_tokens: int, **fields) -> "SamplingParams":
        """Training-rollout sampling from megatron_rl.config's RolloutConfig: its temperature
        (the trainer scores log softmax(logits / T) with the same value) and top_p (1.0: the
        config refuses anything else), G = samples_per_prompt completions per prompt."""
        return cls(max_new_tokens=max_new_tokens, temperature=rollout.temperature,
                   top_p=rollout.top_p, num_samples=rollout.samples_per_prompt,
                   purpose="train", **fields)

    def for_sample(self, *key: object) -> "SamplingParams":
        """These parameters with a seed of this sample's own, derived from `seed` and `key`
        (e.g. the group id and sample index); unseeded parameters stay unseeded (SGLang's own
        random stream already differs per request)."""
        if self.seed is None:
            return self
        return dataclasses.replace(self, seed=derive_seed(self.seed, *key))

    def to_sglang(self) -> dict:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k, "ignore_eos": self.ignore_eos}
        if self.min_p > 0.0:
            params["min_p"] = self.min_p
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GenerationResult:
    """One completion of one prompt."""

    prompt_index: int  # position of the prompt in the request
    sample_index: int  # 0 .. num_samples - 1
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # the sampled completion
    logprobs: tuple[float, ...]  # log pi_gen(token_ids[t] | prefix), one per completion token
    versions: tuple[int, ...]  # the policy (weight) version that produced each completion token
    finish_reason: str  # "stop" | "length" | "abort"
    # Routing replay (rollout.routing_replay): the experts every MoE layer routed each position
    # of prompt + completion to, except the last token's (never fed back): [len(prompt) +
    # len(completion) - 1, num_layers * top_k] uint8 / uint16 (`compact_expert_ids`), row t =
    # position t, columns layer-major (layer 0's top-k ids, then layer 1's, ...; zeros on dense
    # layers). None when not requested.
    routed_experts: torch.Tensor | None = None
    # Input tokens SGLang's prefix cache served (meta_info["cached_tokens"]: the request's prefix
    # matched in the radix cache, sglang/srt/managers/schedule_batch.py
    # ScheduleBatch.prepare_for_extend, reported by tokenizer_manager.py
    # TokenizerManager._handle_batch_output); the request's prefill is input - cached. None:
    # not reported.
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"completion of prompt {self.prompt_index} has {len(self.token_ids)} tokens, "
                f"{len(self.logprobs)} log-probs and {len(self.versions)} versions; they must match")
        if self.routed_experts is not None:
            check_routed_experts_rows(self.routed_experts,
                                      len(self.prompt_token_ids) + len(self.token_ids) - 1,
                                      f"completion of prompt {self.prompt_index}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """Name (HF), dtype and shape of one tensor of a weight-update bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightUpdateGroup:
    """Where the trainer-side sender of one weight-update group listens (it is rank 0 of the
    group; a generator's TP ranks are ranks rank_offset .. rank_offset + tp_size - 1)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str  # "gloo" on CPU, "nccl" on GPU


def logprob_mismatch(train_logprobs: torch.Tensor, generator_logprobs: torch.Tensor) -> float:
    """Mean |logp_train - logp_gen| per token (SCALERL.md section 6), over two aligned [tokens]
    vectors; the trainer reports the same quantity per step as StepMetrics.logp_mismatch."""
    if train_logprobs.shape != generator_logprobs.shape:
        raise ValueError(f"log-prob vectors differ in shape: {tuple(train_logprobs.shape)} vs "
                         f"{tuple(generator_logprobs.shape)}")
    if train_logprobs.numel() == 0:
        raise ValueError("no tokens to compare")
    return float((train_logprobs.double() - generator_logprobs.double()).abs().mean())


def derive_seed(*key: object) -> int:
    """A 31-bit seed from `key`, stable across processes and Python versions (no hash())."""
    import hashlib

    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def compact_expert_ids(ids) -> torch.Tensor:
    """Expert ids (any integer array) in the smallest unsigned dtype that holds them: uint8 up
    to 256 experts, uint16 up to 65536 (1 or 2 bytes per token x layer x top-k)."""
    ids = torch.as_tensor(ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= 2**16):
        raise ValueError(f"expert ids must be in [0, 65536), got [{int(ids.min())}, "
                         f"{int(ids.max())}]")
    small = ids.numel() == 0 or int(ids.max()) < 2**8
    return ids.to(torch.uint8 if small else torch.uint16)


def check_routed_experts_rows(routed: torch.Tensor, num_rows: int, what: str) -> None:
    """Routed experts must be a 2-D [positions, layers x top-k] table with one row per position
    the generator computed (all tokens but the last)."""
    compact = routed.dtype in (torch.uint8, torch.uint16)
    if routed.dim() != 2 or routed.shape[0] != num_rows or not compact:
        raise ValueError(f"{what}: routed experts {tuple(routed.shape)} {routed.dtype}, expected "
                         f"[{num_rows}, num_layers * top_k] uint8/uint16 (one row per position "
                         "but the last)")


def decode_routed_experts(encoded: str, num_rows: int, what: str) -> torch.Tensor:
    """SGLang's meta_info["routed_experts"] (base64 of int32 [rows, num_layers, top_k],
    sglang/srt/state_capturer/routed_experts.py) as a compact [rows, num_layers * top_k] table."""
    import base64

    import numpy as np

    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if num_rows < 1 or flat.size % num_rows:
        raise ValueError(f"{what}: {flat.size} routed-expert ids do not split into {num_rows} "
                         "positions (prompt + completion - 1)")
    return compact_expert_ids(torch.from_numpy(flat.copy()).reshape(num_rows, -1))
