# batchfit service image: the CUDA build of torch (runs without a GPU), a non-root user, a healthcheck.
#   docker build -t batchfit:latest .
#   docker run -p 8000:8000 batchfit:latest
# BASE may name a local Debian/Python base when registries cannot be reached (e.g. one made with
# debootstrap and imported into buildah); it needs python3 >= 3.11 and its venv module (Debian: python3-venv).
ARG BASE=python:3.11-slim-bookworm

# 0. The allocator replay in C (estimator/replay/_allocator.c), compiled in a stage of its own: the image gets the
#    library, not the compiler. A plain C library (no Python headers), which estimator/replay/native.py loads.
FROM ${BASE} AS native
RUN apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY estimator/replay/_allocator.c /src/_allocator.c
RUN gcc -O2 -shared -fPIC -o /src/_allocator.so /src/_allocator.c

FROM ${BASE}

# Everything is installed into /opt/venv: Debian's own python3 refuses `pip install` as root (PEP 668),
# and a plain Debian base has no `python`, only python3.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    BATCHFIT_CACHE_PATH=/var/lib/batchfit/cache.sqlite

RUN python3 -m venv /opt/venv \
    && useradd --create-home --uid 10001 batchfit \
    && mkdir -p /var/lib/batchfit && chown batchfit /var/lib/batchfit

WORKDIR /opt/batchfit

# 1. The dependencies, from pyproject.toml alone, so that this layer (torch's CUDA build, ~3 GB) is rebuilt only
#    when pyproject.toml changes. Empty packages and README stand in for the source while pip builds the project.
#    torch==2.14.1 from PyPI is the CUDA build (docs/DESIGN.md, fact 1); the gpu extra (NVML) serves validation
#    on a GPU node (docker-compose.yml's batchfit-gpu runs this same image); the peft extra (peft, bitsandbytes)
#    answers LoRA, QLoRA and the 8-bit optimizers (model.peft, model.quantization).
COPY pyproject.toml ./
RUN mkdir estimator app \
    && touch README.md estimator/__init__.py app/__init__.py \
    && pip install '.[service,gpu,peft]' \
    && rm -rf README.md estimator app build ./*.egg-info

# 2. The source: a code change rebuilds only this layer (no dependency is downloaded again).
COPY README.md ./
COPY estimator ./estimator
COPY app ./app
# pip finds no compiler here and installs the package without the C replay (it is optional); the native stage's
# library goes next to the installed estimator/replay/native.py, which loads it.
COPY --from=native /src/_allocator.so /tmp/_allocator.so
RUN pip install --no-deps --force-reinstall . && rm -rf build ./*.egg-info \
    && mv /tmp/_allocator.so "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/estimator/replay/" \
    && python -c 'from estimator.replay import native; assert native.available(), "the C replay did not load"'

USER batchfit
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD /opt/venv/bin/python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"
CMD ["batchfit", "serve", "--host", "0.0.0.0", "--port", "8000"]
