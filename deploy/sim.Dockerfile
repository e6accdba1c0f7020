# syntax=docker/dockerfile:1
# An emulated GPU host for deploy/compose.yaml: the real haru-supervisor, plus haru-sim
# (emulated vLLM servers and trainers) and an emulated nvidia-smi, so a whole fleet runs as
# containers without a GPU. Not for production: use services/supervisor/Dockerfile there.
# Build from the repository root:  docker build -f deploy/sim.Dockerfile -t haru-sim-host .

FROM python:3.11-slim-bookworm AS build
COPY --from=ghcr.io/astral-sh/uv:0.13.9 /uv /usr/local/bin/uv
ENV UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy
WORKDIR /src
# 1. The third-party dependencies, from uv.lock and the root pyproject.toml alone: this layer is
#    rebuilt only when the lock changes, never for a code change (uv's cache is a cache mount).
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,source=uv.lock,target=uv.lock \
    --mount=type=bind,source=pyproject.toml,target=pyproject.toml \
    --mount=type=bind,source=deploy/install-service.sh,target=deploy/install-service.sh \
    sh deploy/install-service.sh --dependencies-only /opt/haru haru-supervisor haru-sim
COPY . .
# 2. The supervisor and haru-sim, as wheels: the same script tests/test_images.py runs.
RUN --mount=type=cache,target=/root/.cache/uv \
    sh deploy/install-service.sh /opt/haru haru-supervisor haru-sim

FROM python:3.11-slim-bookworm
ARG HARU_VERSION=0.4.0
LABEL org.opencontainers.image.title="haru-sim-host" \
      org.opencontainers.image.description="An emulated GPU host for deploy/compose.yaml (not for production)" \
      org.opencontainers.image.version="${HARU_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.0-1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/haru --create-home haru
COPY --from=build /opt/haru /opt/haru
COPY deploy/healthcheck.py /opt/haru/healthcheck.py
# The demo's emulated nvidia-smi (standard library only): memory follows which emulated vLLM
# servers are awake and which trainers run, as on a real GPU (GPU document: /etc/haru/gpus.json).
COPY packages/sim/src/haru_sim/nvidia_smi.py /opt/haru/emulated_gpu.py
COPY deploy/emulated/nvidia-smi /usr/local/bin/nvidia-smi
ENV PATH=/opt/haru/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HARU_HOST=0.0.0.0 \
    PORT=8701
WORKDIR /var/lib/haru
USER 10001:10001
EXPOSE 8701
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/opt/haru/healthcheck.py", "/healthz", "8701"]
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["haru-supervisor"]
