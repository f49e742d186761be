"""The typed rollout sample that travels from the generators to the trainer, and how it is
assembled from the segments of its generation (SCALERL.md sections 5 and 7).

A completion may take more than one generation request: with forced interruption, the thinking
part is cut at its budget, the interruption phrase is appended (not sampled: loss mask 0, no
behaviour log-prob, no policy version) and a second request writes the answer. Under Pipeline-RL
each token may come from a different policy version (weights change in flight), so every sampled
token keeps the version that produced it and its behaviour log-prob; CISPO's importance ratio and
the staleness bound read them from here.

With routing replay (rollout.routing_replay, docs/routing_replay.md) a sample also carries the
experts the generator routed every position to, one compact table for prompt + completion: row t
holds position t's expert ids (layer-major, top-k per layer). Each request returns the rows of its
whole input (prefix and output but the last token); `assemble_sample` keeps, for the positions
whose outputs a request sampled, that request's rows, i.e. the routing under which each behaviour
log-prob was computed.

A multi-turn trajectory (rollout/multi_turn.py) is one sample too: its turns are sampled segments
and the environment's observations between them inserted ones (loss mask 0, like the phrase);
`RolloutSample.trajectory` then holds its statistics.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_rl.rollout.multi_turn import TrajectoryStats

# Stands in a per-token version list for tokens no policy produced (the interruption phrase).
NOT_SAMPLED = -1


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """A contiguous run of completion tokens: one generation request's output (`sampled`) or
    inserted text such as the interruption phrase (not sampled)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()  # behaviour log-probs, sampled segments only
    versions: tuple[int, ...] = ()  # policy version per token, sampled segments only
    sampled: bool = True
    # The request's routed experts (routing replay): [len(request input) + len(token_ids) - 1,
    # layers * top_k] uint8/uint16, GenerationResult.routed_experts; sampled segments only.
    routed_experts: torch.Tensor | None = None
    # The request's input tokens served by the prefix cache (GenerationResult.cached_tokens;
    # its input is the prompt and the completion before this segment); None: not reported.
    cached_tokens: int | None = None

    @classmethod
    def from_generation(cls, result) -> "Segment":
        """The sampled segment of one request's GenerationResult."""
        return cls(token_ids=result.token_ids, logprobs=result.logprobs,
                   versions=result.versions, routed_experts=result.routed_experts,
                   cached_tokens=result.cached_tokens)

    def __post_init__(self) -> None:
        if self.sampled and not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(f"sampled segment: {len(self.token_ids)} tokens, "
                             f"{len(self.logprobs)} log-probs, {len(self.versions)} versions")
        if not self.sampled and (self.logprobs or self.versions):
            raise ValueError("an inserted segment has no log-probs or versions (no policy "
                             "sampled it)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSample:
    """One completion of one prompt, ready for scoring and training. Per-token lists cover the
    completion only (prompt excluded); `loss_mask` is 0 on inserted tokens, whose `logprobs`
    are 0.0 and `versions` NOT_SAMPLED."""

    group_id: int  # the prompt's group (G samples share it)
    sample_index: int  # 0 .. G - 1
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    loss_mask: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "abort" of the last request
    interrupted: bool  # the interruption phrase was appended
    segment_offsets: tuple[int, ...]  # start of each segment in the completion
    thinking_budget: int | None = None  # the drawn budget (None: no forced interruption)
    # Routing replay: [len(prompt) + len(completion) - 1, layers * top_k] uint8/uint16 expert
    # ids per position (the last token's routing is never computed); None without replay.
    routed_experts: torch.Tensor | None = None
    # A multi-turn trajectory's statistics (turns, tool calls, prefill vs decode tokens); None
    # for a single-turn completion.
    trajectory: TrajectoryStats | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n:
            raise ValueError(f"sample {self.group_id}/{self.sample_index}: {n} tokens but "
                             f"{len(self.logprobs)} log-probs, {len(self.versions)} versions, "
                             f"{len(self.loss_mask)} mask entries")
        if self.routed_experts is not None:
            from megatron_rl.rollout.types import check_routed_experts_rows

            check_routed_experts_rows(self.routed_experts, len(self.prompt_token_ids) + n - 1,
                                      f"sample {self.group_id}/{self.sample_index}")

    @property
    def sampled_versions(self) -> tuple[int, ...]:
        return tuple(v for v, m in zip(self.versions, self.loss_mask) if m)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy that produced a token of this sample (None: no sampled token)."""
        versions = self.sampled_versions
        return min(versions) if versions else None

    @property
    def newest_version(self) -> int | None:
        versions = self.sampled_versions
        return max(versions) if versions else None

    @property
    def num_loss_tokens(self) -> int:
        """|y_i| of SCALERL.md section 3: generated tokens, inserted ones excluded."""
        return sum(self.loss_mask)

    @property
    def truncated(self) -> bool:
        """Hit the hard length limit without finishing (a first-class metric: > 10-15% is
        unstable training)."""
        return self.finish_reason == "length"


def truncate_segments(segments: Sequence[Segment], num_tokens: int) -> list[Segment]:
    """The first `num_tokens` completion tokens of `segments` (a completion cut at a limit, as if
    generation had stopped there): a sampled token's log-prob and version do not depend on the
    tokens after it; a cut request keeps the routed-expert rows of the positions it keeps."""
    kept: list[Segment] = []
    for segment in segments:
        room = num_tokens - sum(len(s.token_ids) for s in kept)
        if room <= 0:
            break
        if len(segment.token_ids) <= room:
            kept.append(segment)
            continue
        cut = len(segment.token_ids) - room
        rows = segment.routed_experts
        kept.append(dataclasses.replace(
            segment, token_ids=segment.token_ids[:room], logprobs=segment.logprobs[:room],
            versions=segment.versions[:room],
            routed_experts=None if rows is None else rows[:rows.shape[0] - cut]))
    return kept


def assemble_sample(*, group_id: int, sample_index: int, prompt_token_ids: Sequence[int],
                    segments: Sequence[Segment], finish_reason: str,
                    thinking_budget: int | None = None, interrupted: bool | None = None,
                    trajectory: TrajectoryStats | None = None) -> RolloutSample:
    """The sample of a completion made of `segments`, in order. `interrupted`: whether the
    interruption phrase was appended (None: any inserted segment is the phrase, as in a
    single-turn completion; a trajectory's observations are inserted too)."""
    token_ids, logprobs, versions, mask, offsets = [], [], [], [], []
    for segment in segments:
        offsets.append(len(token_ids))
        token_ids += segment.token_ids
        if segment.sampled:
            logprobs += segment.logprobs
            versions += segment.versions
            mask += [1] * len(segment.token_ids)
        else:
            logprobs += [0.0] * len(segment.token_ids)
            versions += [NOT_SAMPLED] * len(segment.token_ids)
            mask += [0] * len(segment.token_ids)
    return RolloutSample(
        group_id=group_id, sample_index=sample_index,
        prompt_token_ids=tuple(int(t) for t in prompt_token_ids), token_ids=tuple(token_ids),
        logprobs=tuple(logprobs), versions=tuple(versions), loss_mask=tuple(mask),
        finish_reason=finish_reason,
        interrupted=(any(not s.sampled for s in segments) if interrupted is None
                     else interrupted),
        segment_offsets=tuple(offsets), thinking_budget=thinking_budget, trajectory=trajectory,
        routed_experts=_merge_routed_experts(len(prompt_token_ids), segments, offsets,
                                             len(token_ids)))


def _merge_routed_experts(num_prompt: int, segments: Sequence[Segment],
                          offsets: Sequence[int], num_tokens: int) -> torch.Tensor | None:
    """One table for the whole sample: the first request's rows, then from each later request
    the rows from the position that predicted its first token on (its behaviour log-probs were
    computed under that routing). Rows after the last request (an inserted tail) repeat its last
    row: they precede no sampled token, so their routing changes no trained log-prob. A
    trajectory's observation is such a gap: its positions' rows come from the next turn's first
    request, which read it as input."""
    sampled = [(s, o) for s, o in zip(segments, offsets) if s.sampled and s.token_ids]
    if not sampled or all(s.routed_experts is None for s, _ in sampled):
        return None
    if any(s.routed_experts is None for s, _ in sampled):
        raise ValueError("some requests of a sample returned routed experts and others did not; "
                         "routing replay needs them from every request")
    table = None
    for segment, offset in sampled:
        start = num_prompt + offset - 1  # the position predicting the segment's first token
        rows = segment.routed_experts
        if rows.shape[0] != start + len(segment.token_ids):
            raise ValueError(f"a request's routed experts have {rows.shape[0]} rows; its input "
                             f"and output cover {start + len(segment.token_ids)} positions")
        # Positions between the two requests (an inserted phrase) only the later one computed.
        keep = 0 if table is None else min(start, table.shape[0])
        table = rows if table is None else torch.cat([table[:keep], rows[keep:]])
    missing = num_prompt + num_tokens - 1 - table.shape[0]
    if missing > 0:
        table = torch.cat([table, table[-1:].expand(missing, -1)])
    return table
