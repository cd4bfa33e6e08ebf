# GPU image: CUDA runtime + kserve with its GPU extras (Triton, flash-attn).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv git \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /opt/kserve
COPY pyproject.toml README.md ./
COPY kserve ./kserve
COPY kernels ./kernels
COPY configs ./configs
RUN pip install "torch>=2.6" --index-url https://download.pytorch.org/whl/cu128 \
 && pip install ".[gpu]" --no-build-isolation

EXPOSE 8000
# Mount the model at /model (config.json, *.safetensors, tiktoken.model, tokenizer_config.json).
ENTRYPOINT ["kserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["/model"]
