"""Installs the megatron_rl library, the per-model packages and the `megatron-rl` command.

Dependencies are installed by `make setup` (requirements/install.sh) in a pinned order that keeps
the CPU build of torch; they are deliberately not declared here so that `pip install -e .` can
never pull another torch.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="RL trainer for large MoE LLMs: Megatron-core trainers, SGLang generators, ScaleRL",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*", "models", "models.*"]),
    package_data={"megatron_rl": ["recipes/*.yaml"]},
    entry_points={"console_scripts": ["megatron-rl = megatron_rl.cli:main"]},
)
