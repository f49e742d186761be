"""The generator interface the RL loop and the weight sync program against.

A generator turns prompt token ids into sampled completions with per-token log-probs and policy
versions, scores fixed token sequences, pauses in place and continues (Pipeline-RL in-flight
updates keep the KV cache), and takes new weights in one of three ways: broadcast over a
torch.distributed group it joined (`init_weight_update_group` + `update_weights_from_distributed`),
tensors handed over in memory when colocated (`update_weights_from_tensors`), or an HF folder on
disk (`update_weights_from_disk`). Every weight update runs between `begin_weight_update()` and
`end_weight_update()`; the buckets of an in-flight update carry no version, and
`set_weight_version` labels the new weights once all of them have loaded. `weight_version` is the
integer policy version of the weights it serves. A generator the weight sync had to give up on
(`mark_failed`: a partially loaded model, left paused) refuses every later call. SGLang
implements it in sglang_server.py; a different engine implements the same methods.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from megatron_rl.rollout.types import GenerationResult, SamplingParams, TensorSpec, \
    WeightUpdateGroup


class Generator(abc.ABC):
    """One inference engine (possibly several devices: `num_ranks` TP ranks)."""

    @property
    @abc.abstractmethod
    def num_ranks(self) -> int:
        """Ranks it contributes to a weight-update group (its tensor-parallel size)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Policy version of the weights it serves (0 = the weights it started with)."""

    @abc.abstractmethod
    def set_weight_version(self, version: int) -> None:
        """Label the weights it serves `version` once every bucket of an update has loaded (the
        coordinator of a sync calls it after all pipeline stages have sent): tokens decoded
        from then on carry `version`; running requests are not aborted."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 extra_key: str | None = None) -> list[GenerationResult]:
        """`params.num_samples` completions per prompt, in (prompt, sample) order. Each token's
        log-prob is log softmax(logits / params.temperature) of the untruncated distribution;
        params with purpose "train" (SamplingParams) guarantee that this is the distribution the
        token was sampled from. `extra_key` namespaces the prefix cache: requests reuse cached
        KV only of requests with the same key. Pipeline-RL passes the admission version, so a
        request never starts from KV that older weights computed (docs/generators.md)."""

    @abc.abstractmethod
    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """log pi(seq[t] | seq[:t]) for t = 1 .. len - 1 of each sequence: [len - 1] fp32 each."""

    @abc.abstractmethod
    def pause(self, mode: str = "in_place") -> None:
        """Stop decoding. "in_place" keeps running requests and their KV cache; "retract" moves
        them back to the queue (KV recomputed); "abort" ends them."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Continue decoding after `pause`."""

    @abc.abstractmethod
    def begin_weight_update(self) -> None: ...

    @abc.abstractmethod
    def end_weight_update(self) -> None: ...

    @abc.abstractmethod
    def init_weight_update_group(self, group: WeightUpdateGroup) -> None:
        """Join the sender's group (blocks until every rank of the group has joined)."""

    @abc.abstractmethod
    def destroy_weight_update_group(self, group_name: str) -> None: ...

    @abc.abstractmethod
    def update_weights_from_distributed(self, tensors: Sequence[TensorSpec], *, group_name: str,
                                        version: int | None = None,
                                        flush_cache: bool = True) -> None:
        """Receive one bucket (its tensors packed back to back as bytes) broadcast from rank 0
        of `group_name` and load it. Blocks until the sender has broadcast the bucket. A
        `version` labels the weights as soon as this bucket has loaded: only for a one-bucket
        update; the weight sync passes None and calls `set_weight_version` after the last."""

    @abc.abstractmethod
    def update_weights_from_tensors(self, named_tensors: Sequence[tuple[str, torch.Tensor]], *,
                                    version: int | None = None,
                                    flush_cache: bool = True) -> None:
        """Load HF-named tensors handed over in memory (colocated trainer and generator);
        `version` as in `update_weights_from_distributed`."""

    @abc.abstractmethod
    def update_weights_from_disk(self, model_path: str, *, version: int) -> None:
        """Reload every weight from an HF folder."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Abort every running and queued request (they return with finish reason "abort")."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop the prefix (KV) cache; fails while requests run."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise GeneratorDeadError if the engine is gone or does not answer."""

    def mark_failed(self, reason: str) -> None:
        """The weight sync gave up on this generator: it may hold a partially loaded model and
        stays paused (never resumed on it). Every later call raises GeneratorDeadError naming it
        and `reason`; restarting it is up to whoever launched it."""
        self._failure = reason

    @property
    def failure(self) -> str | None:
        """Why the weight sync failed this generator (`mark_failed`), or None."""
        return getattr(self, "_failure", None)

    def is_healthy(self) -> bool:
        from megatron_rl.rollout.types import GeneratorError

        try:
            self.check_health()
        except GeneratorError:
            return False
        return True
