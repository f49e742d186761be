"""megatron_rl: RL for large Mixture-of-Experts LLMs with Megatron-core trainers and SGLang
generators, implementing the ScaleRL recipe and its compute-scaling methodology."""

from megatron_rl._nvrx_compat import hide_old_nvrx_async_checkpointing

hide_old_nvrx_async_checkpointing()

__version__ = "0.1.0"
