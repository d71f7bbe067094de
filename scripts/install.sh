#!/usr/bin/env bash
# Install ac-observe into ./.venv (idempotent).
#   scripts/install.sh                 what running needs (scripts/run.sh): the package with
#                                      its engine extra, torch, and as root bcc, kernel
#                                      headers and tracefs for the eBPF collector
#   scripts/install.sh --test          and what testing needs (scripts/test.sh): the test
#                                      extra, and as root the system packages tests drive
#   scripts/install.sh --test --fast   only what the fast tier needs (scripts/test.sh --fast):
#                                      none of the servers and terminals the stack tier drives
# torch is pinned to 2.13.0, which these machines carry as a CPU wheel: pip never pulls a
# CUDA build here. On a GPU node, install the CUDA build of torch 2.13.0 into the venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
test=0 fast=0
for arg in "$@"; do
  case "$arg" in
    --test) test=1 ;;
    --fast) fast=1 ;;
    *) echo "usage: scripts/install.sh [--test [--fast]]" >&2; exit 2 ;;
  esac
done
stack=$(( test && !fast ))

missing=()
need() {  # need PACKAGE CHECK...: the Debian PACKAGE is installed below unless CHECK passes
  local package=$1
  shift
  "$@" >/dev/null 2>&1 || missing+=("$package")
}
initdb_installed() {  # Debian keeps PostgreSQL's server binaries off PATH
  command -v initdb || ls /usr/lib/postgresql/*/bin/initdb
}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # Running: the eBPF collector's bcc, and kernel headers it compiles its probes against.
  need python3-bpfcc test -d /usr/lib/python3/dist-packages/bcc
  need linux-headers-amd64 compgen -G '/usr/src/linux-headers-*-common'
  if [ "$test" = 1 ]; then
    # gcc and libc headers: the tests build C stand-ins for libcuda, libcudart and NVML.
    need gcc command -v gcc
    need libc6-dev test -e /usr/include/stdio.h
    # systemd-analyze: the shipped unit (deploy/systemd) is checked by `verify`.
    need systemd command -v systemd-analyze
  fi
  if [ "$stack" = 1 ]; then
    # promtool and Prometheus (Debian `prometheus`): the daemon's metrics and the exported
    # rules are checked, and every dashboard query answered, by the real ones.
    need prometheus command -v promtool
    # Alertmanager: webhook bodies are compared with the real one's, and the shipped
    # configuration delivers an alert Prometheus fired.
    need prometheus-alertmanager command -v prometheus-alertmanager
    # PostgreSQL's server: the store's second backend.
    need postgresql initdb_installed
    # tmux: the CLI is tested in a real terminal.
    need tmux command -v tmux
    # iproute2's ip: engine discovery is tested on a server in a network namespace.
    need iproute2 command -v ip
    # A Docker engine, docker-compose and debootstrap: the compose stack, built from an
    # offline base image.
    need docker.io command -v dockerd
    need docker-compose command -v docker-compose
    need debootstrap command -v debootstrap
  fi
  if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
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
# A regular install, as users get it: the tests run against the installed package. The
# build folder goes first: setuptools reuses it, and a module moved or deleted since would
# still be installed.
rm -rf build ./*.egg-info
.venv/bin/python -m pip install -q --force-reinstall --no-deps .
if [ "$test" = 1 ]; then
  .venv/bin/python -m pip install -q ".[engine,test]"
  # The lowest and highest prometheus_client that pyproject allows: the tests read the
  # engine's telemetry files with both (tests/test_telemetry_format.py).
  for version in 0.20.0 0.26.0; do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
      -d .venv/compat-wheels "prometheus_client==$version"
  done
else
  .venv/bin/python -m pip install -q ".[engine]"
fi
