# mist-compiler for NVIDIA GPU machines: CUDA 12.8, PyTorch (cu128 wheels, which bring Triton),
# flash-attn built against them, and this package with its GPU extra.
#   docker build -t mist-compiler .
#   docker run --gpus all --ipc=host --rm -it mist-compiler mistc tune gpt2-7b --hardware h100-80gb --nodes 1 --gpus-per-node 8 --global-batch 256
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git build-essential ninja-build \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# torch first (CUDA build; any of 2.11 to 2.13 is supported), then flash-attn, which compiles
# against the installed torch and therefore needs --no-build-isolation.
ARG TORCH_VERSION=2.11.0
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cu128 \
 && pip install packaging wheel psutil \
 && MAX_JOBS=8 pip install --no-build-isolation "flash-attn>=2.5"

WORKDIR /opt/mist-compiler
COPY . .
RUN pip install -e ".[gpu,test]"

CMD ["mistc", "--help"]
