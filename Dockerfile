# One image for every sluice service; the command picks the service:
#   docker run IMAGE sluice serve engine --model /models/m --host 0.0.0.0
# CUDA torch by default (PyPI's wheel, which carries its CUDA libraries); a CPU-only image, about 4 GB
# smaller, for hosts without an NVIDIA GPU:
#   docker build --build-arg TORCH_VARIANT=cpu -t sluice:cpu .
FROM python:3.11-slim

ARG TORCH_VARIANT=cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 SLUICE_CACHE_DIR=/models/cache
WORKDIR /app

# torch first: from the CPU index (2.13.0+cpu, which pip prefers to PyPI's CUDA build of the same version;
# its own dependencies, pinned by constraints.txt, may come from PyPI) or PyPI's default CUDA wheel.
# Dependencies first, in their own layers: editing the source does not reinstall torch. The list is
# pyproject.toml's own [project] dependencies, pinned by constraints.txt.
COPY pyproject.toml constraints.txt ./
RUN case "$TORCH_VARIANT" in \
      cpu)  pip install --no-cache-dir -c constraints.txt --index-url "$TORCH_CPU_INDEX" \
              --extra-index-url https://pypi.org/simple "torch==$TORCH_VERSION" ;; \
      cuda) pip install --no-cache-dir -c constraints.txt "torch==$TORCH_VERSION" ;; \
      *)    echo "TORCH_VARIANT must be cpu or cuda, got $TORCH_VARIANT" >&2; exit 1 ;; \
    esac
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

EXPOSE 8000 50050 50051 50052 50053 9090
CMD ["sluice", "up", "--host", "0.0.0.0"]
