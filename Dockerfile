# vlguard: a drop-in replacement for the stock vLLM OpenAI image. Same contract as vllm/vllm-openai:
# everything after the image name is `vllm serve` arguments (model and flags), port 8000, the same /v1
# routes; plus vlguard's --guard-* flags and VLGUARD_* variables (docs/deploy.md).
#
#   docker build -t vlguard:0.20.0 .                                     # on vllm/vllm-openai:v0.20.0
#   docker build --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.20.0 -t vlguard:0.20.0 .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.20.0
FROM ${VLLM_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# 1. vlguard's own dependencies that the vLLM image lacks (fastapi, uvicorn, pydantic, prometheus-client
#    and httpx come with vLLM), each pinned to the version the tests run with (requirements/). --no-deps
#    everywhere: the image's vLLM, torch and CUDA libraries stay as built. dumb-init is PID 1: it forwards SIGTERM to vlguard alone (--single-child: by default it signals
#    the whole process group, so the engine core stopped mid-drain) and reaps orphaned children.
RUN python3 -m pip install --no-cache-dir --no-deps \
        "pydantic-settings==2.16.3" "python-dotenv==1.2.4" "typing-inspection==0.4.5" \
        "sdnotify==0.3.2" "dumb-init==1.2.5.post1"

# 2. vlguard itself (changes most often: last).
WORKDIR /opt/vlguard
COPY pyproject.toml README.md ./
COPY server ./server
COPY config ./config
COPY deploy/docker/entrypoint.sh /usr/local/bin/vlguard-entrypoint
RUN python3 -m pip install --no-cache-dir --no-deps /opt/vlguard \
    && chmod 0755 /usr/local/bin/vlguard-entrypoint \
    && python3 -c "import server.cli, vllm; print('vlguard on vLLM', vllm.__version__)"

# 3. A non-root user (uid 10001, gid 0, as the Kubernetes manifests run it; the stock image runs as root).
#    It writes only its home: the Hugging Face cache (mount the host's there: -v
#    ~/.cache/huggingface:/home/vlguard/.cache/huggingface), vLLM's compile cache and config, and /tmp
#    (metric files, torch's scratch). Group 0 owns them too (g=u), so an arbitrary uid with gid 0 (OpenShift)
#    can write them as well. Everything else stays root's and read-only to it, so the container also runs
#    with --read-only and tmpfs on /tmp, the home and ~/.cache (deploy/systemd/vlguard-docker.service).
RUN useradd --uid 10001 --gid 0 --home-dir /home/vlguard --create-home --shell /usr/sbin/nologin vlguard \
    && mkdir -p /home/vlguard/.cache/huggingface /home/vlguard/.cache/vllm /home/vlguard/.config \
    && chown -R 10001:0 /home/vlguard && chmod -R g=u /home/vlguard

# Metric files of every vLLM process; vlguard wipes the directory at start.
ENV HOME=/home/vlguard \
    HF_HOME=/home/vlguard/.cache/huggingface \
    VLLM_CACHE_ROOT=/home/vlguard/.cache/vllm \
    PROMETHEUS_MULTIPROC_DIR=/tmp/vlguard-metrics \
    VLGUARD_PORT=8000
VOLUME ["/home/vlguard/.cache/huggingface"]
EXPOSE 8000
USER 10001:0

# Liveness (/health: the process answers). Readiness for load balancers is /ready. The start period
# covers a 30B model's load and compile.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('VLGUARD_PORT', '8000'), timeout=4)"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["dumb-init", "--single-child", "--", "vlguard-entrypoint"]
