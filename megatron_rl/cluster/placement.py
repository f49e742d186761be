"""Where the trainer ranks and the generator engines run: the layout (`ClusterLayout`: how many of
each, devices per generator, colocated or disaggregated) and the one Ray placement group that
reserves it (`Placement`).

Bundles, in order: one per trainer rank (bundle index = rank), then one per generator engine.
On GPU a trainer rank's bundle is {GPU: 1, CPU: c} and an engine's is {GPU: devices_per_generator,
CPU: c} (a bundle lives on one node, so an engine's tensor-parallel GPUs share a node); on CPU the
bundles hold CPUs only. Disaggregated placement gives every actor its own bundle.

Colocated placement: trainer ranks and engines share devices, one bundle per trainer rank holding
that rank (its GPU) and a CPU share of an engine; engine i runs in the bundle of trainer rank
i x devices_per_generator and its server is given the GPUs of ranks [i x d, (i + 1) x d) (Ray
reports them; they must be on one node). Generation and training alternate: the run releases the
engines' memory (SGLang /release_memory_occupation) before each training phase and resumes it
after (megatron_rl/run_setup.py), so the schedule must be synchronous (rollout.max_off_policyness
0, or ppo_off_policy). On CPU the same layout shares the CPUs and SGLang's release is a no-op for
memory (its memory saver is CUDA-only) but runs the same calls.

Node roles (multi-node, disaggregated): a node started with the custom Ray resource
TRAINER_NODE_RESOURCE (`ray start --resources '{"megatron_rl_trainer": 4}'`, one unit per GPU it
gives the trainer) takes only trainer ranks, one with GENERATOR_NODE_RESOURCE only engines: with
`node_roles` each trainer bundle also asks for one unit of the first and each engine bundle for
devices_per_generator units of the second, so Ray can place them nowhere else. The roles are
declared where the nodes are started (examples/launch/); `RayCluster.reserve` turns them on when
the cluster offers both resources (`node_roles` None), so recipes need no node names.
"""
from __future__ import annotations

import dataclasses
from typing import Any

_DEVICES = ("cpu", "gpu")
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TRAINER_NODE_RESOURCE = "megatron_rl_trainer"  # custom Ray resource of nodes for trainer ranks
GENERATOR_NODE_RESOURCE = "megatron_rl_generator"  # ... of nodes for generator engines
_SHOWN_RESOURCES = ("CPU", "GPU", TRAINER_NODE_RESOURCE, GENERATOR_NODE_RESOURCE)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClusterLayout:
    """The actors of one RL run and the resources each one reserves."""

    num_trainer_ranks: int  # parallelism.world_size: one Ray actor per Megatron rank
    num_generators: int  # rollout.num_generators: one Ray actor per SGLang server
    devices_per_generator: int = 1  # rollout.tp_size: GPUs of one SGLang server (on GPU)
    colocated: bool = False  # trainer ranks and generators share devices
    device: str = "cpu"  # cpu | gpu: what a rank / an engine reserves besides CPUs
    cpus_per_trainer_rank: float = 1.0
    cpus_per_generator: float = 1.0  # the engine's own processes are not Ray tasks
    strategy: str = "PACK"  # Ray placement strategy over nodes
    # Bundles ask for the node-role resources (module docstring); None: as the cluster offers
    # them (RayCluster.reserve decides; bundles() alone treats None as False).
    node_roles: bool | None = None

    def __post_init__(self) -> None:
        for name in ("num_trainer_ranks", "num_generators", "devices_per_generator"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterLayout.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("cpus_per_trainer_rank", "cpus_per_generator"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClusterLayout.{name} must be > 0, got {getattr(self, name)}")
        if self.device not in _DEVICES:
            raise ValueError(f"ClusterLayout.device {self.device!r}: choose one of {_DEVICES}")
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"ClusterLayout.strategy {self.strategy!r}: choose one of "
                             f"{_STRATEGIES}")
        if self.colocated:
            total = self.num_generators * self.devices_per_generator
            if total != self.num_trainer_ranks:
                raise ValueError(
                    f"ClusterLayout.colocated: the generators' GPUs (num_generators "
                    f"{self.num_generators} x devices_per_generator "
                    f"{self.devices_per_generator} = {total}) must be the trainer's GPUs "
                    f"(num_trainer_ranks {self.num_trainer_ranks}): set rollout.num_generators "
                    f"x rollout.tp_size = parallelism.world_size")
            if self.node_roles:
                raise ValueError(
                    "ClusterLayout.node_roles: colocated trainer ranks and generators share "
                    f"nodes, so nodes cannot be given one role ({TRAINER_NODE_RESOURCE} / "
                    f"{GENERATOR_NODE_RESOURCE}): start the nodes without role resources, or "
                    "set cluster.colocated=false")

    @classmethod
    def from_run_config(cls, run, *, device: str | None = None, **fields: Any) -> "ClusterLayout":
        """From megatron_rl.config's RunConfig: parallelism.world_size trainer ranks,
        rollout.num_generators engines of rollout.tp_size devices each. `device` None: gpu
        when this process sees CUDA, else cpu."""
        if device is None:
            from megatron_rl.platform import has_cuda

            device = "gpu" if has_cuda() else "cpu"
        return cls(num_trainer_ranks=run.parallelism.world_size,
                   num_generators=run.rollout.num_generators,
                   devices_per_generator=run.rollout.tp_size, device=device, **fields)

    @property
    def num_bundles(self) -> int:
        return len(self.bundles())

    def trainer_bundle_index(self, rank: int) -> int:
        self._check_index("trainer rank", rank, self.num_trainer_ranks)
        return rank

    def generator_bundle_index(self, index: int) -> int:
        self._check_index("generator", index, self.num_generators)
        if self.colocated:  # an engine shares the bundles of the trainer ranks on its GPUs
            return index * self.devices_per_generator
        return self.num_trainer_ranks + index

    def generator_trainer_ranks(self, index: int) -> range:
        """Colocated: the trainer ranks whose devices generator `index` shares."""
        self._check_index("generator", index, self.num_generators)
        if not self.colocated:
            raise ValueError("generator_trainer_ranks: only colocated generators share the "
                             "trainer ranks' devices")
        return range(index * self.devices_per_generator, (index + 1) * self.devices_per_generator)

    def trainer_resources(self) -> dict[str, float]:
        """What one trainer rank's actor requests (inside its bundle)."""
        gpus = {"GPU": 1.0} if self.device == "gpu" else {}
        return {"CPU": self.cpus_per_trainer_rank, **gpus}

    def generator_resources(self) -> dict[str, float]:
        """What one generator actor requests (inside its bundle). Colocated: CPUs only; its
        server is given the trainer ranks' GPUs (`generator_trainer_ranks`)."""
        if self.colocated:
            return {"CPU": self.cpus_per_generator}
        gpus = {"GPU": float(self.devices_per_generator)} if self.device == "gpu" else {}
        return {"CPU": self.cpus_per_generator, **gpus}

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles: trainer ranks first (index = rank), then generators.
        Colocated: one bundle per trainer rank (its GPU), holding that rank and an engine's
        CPU share."""
        if self.colocated:
            shared = {"CPU": self.cpus_per_trainer_rank + self.cpus_per_generator,
                      **({"GPU": 1.0} if self.device == "gpu" else {})}
            return [dict(shared) for _ in range(self.num_trainer_ranks)]
        trainer, generator = self.trainer_resources(), self.generator_resources()
        if self.node_roles:
            trainer[TRAINER_NODE_RESOURCE] = 1.0
            generator[GENERATOR_NODE_RESOURCE] = float(self.devices_per_generator)
        return [dict(trainer) for _ in range(self.num_trainer_ranks)] + \
            [dict(generator) for _ in range(self.num_generators)]

    @staticmethod
    def _check_index(what: str, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise IndexError(f"{what} {index} is not in [0, {count})")


class Placement:
    """A reserved placement group of a `ClusterLayout` (made by `RayCluster.reserve`)."""

    def __init__(self, layout: ClusterLayout, placement_group, cluster):
        self.layout = layout
        self.placement_group = placement_group
        self.cluster = cluster  # the RayCluster whose shutdown() stops what runs here

    def scheduling(self, bundle_index: int):
        """Ray scheduling strategy pinning an actor to bundle `bundle_index`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=False)

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """`ActorClass.options(...)` of trainer rank `rank`."""
        resources = self.layout.trainer_resources()
        return {"num_cpus": resources["CPU"], "num_gpus": resources.get("GPU", 0),
                "scheduling_strategy": self.scheduling(self.layout.trainer_bundle_index(rank))}

    def generator_options(self, index: int) -> dict[str, Any]:
        """`ActorClass.options(...)` of generator `index`."""
        resources = self.layout.generator_resources()
        return {"num_cpus": resources["CPU"], "num_gpus": resources.get("GPU", 0),
                "scheduling_strategy": self.scheduling(self.layout.generator_bundle_index(index))}

    def bundle_nodes(self) -> dict[int, str]:
        """{bundle index: Ray node id} as the GCS has placed them now; "" for a bundle whose
        node was lost and that Ray has not placed again yet (the group is RESCHEDULING: it
        takes the first node with room, and actors waiting for that bundle start there)."""
        from ray.util import placement_group_table

        table = placement_group_table(self.placement_group)
        return {int(i): node or "" for i, node in table.get("bundles_to_node_id", {}).items()}

    def remove(self) -> None:
        from ray.util import remove_placement_group

        remove_placement_group(self.placement_group)


def reserve_placement_group(layout: ClusterLayout, *, timeout_s: float, name: str = ""):
    """Create the layout's placement group and wait until Ray has reserved every bundle."""
    import ray
    from ray.util import placement_group, remove_placement_group

    group = placement_group(layout.bundles(), strategy=layout.strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        available = ray.available_resources()
        remove_placement_group(group)
        raise TimeoutError(
            f"Ray could not reserve the placement group within {timeout_s:.0f} s: it needs "
            f"bundles {layout.bundles()} ({layout.strategy}); the cluster has "
            f"{ {k: v for k, v in sorted(available.items()) if k in _SHOWN_RESOURCES} } free. "
            "Give the cluster more CPUs / GPUs (cluster.num_cpus for a local one), fewer / "
            "smaller actors, or, when other runs hold the room, a longer "
            "cluster.placement_timeout_s")
    return group
