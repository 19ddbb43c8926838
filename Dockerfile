# One image for every sluice service; the command picks the service:
#   docker run IMAGE sluice serve engine --model /models/m --host 0.0.0.0
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 SLUICE_CACHE_DIR=/models/cache
WORKDIR /app

COPY pyproject.toml constraints.txt README.md ./
COPY protos ./protos
COPY services ./services
COPY gateway ./gateway
COPY sluice ./sluice

RUN pip install --no-cache-dir -c constraints.txt torch==2.13.0 \
 && pip install --no-cache-dir -c constraints.txt .

RUN useradd --create-home --uid 10001 sluice && mkdir -p /models && chown sluice /models
USER sluice

EXPOSE 8000 50050 50051 50052 50053
CMD ["sluice", "up", "--host", "0.0.0.0"]
