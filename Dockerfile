# Paged Attention Lab as a class server: CPU-only PyTorch, the embedded tiny model, class mode on.
#   docker build -t paged-attention-lab .
#   docker run --rm -p 8501:8501 --memory 4g paged-attention-lab      (open http://<host>:8501)
# One Streamlit worker per core the container may use, behind nginx (scripts/class_server.py; a browser stays on
# its worker); docs/deploy.md: the class-mode settings (PAL_* variables), a reverse proxy, other hosts.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAL_CLASS_SERVER=1 \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1

WORKDIR /app

# nginx spreads the browsers over the workers (scripts/class_server.py runs it from a private folder, unprivileged)
RUN apt-get update \
    && apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/*

# CPU-only PyTorch from PyTorch's own index (about 200 MB instead of PyPI's several-GB CUDA build); a layer of
# its own, so editing the project does not download it again.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4"

COPY . .
RUN pip install . \
    && useradd --create-home --uid 1000 lab \
    && chown -R lab /app
USER 1000

EXPOSE 8501
# 60 s to start: importing PyTorch and loading the model on a small machine
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8501/_stcore/health', timeout=4)"]
CMD ["python", "scripts/class_server.py", "--port", "8501", "--address", "0.0.0.0"]
