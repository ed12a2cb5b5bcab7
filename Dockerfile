# batchfit service image: the CUDA build of torch (runs without a GPU), a non-root user, a healthcheck.
#   docker build -t batchfit .
#   docker run -p 8000:8000 batchfit
# BASE may name a local Debian/Python base when registries cannot be reached
# (e.g. one made with debootstrap and imported into buildah).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    BATCHFIT_CACHE_PATH=/var/lib/batchfit/cache.sqlite

RUN useradd --create-home --uid 10001 batchfit \
    && mkdir -p /var/lib/batchfit && chown batchfit /var/lib/batchfit

WORKDIR /opt/batchfit
COPY pyproject.toml README.md ./
COPY estimator ./estimator
COPY app ./app
# torch==2.14.1 from PyPI is the CUDA build (docs/DESIGN.md, fact 1)
RUN pip install .

USER batchfit
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"
CMD ["batchfit", "serve", "--host", "0.0.0.0", "--port", "8000"]
