"""Ray as the orchestrator of an RL run: the cluster (a local loopback-only one, or an existing one
joined by address), one placement group holding the trainer ranks and the generator engines, the
generator actors (one per SGLang server, launched with the project's launcher) and the trainer
actors (one per Megatron rank, torch.distributed initialised from the actors' addresses), and one
`shutdown()` that stops all of it. Importing this package does not import Ray, Megatron or SGLang.

    cluster = RayCluster.start(ClusterSettings(num_cpus=2))        # or address="head:6379"
    placement = cluster.reserve(ClusterLayout.from_run_config(run))
    generators = GeneratorPool.launch(placement, [server_settings])
    trainers = TrainerGroup.create(placement, run)
    trainers.connect_generators(generators.endpoints, hf_config_dir=model_dir)
    report = trainers.sync_weights()                                 # version 1
    metrics = trainers.train_step(batch)
    cluster.shutdown()      # trainer ranks, SGLang servers, placement group, Ray
"""
from megatron_rl.cluster.generators import GeneratorActor, GeneratorEndpoint, GeneratorPool
from megatron_rl.cluster.placement import ClusterLayout, Placement
from megatron_rl.cluster.runtime import ClusterError, ClusterSettings, RayCluster
from megatron_rl.cluster.trainers import (Rendezvous, TrainerGroup, TrainerRankEnv, TrainerWorker,
                                          WorkerNode, rank_environments)

__all__ = [
    "ClusterError",
    "ClusterLayout",
    "ClusterSettings",
    "GeneratorActor",
    "GeneratorEndpoint",
    "GeneratorPool",
    "Placement",
    "RayCluster",
    "Rendezvous",
    "TrainerGroup",
    "TrainerRankEnv",
    "TrainerWorker",
    "WorkerNode",
    "rank_environments",
]
