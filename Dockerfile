# GPU image: CUDA + kserve with its GPU extras (Triton, flash-attn).
# The devel image carries nvcc, which flash-attn needs when no prebuilt wheel matches.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 MAX_JOBS=8
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev git \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# flash-attn builds against the installed torch, so torch and the build tools come first and the
# package is installed without build isolation.
RUN pip install --upgrade pip setuptools wheel packaging ninja \
 && pip install "torch>=2.6" --index-url https://download.pytorch.org/whl/cu128

WORKDIR /opt/kserve
COPY pyproject.toml README.md ./
COPY kserve ./kserve
COPY kernels ./kernels
COPY configs ./configs
RUN pip install --no-build-isolation ".[gpu]"

# Serve as an unprivileged user.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin kserve
USER kserve
ENV HOME=/home/kserve

EXPOSE 8000
# /health is 503 while loading and once the engine is dead (kserve serve then also exits non-zero, so the
# orchestrator restarts it); the start period covers loading a large checkpoint.
HEALTHCHECK --interval=15s --timeout=5s --start-period=1800s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
# Mount the model at /model (config.json, *.safetensors, tiktoken.model, tokenizer_config.json), readable by uid 10001.
ENTRYPOINT ["kserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["/model"]
