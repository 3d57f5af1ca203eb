# The trainguard image: the ingest service + admin API (default command) and the
# example trainer (docker compose --profile trainer). CPU torch keeps it small; for
# CUDA, build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126.
# BASE: the image to start from, python:3.11-slim unless a local one is given
# (--build-arg BASE=...; it must have python 3.11 and pip on PATH as `python`/`pip`).
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Dependencies first (layer cache): torch from its own index, then the package.
RUN pip install --index-url "$TORCH_INDEX" "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY trainguard ./trainguard
COPY ingest_service ./ingest_service
COPY checkpoint_store ./checkpoint_store
COPY trainer_client ./trainer_client
RUN pip install ".[s3]"
COPY examples ./examples

RUN useradd --uid 10001 --create-home trainguard \
    && mkdir -p /checkpoints /data && chown trainguard /checkpoints /data
USER trainguard

EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=10 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=3)"]
# 0.0.0.0 inside the container only; publish the port on 127.0.0.1 of the host.
CMD ["trainguard", "serve", "--host", "0.0.0.0", "--port", "8080"]
