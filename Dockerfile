# One image for every sluice service; the command picks the service:
#   docker run IMAGE sluice serve engine --model /models/m --host 0.0.0.0
# CUDA torch by default (PyPI's wheel, which carries its CUDA libraries); a CPU-only image, about 4 GB
# smaller, for hosts without an NVIDIA GPU:
#   docker build --build-arg TORCH_VARIANT=cpu -t sluice:cpu .
# The base is a build argument: the official slim Python image by default, or one built from Debian's own
# packages where no container registry can be reached (scripts/debian_base.sh; `make compose` does this):
#   docker build --build-arg BASE_IMAGE=sluice-base:bookworm --build-arg TORCH_VARIANT=cpu .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VARIANT=cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    PIP_BREAK_SYSTEM_PACKAGES=1 SLUICE_CACHE_DIR=/models/cache
WORKDIR /app

# A C++ compiler for the CPU kernels (services/engine/executor/kernels/): built below for
# the build host's CPU, and again at an engine's first start on a CPU with other flags.
# Python's headers too where the base lacks them (Debian's python3 keeps them in python3-dev).
RUN pkgs=g++; python3 -c 'import pathlib, sysconfig, sys; \
sys.exit(not (pathlib.Path(sysconfig.get_paths()["include"]) / "Python.h").exists())' || pkgs="$pkgs python3-dev"; \
    apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >/dev/null \
 && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: editing the source does not reinstall it. cpu: a torch wheel placed in
# docker/wheels/ (`make compose` copies the CPU wheel pip already has on disk there, so nothing large is
# downloaded), else the PyTorch CPU index (2.13.0+cpu, which pip prefers to PyPI's CUDA build of the same
# version); its own dependencies, pinned by constraints.txt, come from PyPI. cuda: PyPI's default wheel.
# Certificates in docker/certs/*.crt are trusted by the build's pip (a TLS-inspecting proxy's CA:
# `make compose` places the bundle the host's pip trusts there, PIP_CERT).
COPY docker/certs/ /tmp/certs/
RUN if ls /tmp/certs/*.crt >/dev/null 2>&1; then cat /tmp/certs/*.crt >> /etc/ssl/certs/ca-certificates.crt; fi \
 && rm -rf /tmp/certs
COPY pyproject.toml constraints.txt ./
COPY docker/wheels/ /tmp/wheels/
RUN case "$TORCH_VARIANT" in \
      cpu)  if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; \
            then pip install --no-cache-dir -c constraints.txt --find-links /tmp/wheels "torch==$TORCH_VERSION"; \
            else pip install --no-cache-dir -c constraints.txt --index-url "$TORCH_CPU_INDEX" \
                   --extra-index-url https://pypi.org/simple "torch==$TORCH_VERSION"; fi ;; \
      cuda) pip install --no-cache-dir -c constraints.txt "torch==$TORCH_VERSION" ;; \
      *)    echo "TORCH_VARIANT must be cpu or cuda, got $TORCH_VARIANT" >&2; exit 1 ;; \
    esac \
 && rm -rf /tmp/wheels
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# Then the source, installed without touching the dependencies.
COPY README.md ./
COPY protos ./protos
COPY services ./services
COPY gateway ./gateway
COPY sluice ./sluice
RUN pip install --no-cache-dir --no-deps .

RUN useradd --create-home --uid 10001 sluice && mkdir -p /models && chown sluice /models
USER sluice
# From /, so that the installed package's source is the one built (the path an engine loads it by).
RUN cd / && python -m services.engine.executor.kernels.cpu_kernels --require

EXPOSE 8000 50050 50051 50052 50053 9090
CMD ["sluice", "up", "--host", "0.0.0.0"]
