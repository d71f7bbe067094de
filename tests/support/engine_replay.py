"""A stand-in vLLM or SGLang server: it serves a captured `/metrics` file
(tests/data/engines/) over real HTTP, its counters and histogram buckets advanced by
what the test scripts (observations into the capture's own bucket edges, counter
increments, gauge values, a restart), so the figures a reader should find are known
exactly. It can also misbehave as a hostile endpoint would (`mode`)."""
from __future__ import annotations

import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

DATA = Path(__file__).resolve().parent.parent / "data" / "engines"
MODES = ("normal", "slow", "drip_head", "drip_body", "redirect", "html", "huge",
         "wrong_type", "http_500")


class EngineReplay:
    def __init__(self, capture: str, host: str = "127.0.0.1", port: int = 0):
        self.text = (DATA / capture).read_text()
        # [family name, type, help, [[sample name, labels, value], ...]] in file order
        self.families = [[f.name, f.type, f.documentation,
                          [[s.name, dict(s.labels), s.value] for s in f.samples]]
                         for f in text_string_to_metric_families(self.text)]
        self.mode = "normal"
        self.redirect_to = ""  # mode "redirect": a 302 to this URL
        self.scrapes = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    # ----- the script ---------------------------------------------------------------------

    def _samples(self, family: str):
        for name, _, _, samples in self.families:
            if name == family:
                return samples
        raise KeyError(family)

    def observe(self, family: str, value: float, count: int = 1) -> None:
        """`count` observations of `value` into a histogram, in its own edges."""
        with self._lock:
            for sample in self._samples(family):
                name, labels = sample[0], sample[1]
                if name == family + "_bucket" and value <= float(labels["le"]):
                    sample[2] += count
                elif name == family + "_count":
                    sample[2] += count
                elif name == family + "_sum":
                    sample[2] += value * count

    def inc(self, family: str, amount: float) -> None:
        """A counter (family name without _total) up by `amount`."""
        with self._lock:
            for sample in self._samples(family):
                if sample[0] == family + "_total":
                    sample[2] += amount

    def set(self, family: str, value: float) -> None:
        with self._lock:
            for sample in self._samples(family):
                sample[2] = value

    def restart(self) -> None:
        """The engine restarted: every counter and histogram from zero."""
        with self._lock:
            for _, typ, _, samples in self.families:
                if typ in ("counter", "histogram"):
                    for sample in samples:
                        if not sample[0].endswith("_created"):
                            sample[2] = 0.0

    # ----- serving ------------------------------------------------------------------------

    def render(self) -> str:
        with self._lock:
            out = []
            for name, typ, help_text, samples in self.families:
                exposed = name + "_total" if typ == "counter" else name
                out.append(f"# HELP {exposed} {help_text}\n# TYPE {exposed} {typ}\n")
                for sample_name, labels, value in samples:
                    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                    out.append(f"{sample_name}{{{text}}} {floatToGoString(value)}\n"
                               if text else f"{sample_name} {floatToGoString(value)}\n")
            return "".join(out)

    def body(self) -> tuple[int, bytes]:
        mode = self.mode
        if mode == "slow":
            time.sleep(5)
        if mode == "html":
            return 200, b"<html><body><h1>502 Bad Gateway</h1></body></html>\n"
        if mode == "http_500":
            return 500, b"internal error\n"
        text = self.render()
        if mode == "huge":
            text += "# " + "x" * (5 * 1024 * 1024) + "\n"
        if mode == "wrong_type":  # a gauge declared a counter
            text = text.replace("# TYPE vllm:num_requests_running gauge",
                                "# TYPE vllm:num_requests_running counter", 1)
        return 200, text.encode()

    def _handler(self):
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                replay.scrapes += 1
                status, body = replay.body()
                if replay.mode == "redirect":
                    status, body = 302, b""
                location = f"Location: {replay.redirect_to}\r\n" if status == 302 else ""
                answer = (f"HTTP/1.1 {status} OK\r\nContent-Type: text/plain; version=0.0.4"
                          f"\r\n{location}Content-Length: {len(body)}\r\n\r\n"
                          ).encode() + body
                # drip_*: from the head's or the body's start, a byte every 0.1 s (each recv
                # well in time) for 10 s
                start = answer.index(b"\r\n\r\n") + 4 if replay.mode == "drip_body" else 0
                dripping = replay.mode.startswith("drip_")
                try:
                    self.wfile.write(answer[:start])
                    for byte in answer[start:start + 100] if dripping else b"":
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.1)
                    self.wfile.write(answer[start + 100:] if dripping else answer[start:])
                except OSError:
                    pass  # the reader gave up (a timeout test)
                self.close_connection = True

            def log_message(self, *args):
                pass

        return Handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def is_close(a: float, b: float, rel: float = 0.01) -> bool:
    return math.isclose(a, b, rel_tol=rel)
