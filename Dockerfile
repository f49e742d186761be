# GPU image: NVIDIA's NGC PyTorch container brings CUDA, NCCL, Transformer Engine and apex, which
# cannot be installed from PyPI (see CPU_STACK.md). On top: megatron-core, SGLang (with its CUDA
# kernels) and the rest of the stack. CPU development uses `make setup` instead.
# SGLang's CUDA build pins its own torch: if that conflicts with the container's, install sglang
# --no-deps plus its kernels, as requirements/ does for CPU. Not built in CI (no GPU there).
FROM nvcr.io/nvidia/pytorch:25.10-py3

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/megatron_rl
COPY requirements/ requirements/
# The container's torch, TE and apex stay as shipped: pip must never replace them.
RUN pip freeze | grep -iE '^(torch|transformer[-_]engine|apex)==' > /tmp/keep.txt && \
    pip install -c /tmp/keep.txt --ignore-requires-python megatron-core==0.19.2 && \
    pip install -c /tmp/keep.txt "sglang[all]==0.5.23" && \
    grep -v '^nvidia-resiliency-ext' requirements/base.txt > /tmp/base.txt && \
    pip install -c /tmp/keep.txt -r /tmp/base.txt "nvidia-resiliency-ext>=0.6"

COPY . .
RUN pip install --no-deps -e .

ENTRYPOINT ["megatron-rl"]
