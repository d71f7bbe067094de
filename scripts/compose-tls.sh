#!/usr/bin/env bash
# Certificates for the compose stack's TLS between Prometheus and the daemon
# (docs/tls.md): a CA and the daemon's certificate, for the names Prometheus (daemon) and
# the host (localhost, 127.0.0.1) reach it by, written to secrets/tls/ once (delete the
# folder, or pass --force, to make new ones). Needs openssl.
set -euo pipefail
cd "$(dirname "$0")/.."
out=secrets/tls
if [ -f "$out/daemon.crt" ] && [ "${1:-}" != "--force" ]; then
  echo "$out/daemon.crt exists (--force makes new certificates)"; exit 0
fi
mkdir -p -m 700 secrets "$out"
cd "$out"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 \
  -subj "/CN=ac-observe compose CA" -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -subj "/CN=daemon" -keyout daemon.key -out daemon.csr 2>/dev/null
printf "subjectAltName=DNS:daemon,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n" \
  > daemon.ext
openssl x509 -req -in daemon.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 825 \
  -extfile daemon.ext -out daemon.crt 2>/dev/null
rm -f daemon.csr daemon.ext ca.srl
# Prometheus reads the CA as `nobody`; the keys stay their owner's (the daemon runs as
# root), and the 700 folder keeps others out.
chmod 644 ca.crt daemon.crt
chmod 600 ca.key daemon.key
echo "wrote $PWD/{ca.crt,daemon.crt,daemon.key} (CA key: ca.key)"
