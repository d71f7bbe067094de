#!/usr/bin/env bash
# Install ac-observe with its engine and test extras into ./.venv (idempotent).
# torch is pinned to 2.13.0, which these machines carry as a CPU wheel: pip never pulls a
# CUDA build here. On a GPU node, install the CUDA build of torch 2.13.0 into the venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# System packages the tests drive for real: promtool (Debian `prometheus`), Alertmanager,
# PostgreSQL's server, gcc, tmux (the CLI is tested in a real terminal), bcc and kernel
# headers (the eBPF collector), a Docker engine, docker-compose and debootstrap (the
# compose stack, built from an offline base image).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if ! command -v promtool >/dev/null || ! command -v gcc >/dev/null \
      || ! command -v tmux >/dev/null || [ ! -d /usr/lib/python3/dist-packages/bcc ] \
      || ! command -v prometheus-alertmanager >/dev/null \
      || { ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } \
      || ! ls -d /usr/src/linux-headers-*-common >/dev/null 2>&1 \
      || ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null \
      || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    # postgresql: the store's second backend; prometheus-alertmanager: webhook bodies are
    # compared with the real Alertmanager's.
    pg=; command -v initdb >/dev/null || pg=postgresql
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      prometheus prometheus-alertmanager $pg gcc libc6-dev tmux python3-bpfcc \
      linux-headers-amd64 docker.io docker-compose debootstrap >/dev/null
  fi
  # bcc compiles against /lib/modules/$(uname -r)/build. A kernel with no headers package
  # of its own (a VM's) can use Debian's: uprobe programs need no kernel internals.
  modules=/lib/modules/$(uname -r)
  if [ ! -e "$modules/build" ]; then
    headers=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$headers" ]; then
      mkdir -p "$modules"
      ln -sfn "$headers" "$modules/build"
      ln -sfn "${headers%-amd64}-common" "$modules/source"
    fi
  fi
  # bcc removes its uprobes through tracefs.
  if [ -d /sys/kernel/tracing ] && ! mountpoint -q /sys/kernel/tracing; then
    mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
  fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# A regular install, as users get it: the tests run against the installed package.
.venv/bin/python -m pip install -q --force-reinstall --no-deps .
.venv/bin/python -m pip install -q ".[engine,test]"
# The lowest and highest prometheus_client that pyproject allows: the tests read the
# engine's telemetry files with both (tests/test_telemetry_format.py).
for version in 0.20.0 0.26.0; do
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
    -d .venv/compat-wheels "prometheus_client==$version"
done
