# Whetstone images. Two targets share one build:
#   docker build --target web    -t whetstone-web .     (FastAPI + htmx; no torch)
#   docker build --target worker -t whetstone-worker .  (the GPU supervisor on a CUDA base)
# docker/compose.yaml runs both against one data volume (SQLite in WAL mode on it). Both run as
# the unprivileged user whetstone (uid 10001, the same in both: they share /data) and have a
# HEALTHCHECK: the web's /healthz, the supervisor's heartbeat row (python -m worker --health).

# ---- third-party JS from npm, at build time -------------------------------------------
FROM node:20-bookworm-slim AS assets
WORKDIR /src
COPY package.json package-lock.json ./
COPY static/copy-vendor.mjs static/
RUN npm ci --no-audit --no-fund

# ---- web: no torch, no CUDA ------------------------------------------------------------
FROM python:3.11-slim-bookworm AS web
ENV PYTHONUNBUFFERED=1 WHETSTONE_HOST=0.0.0.0 WHETSTONE_DATA_DIR=/data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY app app
COPY migrations migrations
COPY templates templates
COPY static static
COPY --from=assets /src/static/vendor static/vendor
RUN pip install --no-cache-dir -e ".[postgres]" \
 && useradd --system --uid 10001 --user-group --create-home whetstone \
 && mkdir -p /data && chown whetstone:whetstone /data
USER 10001:10001
VOLUME /data
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
  CMD ["python", "-m", "app.web.health"]
CMD ["sh", "-c", "python -m app.store.migrate && python -m app.web.main"]

# ---- worker: the GPU supervisor on a CUDA base -----------------------------------------
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS worker
ENV PYTHONUNBUFFERED=1 WHETSTONE_DATA_DIR=/data DEBIAN_FRONTEND=noninteractive \
    PIP_BREAK_SYSTEM_PACKAGES=1
# Ubuntu's packages follow the CUDA base image's release; pinning each version would only break
# the build when the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-dev \
      build-essential git bubblewrap && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY app app
COPY worker worker
COPY whetstone_kernels whetstone_kernels
COPY migrations migrations
# llama-cpp-python is built CPU-only: it quantises and verifies GGUF exports, it never trains.
RUN CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF" \
    pip install --no-cache-dir -e ".[worker,postgres]" \
 && useradd --system --uid 10001 --user-group --create-home whetstone \
 && mkdir -p /data && chown whetstone:whetstone /data
# caches (Hugging Face downloads, Triton kernels) go to the user's home, not to /root
ENV HOME=/home/whetstone
USER 10001:10001
VOLUME /data
HEALTHCHECK --interval=30s --timeout=20s --start-period=300s --retries=3 \
  CMD ["python3", "-m", "worker", "--health"]
# one supervisor per host: it owns every GPU the container sees (compose: count all)
CMD ["python3", "-m", "worker", "--supervise"]
