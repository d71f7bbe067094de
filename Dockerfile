# ac-observe's images, two targets of one file fed by one source stage:
#   engine (the default target): the bundled engine, with torch
#   daemon: the daemon, the CLI and the gateway, no torch (`--target daemon`; ~1/10 the
#           size): a node that runs vLLM needs nothing more
#
#   CPU (the default):  docker compose build
#   NVIDIA GPU node:    docker compose -f docker-compose.yml -f docker-compose.gpu.yml build
#                       (TORCH_INDEX_URL picks the CUDA build of the same torch release)
#
# The base image and the torch build are arguments, so the same file serves a GPU node, a
# CPU laptop and a machine with no registry (a base imported from debootstrap, the torch
# wheel from a local folder; see tests/test_compose.py).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS python
ENV PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PATH=/opt/ac-observe/bin:$PATH \
    AC_OBSERVE_TELEMETRY_DIR=/telemetry AC_OBSERVE_STATE_DIR=/var/lib/ac-observe

# python3 and venv (the python image has them; a bare Debian base gets them from apt).
RUN if ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi

# The sources, once, for the wheel both targets install.
FROM python AS source
COPY pyproject.toml README.md LICENSE /src/
COPY contract /src/contract
COPY engine /src/engine
COPY daemon /src/daemon
COPY collectors /src/collectors
COPY gateway /src/gateway
COPY dashboards /src/dashboards

# A CA bundle for pip behind a TLS-intercepting proxy: a file under docker/ in the build
# context (docker/ca.pem, docker/certs/proxy.pem), named by its path from the context.
# (Wheels in docker/wheels stay in the stage that copies them: the folder holds only what
# a machine without an index needs, and is empty otherwise.)
FROM python AS build
ARG PIP_CERT=
COPY docker/ /tmp/build/
COPY --from=source /src /src
RUN case "$PIP_CERT" in ""|docker/?*) ;; *) \
      echo "PIP_CERT=$PIP_CERT: name a file under docker/ (e.g. docker/ca.pem)" >&2; \
      exit 2;; esac \
 && export PIP_CERT="${PIP_CERT:+/tmp/build/${PIP_CERT#docker/}}" \
 && if [ -n "$PIP_CERT" ] && [ ! -f "$PIP_CERT" ]; then \
      echo "PIP_CERT: no such file in the build context's docker/ folder" >&2; exit 2; \
    fi \
 && python3 -m venv /opt/build \
 && /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels /src

# The daemon: no torch. It runs as root for eBPF; with AC_OBSERVE_COLLECTORS leaving ebpf
# out it runs as any user: --user 10002:10002 --group-add 10001 with --telemetry-owner
# 10001 to read the engine image's telemetry through its group, never as the engines'
# own uid (dashboards/kubernetes/unprivileged/daemon.yaml), 65534 otherwise.
FROM python AS daemon
ARG PIP_CERT=
ARG DAEMON_EXTRAS=postgres
# 1: python3-bpfcc from apt for the eBPF collector (0: leave it out; the collector is then
# down, saying bcc is missing, and the others run on).
ARG WITH_BCC=1
COPY docker/ /tmp/build/
COPY --from=build /wheels /tmp/wheels
RUN export PIP_CERT="${PIP_CERT:+/tmp/build/${PIP_CERT#docker/}}" \
 && python3 -m venv /opt/ac-observe \
 && pip install --find-links /tmp/build/wheels \
      "$(ls /tmp/wheels/ac_observe-*.whl)[${DAEMON_EXTRAS}]" \
 && rm -rf /tmp/build /tmp/wheels \
 && ac-observe --version \
 && if python -c "import torch" 2>/dev/null; then echo "torch in the daemon image" >&2; \
      exit 1; fi
RUN if [ "$WITH_BCC" = 1 ]; then \
      if [ ! -d /usr/lib/python3/dist-packages/bcc ]; then \
        apt-get update && apt-get install -y --no-install-recommends python3-bpfcc \
        && rm -rf /var/lib/apt/lists/*; \
      fi \
      && echo /usr/lib/python3/dist-packages > \
         "$(python -c 'import site; print(site.getsitepackages()[0])')/bcc-dist.pth" \
      && python -c "import bcc"; \
    fi
COPY docker/healthcheck.py /opt/ac-observe/healthcheck.py
# /healthz on the daemon's port: over TLS when AC_OBSERVE_WEB_CONFIG_FILE is set (the
# certificate unchecked: this is the daemon's own loopback), with AC_OBSERVE_CERT/_KEY
# when it asks for a client certificate.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/opt/ac-observe/healthcheck.py"]
VOLUME ["/var/lib/ac-observe"]
EXPOSE 9410
ENTRYPOINT ["ac-observe"]
CMD ["daemon", "--help"]

# The engine (and every other command): torch, the engine extra; run as uid 10001.
FROM python AS engine
ARG PIP_CERT=
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=engine,postgres
COPY docker/ /tmp/build/
COPY --from=build /wheels /tmp/wheels
RUN export PIP_CERT="${PIP_CERT:+/tmp/build/${PIP_CERT#docker/}}" \
 && python3 -m venv /opt/ac-observe \
 && pip install --find-links /tmp/build/wheels --extra-index-url "$TORCH_INDEX_URL" \
      "$TORCH_SPEC" \
 && pip install --find-links /tmp/build/wheels \
      "$(ls /tmp/wheels/ac_observe-*.whl)[${EXTRAS}]" \
 && rm -rf /tmp/build /tmp/wheels \
 && ac-observe --version
# The engine runs as a fixed non-root user, uid and gid 10001, which owns /telemetry (a
# new volume there takes its owner from the image): a root daemon reads that uid's
# telemetry when told it (--telemetry-owner 10001, AC_OBSERVE_TELEMETRY_OWNER; see
# docker-compose.yml and docs/fleet.md). Numeric, so Kubernetes' runAsNonRoot can check it.
ARG ENGINE_UID=10001
RUN groupadd --system --gid "$ENGINE_UID" ac-engine \
 && useradd --system --uid "$ENGINE_UID" --gid "$ENGINE_UID" --create-home \
      --home-dir /home/ac-engine --shell /usr/sbin/nologin ac-engine \
 && install -d -o "$ENGINE_UID" -g "$ENGINE_UID" -m 0755 /telemetry /var/lib/ac-observe
USER 10001:10001
VOLUME ["/telemetry"]
EXPOSE 8000 9410
ENTRYPOINT ["ac-observe"]
CMD ["--help"]
