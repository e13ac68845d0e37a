# Whetstone images. Two targets share one build:
#   docker build --target web    -t whetstone-web .     (FastAPI + htmx; no torch)
#   docker build --target worker -t whetstone-worker .  (GPU worker on a CUDA base)
# docker/compose.yaml runs both against one data volume (SQLite in WAL mode on it).

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
RUN pip install --no-cache-dir -e ".[postgres]"
VOLUME /data
EXPOSE 8000
CMD ["sh", "-c", "python -m app.store.migrate && python -m app.web.main"]

# ---- worker: the GPU process on a CUDA base --------------------------------------------
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS worker
ENV PYTHONUNBUFFERED=1 WHETSTONE_DATA_DIR=/data DEBIAN_FRONTEND=noninteractive \
    PIP_BREAK_SYSTEM_PACKAGES=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-dev \
      build-essential git bubblewrap && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY app app
COPY worker worker
COPY kernels kernels
COPY migrations migrations
# llama-cpp-python is built CPU-only: it quantises and verifies GGUF exports, it never trains.
RUN CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF" \
    pip install --no-cache-dir -e ".[worker,postgres]"
VOLUME /data
CMD ["python3", "-m", "worker"]
