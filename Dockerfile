# syntax=docker/dockerfile:1
# The GPU image: NVIDIA's NGC PyTorch container (CUDA, NCCL, cuDNN, a CUDA build of torch, and
# Transformer Engine and apex compiled against it, none of which installs from PyPI: see
# CPU_STACK.md) plus megatron-core, SGLang with its CUDA kernels, the rest of the stack and this
# package, at the versions CI tests (requirements/; tests/unit/test_dockerfile.py checks every pin
# here against them and against SGLang's own metadata). docs/production.md has the whole path.
#
#   docker build -t megatron-rl:gpu .                       # x86_64 (H100) or aarch64 (GB200)
#   docker run --gpus all --ipc=host --network=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v /data:/data megatron-rl:gpu python tools/gpu_smoke.py --output /data/gpu_smoke.json
#   docker run ... megatron-rl:gpu megatron-rl train /data/recipe.yaml  # one node
#   (several nodes: examples/launch/slurm.sbatch or ssh.sh inside this image)
#
# The base image's torch stays as shipped (TE and apex are compiled against it): pick the NGC
# release whose torch is the 2.13 line CI tests (release notes: "based on 2.13.0a0+..."); the build
# stops below if it is not. SGLang 0.5.23 declares torch==2.14.1: it is installed without its
# dependency list, as CI installs it, and its CUDA-only dependencies are added at SGLang's own
# pins; whether its kernels load on this torch shows on a GPU (tools/gpu_smoke.py, sglang_sync).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.08-py3
FROM ${BASE_IMAGE}

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/megatron_rl

# 1. One constraints file for every pip call below: the container's torch and what is compiled
#    against it (never replaced), then CI's pins (requirements/constraints.txt without its CPU
#    torch). NGC's own /etc/pip/constraint.txt pins every package the container shipped and would
#    refuse CI's versions of pure-Python packages: PIP_CONSTRAINT replaces it.
COPY requirements/ requirements/
RUN python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13') else \
f'base image torch {v}: choose the NGC release with torch 2.13 (the version CI tests)')" && \
    KEEP='torch|torchvision|triton|transformer[-_]engine[-_a-z0-9]*|apex|flash[-_]attn' && \
    KEEP="$KEEP|nvidia[-_]cudnn[-_a-z0-9]*|nvidia[-_]nccl[-_a-z0-9]*" && \
    pip list --format=freeze | grep -iE "^($KEEP)==" > requirements/gpu-constraints.txt && \
    grep -v '^torch==' requirements/constraints.txt >> requirements/gpu-constraints.txt && \
    cat requirements/gpu-constraints.txt
ENV PIP_CONSTRAINT=/opt/megatron_rl/requirements/gpu-constraints.txt

# 2. CI's install order and pins (requirements/install.sh), minus the CPU torch and triton.
RUN pip install numpy==2.3.5 packaging==26.4 psutil==7.2.2 && \
    pip install --ignore-requires-python megatron-core==0.19.2 && \
    pip install --no-deps -r requirements/sglang-0.5.23-cpu-nodeps.txt sglang==0.5.23 && \
    pip install -r requirements/base.txt

# 3. SGLang's CUDA-only dependencies at the pins sglang 0.5.23 declares (torch, torchaudio and
#    torchcodec left out: the container's torch serves; audio input is not used).
RUN pip install \
        sglang-kernel==0.4.10 "flashinfer_python[cu13]==0.7.2" "flash-attn-4>=4.0.0b18" \
        "nvidia-cutlass-dsl[cu13]==4.8.0" nvidia-mathdx==25.6.0 quack-kernels==0.6.5 \
        sgl-deep-ep==0.1.2.post1 sgl-deep-gemm==0.2.3.post2 sgl-flash-mla==1.0.0 \
        tilelang==0.1.12 "humming-kernels[cu13]==0.1.12" nvshmem4py-cu13 "cuda-python>=13.0"

# 4. This package (editable: tools/, examples/ and models/ stay next to it). Named folders only:
#    a checkout's .venv (CPU torch) and runs/ must not enter the image.
COPY setup.py README.md Makefile pytest.ini ./
COPY megatron_rl/ megatron_rl/
COPY models/ models/
COPY tools/ tools/
COPY examples/ examples/
COPY benchmarks/ benchmarks/
COPY tests/ tests/
COPY docs/ docs/
#    A build machine has no GPU driver: the CUDA extensions are checked present here and loaded
#    by tools/gpu_smoke.py on a GPU; the dry run checks every configuration path.
RUN pip install --no-deps -e . && \
    python -c "import importlib.util as u, sys; missing = [m for m in ('transformer_engine', \
'apex', 'sgl_kernel', 'flashinfer') if u.find_spec(m) is None]; sys.exit(missing or 0)" && \
    python -c "import megatron_rl, megatron.core, sglang" && \
    python tools/gpu_smoke.py --dry-run --output /tmp/gpu_smoke_dry_run.json

CMD ["megatron-rl", "--help"]
