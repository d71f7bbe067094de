# ac-observe: one image for the engine and the daemon (`ac-observe engine|daemon ...`).
#
#   CPU (the default):  docker compose build
#   NVIDIA GPU node:    docker compose -f docker-compose.yml -f docker-compose.gpu.yml build
#                       (TORCH_INDEX_URL picks the CUDA build of the same torch release)
#
# The base image and the torch build are arguments, so the same file serves a GPU node, a
# CPU laptop and a machine with no registry (a base imported from debootstrap, the torch
# wheel from a local folder; see tests/test_compose.py).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A CA bundle for pip behind a TLS-intercepting proxy: a file under docker/ in the build
# context (docker/ca.pem, docker/certs/proxy.pem), named by its path from the context.
ARG PIP_CERT=
ARG EXTRAS=engine,postgres
# 1: python3-bpfcc from apt for the eBPF collector (0: leave it out; the collector is then
# down, saying bcc is missing, and the others run on).
ARG WITH_BCC=1

ENV PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PATH=/opt/ac-observe/bin:$PATH \
    AC_OBSERVE_TELEMETRY_DIR=/telemetry AC_OBSERVE_STATE_DIR=/var/lib/ac-observe

# python3 and venv (the python image has them; a bare Debian base gets them from apt).
RUN if ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi

# (Wheels in docker/wheels stay in this layer's history: the folder holds only what a
# machine without an index needs, and is empty otherwise.)
COPY docker/ /tmp/build/
RUN case "$PIP_CERT" in ""|docker/?*) ;; *) \
      echo "PIP_CERT=$PIP_CERT: name a file under docker/ (e.g. docker/ca.pem)" >&2; \
      exit 2;; esac \
 && export PIP_CERT="${PIP_CERT:+/tmp/build/${PIP_CERT#docker/}}" \
 && if [ -n "$PIP_CERT" ] && [ ! -f "$PIP_CERT" ]; then \
      echo "PIP_CERT: no such file in the build context's docker/ folder" >&2; exit 2; \
    fi \
 && python3 -m venv /opt/ac-observe \
 && pip install --find-links /tmp/build/wheels --extra-index-url "$TORCH_INDEX_URL" \
      "$TORCH_SPEC"

COPY pyproject.toml README.md /src/
COPY contract /src/contract
COPY engine /src/engine
COPY daemon /src/daemon
COPY collectors /src/collectors
COPY gateway /src/gateway
COPY dashboards /src/dashboards
RUN export PIP_CERT="${PIP_CERT:+/tmp/build/${PIP_CERT#docker/}}" \
 && pip install "/src[${EXTRAS}]" && rm -rf /tmp/build \
 && ac-observe --version

# bcc (the eBPF collector) comes from the distribution where there is one; without it the
# daemon's ebpf collector is down with the reason and the others run on.
RUN if [ "$WITH_BCC" = 1 ]; then \
      if [ ! -d /usr/lib/python3/dist-packages/bcc ]; then \
        apt-get update && apt-get install -y --no-install-recommends python3-bpfcc \
        && rm -rf /var/lib/apt/lists/*; \
      fi \
      && echo /usr/lib/python3/dist-packages > \
         "$(python -c 'import site; print(site.getsitepackages()[0])')/bcc-dist.pth" \
      && python -c "import bcc"; \
    fi

VOLUME ["/telemetry", "/var/lib/ac-observe"]
EXPOSE 8000 9410
ENTRYPOINT ["ac-observe"]
CMD ["--help"]
