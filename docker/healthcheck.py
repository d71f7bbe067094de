"""The daemon image's HEALTHCHECK: GET /healthz on the daemon's own port (exit 0 when it
answers 200). Over TLS when AC_OBSERVE_WEB_CONFIG_FILE is set, the certificate unchecked
(this is the container's own loopback), presenting AC_OBSERVE_CERT and AC_OBSERVE_KEY
when they are set (a daemon that requires client certificates)."""
import os
import ssl
import sys
import urllib.request

port = os.environ.get("AC_OBSERVE_HEALTH_PORT", "9410")
context = None
scheme = "http"
if os.environ.get("AC_OBSERVE_WEB_CONFIG_FILE"):
    scheme = "https"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if os.environ.get("AC_OBSERVE_CERT"):
        context.load_cert_chain(os.environ["AC_OBSERVE_CERT"],
                                os.environ.get("AC_OBSERVE_KEY") or None)
try:
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/healthz", timeout=4,
                                context=context) as answer:
        sys.exit(0 if answer.status == 200 else 1)
except Exception as exc:  # noqa: BLE001 - any failure is unhealthy, said in one line
    print(f"unhealthy: {exc}", file=sys.stderr)
    sys.exit(1)
