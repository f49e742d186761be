# syntax=docker/dockerfile:1
# The GPU image: SGLang's own release image for the SGLang version CI tests (its CUDA, NCCL, cuDNN
# and the torch its kernels are compiled for: SGLang 0.5.23 pins torch==2.14.1, and sglang-kernel,
# sgl-deep-ep and sgl-flash-mla are built against that torch's ABI), plus megatron-core,
# Transformer Engine and apex compiled against that same torch, the rest of the stack and this
# package. tests/integration/test_gpu_image.py resolves the whole pip install set
# (requirements/gpu-image.txt: SGLang 0.5.23 with all its pins, this torch, everything added here)
# with pip against PyPI for the image's Python on x86_64 and aarch64 and fails on any conflict;
# tests/unit/test_dockerfile.py keeps this file, requirements/ and tools/gpu_image.py in step.
# docs/production.md has the whole path.
#
#   docker build -t megatron-rl:gpu .                       # x86_64 (H100/H200) or aarch64 (GB200)
#   docker run --gpus all --ipc=host --network=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v /data:/data megatron-rl:gpu python tools/gpu_smoke.py --output /data/gpu_smoke.jsonl
#   docker run ... megatron-rl:gpu megatron-rl train /data/recipe.yaml  # one node
#   (several nodes: examples/launch/slurm.sbatch or ssh.sh inside this image)
#
# What the base must be (checked in step 1, the build stops otherwise): the versions the install
# set was resolved for. SGLang's images keep their Python environment in a virtualenv on PATH.
ARG SGLANG_VERSION=0.5.23
ARG BASE_IMAGE=lmsysorg/sglang:v${SGLANG_VERSION}
FROM ${BASE_IMAGE}
ARG SGLANG_VERSION
ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.14.1
ARG TORCH_CUDA_MAJOR=13
# Built from source against the base's torch: Transformer Engine's PyTorch extension (an sdist
# only on PyPI; its core library and Python package are binary wheels, in gpu-image.txt) and
# apex (not on PyPI). TE 2.19.0 is the release megatron-core 0.19.2 shipped with; apex has no
# release tags after 25.09, so a commit.
ARG TRANSFORMER_ENGINE_VERSION=2.19.0
ARG APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
# Hopper (H100 / H200: 9.0) and Blackwell (B200 / GB200: 10.0).
ARG CUDA_ARCHS="9.0;10.0"
ARG MAX_JOBS=16

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/megatron_rl

# 1. The base is what the install set was resolved for: Python, torch (and its CUDA), SGLang.
COPY requirements/ requirements/
COPY tools/gpu_image.py tools/gpu_image.py
RUN python -m pip --version >/dev/null 2>&1 || python -m ensurepip --upgrade; \
    python tools/gpu_image.py check-base --python "${PYTHON_VERSION}" --torch "${TORCH_VERSION}" \
        --torch-cuda-major "${TORCH_CUDA_MAJOR}" --sglang "${SGLANG_VERSION}"

# 2. FlashInfer's kernels in the image: the GPU machines may have no network, and FlashInfer
#    downloads a missing cubin at first use. Its precompiled kernels ship as two wheels that must
#    match flashinfer-python's version exactly: flashinfer-cubin and flashinfer-jit-cache (+cuXY),
#    on FlashInfer's own index (flashinfer.ai/whl; PyPI has flashinfer-cubin only up to 0.6.x).
#    SGLang's release images install them; where this base lacks them, FlashInfer's own command
#    installs the matching pair (for the CUDA of the base's torch).
RUN python tools/gpu_image.py check-kernels || \
    ( python -m flashinfer download-kernels --cuda-version \
        "$(python -c 'import torch; print(torch.version.cuda)')" && \
      python tools/gpu_image.py check-kernels )

# 3. Everything else from PyPI, under one constraints file: the base's torch and every package
#    built against torch or CUDA stay exactly as shipped (requirements/ pins none of them), then
#    requirements/gpu-image.txt: megatron-core, Transformer Engine's wheels and the run-time needs
#    of its extension, and the stack at CI's versions (requirements/base.txt and the SGLang list).
RUN python tools/gpu_image.py constraints requirements/gpu-constraints.txt && \
    cat requirements/gpu-constraints.txt
ENV PIP_CONSTRAINT=/opt/megatron_rl/requirements/gpu-constraints.txt
RUN pip install -r requirements/gpu-image.txt

# 4. Compiled here against the base's torch (its headers, ABI and CUDA toolkit; no build
#    isolation, so the build sees that torch and not a fresh one from PyPI).
RUN NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE \
    NVTE_CUDA_ARCHS="$(echo "${CUDA_ARCHS}" | tr -d .)" TORCH_CUDA_ARCH_LIST="${CUDA_ARCHS}" \
    MAX_JOBS="${MAX_JOBS}" \
    pip install --no-build-isolation --no-deps --no-binary transformer-engine-torch \
        "transformer-engine-torch==${TRANSFORMER_ENGINE_VERSION}"
RUN APEX_CPP_EXT=1 APEX_CUDA_EXT=1 TORCH_CUDA_ARCH_LIST="${CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
    NVCC_APPEND_FLAGS="--threads 4" \
    pip install --no-build-isolation --no-deps \
        "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"

# 5. This package (editable: tools/, examples/ and models/ stay next to it). Named folders only:
#    a checkout's .venv (CPU torch) and runs/ must not enter the image.
COPY setup.py README.md Makefile pytest.ini ./
COPY megatron_rl/ megatron_rl/
COPY models/ models/
COPY tools/ tools/
COPY examples/ examples/
COPY benchmarks/ benchmarks/
COPY tests/ tests/
COPY docs/ docs/
#    A build machine has no GPU driver: the compiled extensions are checked present here, and
#    loaded by tools/gpu_smoke.py's first stage on a GPU; its dry run checks the configurations.
RUN pip install --no-deps -e . && \
    python tools/gpu_image.py check-image && \
    python tools/gpu_smoke.py --dry-run --output /tmp/gpu_smoke_dry_run.jsonl

CMD ["megatron-rl", "--help"]
