"""Prompt order for training: epochs of a seeded shuffle of the prompt set, with ScaleRL's
No-Positive-Resampling. Each prompt's pass-rate history is kept; once a pass rate reaches the
threshold (0.9) the prompt is retired and skipped in every later epoch, since a prompt the policy
nearly always solves has (near) zero-variance groups and wastes generation compute. The whole
state fits in a small dict of plain Python values that goes into the checkpoint; restoring it
reproduces the exact future sequence.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# Pass rates often come from float32 division (9/10 -> 0.8999999762); without this slack such a
# prompt would never reach a 0.9 threshold.
_PASS_RATE_TOLERANCE = 1e-6
_STATE_VERSION = 1


class AllPromptsRetiredError(RuntimeError):
    """Every prompt reached the pass-rate threshold: there is nothing left to draw."""


class NoPositiveResamplingSampler:
    """Draw prompt indices epoch by epoch, skipping retired prompts.

    Every epoch visits each active prompt once, in a permutation of all ``num_prompts`` drawn
    from (seed, epoch) alone, so the order never depends on what was retired. ``enabled=False``
    keeps the history but retires nothing (plain epoch sampling, for ablations).
    """

    def __init__(self, num_prompts: int, *, threshold: float = 0.9, seed: int = 0,
                 enabled: bool = True) -> None:
        if not isinstance(num_prompts, int) or num_prompts <= 0:
            raise ValueError(f"num_prompts must be a positive int, got {num_prompts!r}")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1] (a pass rate), got {threshold}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.num_prompts = num_prompts
        self.threshold = float(threshold)
        self.enabled = bool(enabled)
        self._seed = seed
        self._epoch = 0
        self._position = 0  # next slot of the current epoch's order
        self._order = self._permutation(0)
        self._retired: set[int] = set()
        self._history: dict[int, list[float]] = {}

    @property
    def epoch(self) -> int:
        """Index of the epoch in progress (0-based); a new one starts when the next prompt is
        drawn after the current order is used up."""
        return self._epoch

    @property
    def num_retired(self) -> int:
        return len(self._retired)

    @property
    def num_active(self) -> int:
        return self.num_prompts - len(self._retired)

    def is_retired(self, prompt_id: int) -> bool:
        return prompt_id in self._retired

    def pass_rate_history(self, prompt_id: int) -> list[float]:
        return list(self._history.get(prompt_id, []))

    def sample(self, n: int) -> list[int]:
        """The next ``n`` prompt indices; crosses into new epochs as needed, so a call that spans
        an epoch boundary may contain a prompt twice."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > 0 and self.num_active == 0:
            raise AllPromptsRetiredError(
                f"all {self.num_prompts} prompts are retired by No-Positive-Resampling (each "
                f"reached a pass rate >= {self.threshold} in a trained group), so no prompt is "
                "left to generate from; add harder prompts, raise algorithm.npr_threshold or "
                "set algorithm.no_positive_resampling=false")
        prompt_ids: list[int] = []
        while len(prompt_ids) < n:
            if self._position == self.num_prompts:
                self._epoch += 1
                self._order = self._permutation(self._epoch)
                self._position = 0
            prompt_id = self._order[self._position]
            self._position += 1
            if prompt_id not in self._retired:
                prompt_ids.append(prompt_id)
        return prompt_ids

    def update(self, prompt_ids: Sequence[int] | torch.Tensor,
               pass_rates: Sequence[float] | torch.Tensor) -> set[int]:
        """Record each prompt's pass rate (fraction of its G completions that were correct) and
        retire those at or above the threshold; returns the prompts this call retired."""
        ids = [_as_int(pid) for pid in _to_list(prompt_ids)]
        rates = [float(rate) for rate in _to_list(pass_rates)]
        if len(ids) != len(rates):
            raise ValueError(f"got {len(ids)} prompt ids but {len(rates)} pass rates")
        for prompt_id, rate in zip(ids, rates):
            if not 0 <= prompt_id < self.num_prompts:
                raise ValueError(f"prompt id {prompt_id!r} is not in [0, {self.num_prompts})")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"pass rate {rate} of prompt {prompt_id} is not in [0, 1]; "
                                 "pass the fraction correct, not the reward")
        retired = set()
        for prompt_id, rate in zip(ids, rates):
            self._history.setdefault(prompt_id, []).append(rate)
            if self.enabled and rate + _PASS_RATE_TOLERANCE >= self.threshold \
                    and prompt_id not in self._retired:
                self._retired.add(prompt_id)
                retired.add(prompt_id)
        return retired

    def withdraw(self, prompt_ids: Sequence[int], *, retired: set[int]) -> None:
        """Undo the latest `update` of `prompt_ids` (a batch put back before it was trained:
        RolloutManager.put_back): the newest pass rate of each is forgotten, and the prompts
        that update retired (`retired`, what it returned) are active again."""
        for prompt_id in prompt_ids:
            history = self._history.get(prompt_id)
            if not history:
                raise ValueError(f"prompt {prompt_id} has no pass rate to withdraw")
            history.pop()
            if not history:
                del self._history[prompt_id]
        self._retired -= set(retired)

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (safe for torch.save, JSON after key conversion)."""
        return {
            "version": _STATE_VERSION,
            "num_prompts": self.num_prompts,
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "retired": sorted(self._retired),
            "pass_rate_history": {pid: list(rates) for pid, rates in self._history.items()},
            "threshold": self.threshold,
            "enabled": self.enabled,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore position, seed, retired set and history. ``threshold`` and ``enabled`` stay
        as constructed: they are configuration, and may be changed deliberately on resume."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}; it was written by an incompatible release")
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(f"sampler state is for {state['num_prompts']} prompts but this "
                             f"sampler has {self.num_prompts}; the prompt set changed")
        position = int(state["position"])
        if not 0 <= position <= self.num_prompts:
            raise ValueError(f"sampler state position {position} is outside "
                             f"[0, {self.num_prompts}]")
        self._seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._position = position
        self._order = self._permutation(self._epoch)
        self._retired = {int(pid) for pid in state["retired"]}
        # JSON round trips turn int keys into strings.
        self._history = {int(pid): [float(r) for r in rates]
                         for pid, rates in state["pass_rate_history"].items()}

    def _permutation(self, epoch: int) -> list[int]:
        return np.random.default_rng([self._seed, epoch]).permutation(self.num_prompts).tolist()


def _as_int(value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"prompt ids must be integers, got {value!r}") from None


def _to_list(values: Sequence | torch.Tensor) -> list:
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    return list(values)
