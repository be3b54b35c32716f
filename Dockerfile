# vlguard on top of the stock vLLM image: same arguments, port and routes as vllm/vllm-openai.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.20.0
FROM ${VLLM_IMAGE}

# Only vlguard's own small dependencies; the image's vLLM, torch and CUDA libraries are kept.
RUN pip install --no-cache-dir "pydantic-settings>=2.6" "sdnotify>=0.3.2"
COPY pyproject.toml README.md /opt/vlguard/
COPY server /opt/vlguard/server
COPY config /opt/vlguard/config
RUN pip install --no-cache-dir --no-deps /opt/vlguard

EXPOSE 8000
ENTRYPOINT ["vlguard", "serve"]
