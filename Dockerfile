# mist-compiler for NVIDIA GPU machines: the torch CI tests (2.13.0, its CUDA 12.8 build), flash-attn
# built against it for the GPUs named below, and this package with its GPU extra.
#   docker build -t mist-compiler .                       # add --build-arg FLASH_ATTN=0 to leave flash-attn out
#   docker run --gpus all --ipc=host --rm mist-compiler   # smoke check: CUDA, NCCL over every GPU, flash-attn
#   docker run --gpus all --ipc=host --rm mist-compiler python benchmarks/gpu_check.py --out benchmarks/results
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git build-essential ninja-build \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# The same torch line as CI (.ci/run: torch==2.13.0), from the CUDA 12.8 wheel index so that it matches
# this image's nvcc, which flash-attn compiles with.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN pip install "torch==2.13.0" --index-url "${TORCH_INDEX}" \
 && python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert torch.version.cuda.startswith('12.8'), torch.version.cuda; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

# flash-attn: a prebuilt wheel when one matches this torch/CUDA/Python, else a build for Ampere (8.0)
# and Hopper (9.0) only, which keeps a cold build to well under an hour on 16 cores (all architectures:
# several hours). FLASH_ATTN=0 skips it; the code then uses torch's SDPA.
ARG FLASH_ATTN=1
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=16
RUN if [ "${FLASH_ATTN}" = "1" ]; then \
      pip install packaging wheel psutil ninja \
      && FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" NVCC_THREADS=2 \
         pip install --no-build-isolation "flash-attn>=2.6,<3" ; \
    fi

WORKDIR /opt/mist-compiler
COPY . .
# the test extra as CI installs it; flash-attn (the gpu extra's) is already there when asked for
RUN pip install -e ".[test,plot]" \
 && python -c "import mist_compiler.runtime.engine, mist_compiler.models.attention as a; print('flash-attn', a.FLASH_ATTN_VERSION)"

CMD ["python", "benchmarks/gpu_check.py", "--smoke"]
