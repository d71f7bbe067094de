"""A loopback webhook receiver for the alerting tests (the outbox, the evaluator, the
stack's Alertmanager and the compose stack all deliver to one) and the secret its
deliveries are signed with."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# A Standard Webhooks secret (whsec_ + base64) the receivers in the tests' alerting files
# are given; the tests verify each delivery's signature with it.
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


class WebhookReceiver:
    """A loopback webhook receiver: records every request; `mode` picks the answer
    (ok, 500, 410, 429, hang) and `down()` closes its port (connections refused)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.requests: list[tuple[dict, bytes]] = []
        self.mode = "ok"
        self.hang_seconds = 3.0  # "hang": answer after this, or once `release` is set
        self.release = threading.Event()
        self.retry_after = None
        self.answer_after = 0.0  # seconds before any answer (a slow receiver)
        self.received: list[float] = []  # time.time() each request came
        self.answered: list[float] = []  # time.time() of each answer sent
        self.port = None
        self._server = None
        self.up()

    def up(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                owner.received.append(time.time())
                body = self.rfile.read(int(self.headers["content-length"]))
                owner.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if owner.mode == "hang":
                    owner.release.wait(owner.hang_seconds)
                if owner.answer_after:
                    time.sleep(owner.answer_after)
                status = {"ok": 200, "500": 500, "410": 410, "429": 429, "hang": 200}[owner.mode]
                self.send_response(status)
                if owner.retry_after:
                    self.send_header("Retry-After", owner.retry_after)
                self.send_header("content-length", "0")
                self.end_headers()
                owner.answered.append(time.time())

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer((self.host, self.port or 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def down(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/hook"
