# syntax=docker/dockerfile:1
# The operator (`modelfleet operator`) and the control plane (`modelfleet controlplane`): one image, two
# Deployments of the Helm chart, so it installs both extras. No GPU here: torch (a dependency of the
# base package) is the CPU build.
#
#   docker build -f docker/controlplane.Dockerfile -t ghcr.io/modelfleet/controlplane:0.1.0 .
#
# Pin the base by digest in production (python:3.12.8-slim-bookworm@sha256:...).
ARG PYTHON_BASE_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_BASE_IMAGE} AS build
# The Makefile's pin (TORCH_VERSION): never an unpinned torch.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cli/ cli/
COPY dataplane/ dataplane/
COPY converters/ converters/
COPY operator/ operator/
COPY controlplane/ controlplane/
COPY local/ local/
# The operator's and the control plane's extras, not the dev one; torch>=2.6 is met by the build above.
RUN pip install --no-cache-dir --no-compile "./[operator,controlplane]" \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

FROM ${PYTHON_BASE_IMAGE} AS runtime
RUN groupadd --gid 10001 modelfleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin modelfleet
COPY --from=build /opt/venv /opt/venv
# The root filesystem is read-only in the cluster: caches and the SQLite default go to mounted volumes.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["modelfleet"]
CMD ["controlplane"]
