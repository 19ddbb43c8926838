#!/usr/bin/env bash
# Builds the image's base from Debian's own packages and imports it into the local Docker engine, for
# machines that reach Debian's archive and PyPI but not a container registry:
#   scripts/debian_base.sh [TAG]          (default sluice-base:bookworm; needs root, debootstrap, docker)
# The result stands in for python:3.11-slim: Debian bookworm (minbase) with Python 3.11, pip and venv.
# `docker build --build-arg BASE_IMAGE=sluice-base:bookworm .` then builds sluice on it.
set -euo pipefail
tag=${1:-sluice-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag already present"
  exit 0
fi
root=$(mktemp -d /tmp/sluice-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm into $root (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
  bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log"; exit 1; }
rm -f "$root.log"
# pip may install into the system Python of an image: the image is the environment.
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
ln -sf python3 "$root/usr/bin/python"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$tag"
echo "imported $tag"
