"""Rollout routing replay (R3) in the trainer: each MoE router routes every token to the experts the
generator routed it to, in the forward and in any recompute during backward, per micro-batch.

Why. The generator (bf16 / FP8 kernels, another parallel layout) and the trainer (fp32 or bf16,
Megatron kernels) compute slightly different router logits; where two experts' scores are close,
the top-k choice flips, the token goes through different experts, and its log-prob moves far more
than the numerical noise (a known cause of train / inference mismatch and MoE RL collapse). Replay
fixes the expert choice to the generator's, so both sides' log-probs come from the same experts.

What is replayed: the MASK only. The gating weights over the replayed experts are computed by the
trainer's own router from its own logits (megatron-core's RouterReplay gathers the router's scores
at the replayed indices: `probs = scores.gather(1, indices)`, then the usual normalisation), so the
router keeps receiving gradients and the combine weights are the trainer's function of its own
weights. This is the choice of the R3 paper (Ma et al. 2025, "Stabilizing MoE Reinforcement
Learning by Aligning Training and Inference Routers", arXiv:2510.11370: replay the inference
routing mask, recompute the softmax gating over it in training), and what slime
(`--use-rollout-routing-replay`: per-router top-k indices replayed forward and backward, weights
gathered from the current scores), miles (slime's fork, same R3 path fed by SGLang's
return_routed_experts) and verl (its Megatron router-replay utilities over megatron-core's
RouterReplay, R2 / R3 modes) do. Replaying the generator's weights too would cut the router out of
the gradient and replay bf16 rounding the trainer's loss does not see.

Mechanics. megatron-core 0.19.2 calls `router.router_replay.get_replay_topk(...)` from
`topk_routing_with_score_function` when `moe_enable_routing_replay` is set. `RoutingReplay`
replaces each router's instance by `TrainerRouterReplay`, a RouterReplay subclass that (1) replays
the installed indices in the forward and, inside autograd's backward (activation recompute), pops
them in forward order, as RouterReplay's REPLAY_BACKWARD does, which matches 1F1B's order; (2)
counts, in the same forward, the decisions where the trainer's own top-k differs from the
generator's (the routing-flip metric); (3) keeps the indices the router used (tests check them).
Layout: a micro-batch's table is [b, s, layers * top_k]; a router sees its tokens s-major
([s, b] flattened, Megatron's [s, b, h] order), only its sequence-parallel slice of s, and only
its own layers (pipeline stages hold different layers: `router.layer_number` is global, 1-based;
SGLang numbers layers from 0 over all decoder layers). Padding positions get the dummy experts
0 .. top_k - 1 (any valid distinct ids: causal attention keeps them out of real tokens' outputs,
and they carry no loss). Ids are validated per layer: a table of the wrong width or an id outside
[0, num_experts) is an error naming the layer, never silently routed.
"""
from __future__ import annotations

import dataclasses

import torch

REPLAY = "replay"  # route through the generator's experts
OBSERVE = "observe"  # route through the trainer's own experts; only count flips


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _make_replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class TrainerRouterReplay(RouterReplay):
        """megatron-core's RouterReplay for one layer, with the mode set per micro-batch and a
        flip count (see the module docstring). Not registered in RouterReplay's global list:
        the trainer addresses its routers through its own model."""

        def __init__(self, layer_index: int):
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)
            self.layer_index = layer_index  # 0-based global layer (the generator's layer id)
            self.mode: str | None = None
            self.valid: torch.Tensor | None = None  # [tokens] bool, False on padding
            self.num_flips = 0
            self.num_decisions = 0

        def install(self, indices: torch.Tensor, valid: torch.Tensor, mode: str) -> None:
            self.set_target_indices(indices)  # also queued for a recompute in backward
            self.valid, self.mode = valid, mode

        def clear(self) -> None:
            self.clear_indices()
            self.valid, self.mode = None, None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            if self.mode is None or self.target_topk_idx is None:
                return default_compute_topk(scores, topk, num_groups, group_topk)
            if _in_backward():  # activation recompute: this micro-batch's indices, FIFO
                target = self.replay_backward_list.pop(0)
                if self.mode == OBSERVE:
                    return default_compute_topk(scores, topk, num_groups, group_topk)
                return scores.gather(1, target), target
            target = self.target_topk_idx  # [tokens, top_k] int64
            if target.shape != (scores.shape[0], topk):
                raise ValueError(
                    f"routing replay, layer {self.layer_index}: {tuple(target.shape)} indices "
                    f"for {scores.shape[0]} tokens x top-{topk} (sequence-parallel slice or "
                    "micro-batch layout mismatch)")
            own_probs, own = default_compute_topk(scores, topk, num_groups, group_topk)
            with torch.no_grad():
                flipped = (own.sort(dim=1).values != target.sort(dim=1).values).any(dim=1)
                self.num_flips += int((flipped & self.valid).sum())
                self.num_decisions += int(self.valid.sum())
            if self.mode == OBSERVE:
                probs, used = own_probs, own
            else:
                probs, used = scores.gather(1, target), target
            self.recorded_topk_idx = used.detach()
            return probs, used

    return TrainerRouterReplay


@dataclasses.dataclass(frozen=True, slots=True)
class FlipCount:
    num_flips: int
    num_decisions: int

    @property
    def fraction(self) -> float:
        return self.num_flips / self.num_decisions if self.num_decisions else float("nan")


class RoutingReplay:
    """The routers of one model chunk and the installation of a micro-batch's expert table."""

    def __init__(self, model, config, *, tp_rank: int, tp_size: int):
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_rl.trainer.model import unwrap

        replay_class = _make_replay_class()
        self.num_layers = config.num_layers
        self.top_k = config.moe_router_topk
        self.num_experts = config.num_moe_experts
        self.sequence_parallel = bool(config.sequence_parallel) and tp_size > 1
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.routers = sorted((m for m in unwrap(model).modules() if isinstance(m, TopKRouter)),
                              key=lambda m: m.layer_number)
        for router in self.routers:
            router.router_replay = replay_class(router.layer_number - 1)

    @property
    def width(self) -> int:
        """Columns of an expert table: every decoder layer's top-k (dense layers included, as
        SGLang returns them)."""
        return self.num_layers * self.top_k

    def install(self, micro_batch, mode: str) -> None:
        """Hand this micro-batch's experts to every router of this stage (call right before the
        micro-batch's forward). A micro-batch without a table (a padding micro-batch of a rank
        with less data) routes dummy experts in REPLAY mode and is not counted."""
        rows, length = micro_batch.input_ids.shape
        valid = ~micro_batch.padding_mask  # [b, s]
        table = micro_batch.routed_experts
        if table is None:
            valid = torch.zeros_like(valid)
            table = torch.zeros(rows, length, self.width, dtype=torch.int64, device=valid.device)
        elif table.shape != (rows, length, self.width):
            raise ValueError(
                f"routing replay: expert table {tuple(table.shape)}, expected [{rows}, {length}, "
                f"{self.num_layers} layers x top-{self.top_k} = {self.width}]: the generator's "
                "layer count or top-k differs from the trainer's model")
        table = table.transpose(0, 1)  # [s, b, w]: Megatron's token order
        valid = valid.transpose(0, 1)
        if self.sequence_parallel:
            chunk = length // self.tp_size
            table = table[self.tp_rank * chunk:(self.tp_rank + 1) * chunk]
            valid = valid[self.tp_rank * chunk:(self.tp_rank + 1) * chunk]
        table = table.reshape(-1, self.num_layers, self.top_k).long()  # [tokens, layers, k]
        valid = valid.reshape(-1)
        dummy = torch.arange(self.top_k, device=table.device).expand(table.shape[0], -1)
        for router in self.routers:
            layer = router.layer_number - 1
            ids = table[:, layer]
            checked = ids[valid]
            if checked.numel() and (int(checked.min()) < 0
                                    or int(checked.max()) >= self.num_experts):
                raise ValueError(
                    f"routing replay, layer {layer}: expert ids in [{int(checked.min())}, "
                    f"{int(checked.max())}] but the model has {self.num_experts} experts; the "
                    "generator's expert numbering does not match the trainer's")
            if self.top_k > 1 and checked.numel() and bool(
                    (checked.sort(dim=1).values.diff(dim=1) == 0).any()):
                raise ValueError(f"routing replay, layer {layer}: a token lists the same expert "
                                 "twice (is this a dense layer in the generator?)")
            ids = torch.where(valid.unsqueeze(1), ids, dummy)
            router.router_replay.install(ids.contiguous(), valid, mode)

    def clear(self) -> None:
        for router in self.routers:
            router.router_replay.clear()

    def used_indices(self) -> dict[int, torch.Tensor]:
        """{0-based layer: [tokens, top_k] the indices its router used in the last forward}."""
        return {r.layer_number - 1: r.router_replay.recorded_topk_idx for r in self.routers}

    def take_flip_count(self) -> FlipCount:
        """This rank's counts since the last call (and reset them)."""
        flips = sum(r.router_replay.num_flips for r in self.routers)
        decisions = sum(r.router_replay.num_decisions for r in self.routers)
        for router in self.routers:
            router.router_replay.num_flips = router.router_replay.num_decisions = 0
        return FlipCount(flips, decisions)
