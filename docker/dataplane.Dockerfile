# syntax=docker/dockerfile:1
# The data plane (`modelfleet serve`) and the converter (`modelfleet convert`): one image, started by the
# operator for serving Deployments and conversion Jobs.
#
#   docker build -f docker/dataplane.Dockerfile -t ghcr.io/modelfleet/dataplane:0.1.0 .
#   docker build -f docker/dataplane.Dockerfile \
#     --build-arg CUDA_BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t ...:0.1.0-cu126 .
#
# The base image must be Ubuntu/Debian based with a CUDA (or ROCm) runtime matching the torch wheels of
# TORCH_INDEX_URL. Pin it by digest in production (image@sha256:...).
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_BASE_IMAGE} AS build
# The Makefile's pin (TORCH_VERSION): never an unpinned torch.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, in its own layer: the largest and the slowest to change.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cli/ cli/
COPY dataplane/ dataplane/
COPY converters/ converters/
COPY operator/ operator/
COPY controlplane/ controlplane/
COPY local/ local/
# The base package alone: no extra, so neither the operator's libraries (kopf, kubernetes) nor the
# control plane's (SQLAlchemy, Alembic, psycopg). torch>=2.6 is met by the build above, which stays.
RUN pip install --no-cache-dir --no-compile . \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

FROM ${CUDA_BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles its kernel launchers at run time: it needs a C compiler and the Python headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 modelfleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin modelfleet
COPY --from=build /opt/venv /opt/venv
# The root filesystem is read-only in the cluster: every cache goes to /tmp (an emptyDir). The driver's
# compute capability has the NVIDIA container runtime mount nvidia-cuda-mps-control, the MPS daemon a
# one-GPU pod's server starts for its versions (dataplane/server/gpu_sharing.py).
ENV PATH=/opt/venv/bin:$PATH \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    TRITON_CACHE_DIR=/tmp/triton \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["modelfleet"]
CMD ["serve", "--help"]
