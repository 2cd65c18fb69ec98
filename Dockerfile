# syntax=docker/dockerfile:1
# The kvserving image the operator renders (spec.image), multi-stage, non-root:
#   docker build --target gpu -t ghcr.io/kvserving/kvserving:0.1.0 .      workers: CUDA torch, triton, nixl
#   docker build --target cpu -t ghcr.io/kvserving/kvserving:0.1.0-cpu .  gateway and operator: no torch
# Pins come from requirements.txt itself (tests/test_dockerfile.py checks the
# torch pin against the Makefile's and lints this file with hadolint).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- the kvserving wheel, built once --------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common/ common/
COPY kernels/ kernels/
COPY worker/ worker/
COPY gateway/ gateway/
COPY operator/ operator/
COPY agents/ agents/
COPY calibrate/ calibrate/
COPY sim/ sim/
COPY local/ local/
COPY crds/ crds/
RUN pip install --no-cache-dir "setuptools==84.2.1" "wheel==0.48.0" \
 && pip wheel --no-cache-dir --no-deps --no-build-isolation -w /wheels .

# --- what both images share -----------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kvserving" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="Agent-aware LLM serving with NVFP4 / tri-axial KV caches and bidirectional KV reuse"
ENV PYTHONSAFEPATH=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvserving
WORKDIR /app
COPY requirements.txt ./

# --- gateway and operator: the pure-Python parts, no torch, triton or nixl ------------------
FROM base AS cpu
RUN grep -v -E '^(torch|triton|nixl-cu12)==' requirements.txt > requirements-cpu.txt \
 && pip install --no-cache-dir -r requirements-cpu.txt
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/kvserving-*.whl && rm -rf /wheels
USER 10001
ENTRYPOINT ["kvserving"]
CMD ["--help"]

# --- workers: CUDA torch (the PyPI build of the pinned version), triton, nixl ---------------
FROM base AS gpu
RUN pip install --no-cache-dir "torch==2.13.0" \
 && pip install --no-cache-dir -r requirements.txt
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/kvserving-*.whl && rm -rf /wheels
USER 10001
ENTRYPOINT ["kvserving"]
CMD ["--help"]
